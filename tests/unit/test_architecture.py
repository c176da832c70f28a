"""Structural promises of the package, checked on its source: no import loop (top level,
inside functions and under TYPE_CHECKING), no class over 25 methods, the judge usable
without a session, the offline compare without a session, a plugin module that loads
nothing heavy, and a README whose options table lists every option of ``pytest --help``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pytest_layerparity"
MAX_METHODS = 25


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, wherever the import statement stands."""
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read_right():
    graph = import_graph()
    assert "pytest_layerparity.compare.judge" in graph["pytest_layerparity.offline"]
    assert "pytest_layerparity.target.runner" in graph["pytest_layerparity.session"]  # a TYPE_CHECKING import
    assert "pytest_layerparity.reference.streaming" in graph["pytest_layerparity.reference.extract"]  # in a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_loop():
    assert cycles(import_graph()) == []


def test_no_class_over_25_methods():
    big = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                if count > MAX_METHODS:
                    big.append(f"{name}.{node.name}: {count} methods")
    assert big == []


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
