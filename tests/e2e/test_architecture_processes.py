"""Structural promises of the package, checked in a process of their own: the judge usable
without a session, the offline compare without a session, a plugin module that loads nothing
heavy, and a README whose options table lists every option of ``pytest --help`` (moved from
unit/test_architecture.py, which checks the source alone)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from support import ROOT


def run_python(code: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_judge_needs_no_session():
    out = run_python(
        """
        import sys, torch
        from pytest_layerparity.compare.judge import judge
        from pytest_layerparity.options import make_settings
        g = torch.randn(2, 4, 8)
        outcome = judge(0, g, g.clone(), make_settings(), "float32", floor=g.double())
        heavy = [m for m in ("transformers", "pytest_layerparity.session", "pytest_layerparity.reference.extract")
                 if m in sys.modules]
        print(outcome.passed, heavy)
        """
    )
    assert out.strip() == "True []"


def test_offline_compare_builds_no_session(tmp_path):
    script = """
        import sys, torch
        from pytest_layerparity.store.callspec import CallRecord, encode_call, encode_output
        from pytest_layerparity.store.golden import GoldenStore
        x = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
        for folder, output in (("golden", x * 2), ("target", x * 2 + 1e-3)):
            record = CallRecord()
            encode_call((x,), {}, record)
            encode_output((output,), record)
            store = GoldenStore(folder)
            store.begin({"dtype": "float32"}, compare_keys=("dtype",))
            store.write("layer_0", record.tensors, {"kind": "layer", "layer": 0, "call": record.spec})
        from pytest_layerparity.__main__ import main
        code = main(["compare", "golden", "target", "--verdict", "table"])
        heavy = [m for m in ("transformers", "pytest_layerparity.session") if m in sys.modules]
        print("exit", code, heavy)
        """
    out = run_python(script, cwd=tmp_path)
    assert out.splitlines()[1].split()[:2] == ["layer_0", "pass"]
    assert out.splitlines()[-1] == "exit 0 []"


def test_the_plugin_module_loads_nothing_heavy():
    out = run_python(
        """
        import sys
        import pytest_layerparity.plugin
        print(sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


@functools.cache
def help_text() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_options() -> list[str]:
    """The flags of the plugin's group of ``pytest --help``."""
    section = help_text().split("per-layer parity of model ports (pytest-layerparity):", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next section heading
    return re.findall(r"^\s{2}(--[a-z0-9-]+)", section, flags=re.MULTILINE)


def help_ini_keys() -> list[str]:
    """The plugin's ini keys in ``pytest --help``."""
    return re.findall(r"^\s{2}(layerparity_[a-z0-9_]+) \(", help_text(), flags=re.MULTILINE)


def readme_table() -> tuple[set[str], set[str]]:
    """The flags and the ini keys of README.md's options table: a row's first cell names its
    flags or (ini only) its keys; a flag's row marked in the ini column is its key too."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    flags: set[str] = set()
    keys: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first, ini = re.split(r"(?<!\\)\|", line)[1:3]  # a cell's own | is written \|
        row_flags = re.findall(r"`(--[a-z0-9-]+)", first)
        flags.update(row_flags)
        keys.update(re.findall(r"`(layerparity_[a-z0-9_]+)", first + ini))
        if ini.strip():
            keys.update(f"layerparity_{flag[2:].replace('-', '_')}" for flag in row_flags)
    return flags, keys


def test_every_option_of_pytest_help_is_in_the_readme_table():
    options = help_options()
    assert "--gpu-golden" in options and "--near-ties" in options
    flags, keys = readme_table()
    missing = [flag for flag in options if flag not in flags]
    assert missing == [], f"options missing from README.md's options table: {missing}"
    gone = sorted(flags - set(options))
    assert gone == [], f"README.md's options table lists flags pytest --help does not: {gone}"
    ini_keys = help_ini_keys()
    assert "layerparity_max_abs_diff" in ini_keys
    missing = [key for key in ini_keys if key not in keys]
    assert missing == [], f"ini keys missing from README.md's options table: {missing}"


def test_pytest_help_lists_at_most_30_options_of_the_plugin():
    options = help_options()
    assert len(options) == len(set(options))
    assert len(options) <= 30, options
