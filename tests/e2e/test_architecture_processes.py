"""Structural promises of the package, checked in a process of their own: the judge usable
without a session, the offline compare without a session, a plugin module that loads nothing
heavy, and a README whose options table lists every option of ``pytest --help`` (moved from
unit/test_architecture.py, which checks the source alone)."""

from __future__ import annotations

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
        outcome = judge(0, g, g.clone(), make_settings(), "float32", reference=g.double())
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


def help_options() -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    section = done.stdout.split("per-layer parity of model ports (pytest-layerparity):", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next section heading
    return re.findall(r"^\s{2}(--[a-z0-9-]+)", section, flags=re.MULTILINE)


def readme_options() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    flags = set()
    for line in table.splitlines():
        if line.startswith("| `--"):
            first_cell = line.split("|")[1]
            flags.update(re.findall(r"`(--[a-z0-9-]+)", first_cell))
    return flags


def test_every_option_of_pytest_help_is_in_the_readme_table():
    options = help_options()
    assert len(options) > 40 and "--gpu-golden" in options
    missing = [flag for flag in options if flag not in readme_options()]
    assert missing == [], f"options missing from README.md's options table: {missing}"
