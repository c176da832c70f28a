"""Structural promises of the package, checked on its source: no import loop (top level,
inside functions and under TYPE_CHECKING) and none up a floor, no folder over a fifth of the
package, no module name used twice, no class over 25 methods, no module over 400 lines (one
concept per module), and documentation that stays short at the top and whose relative links
resolve. Other promises
are checked in a process of their own: e2e/test_architecture_processes.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pytest_layerparity"
MAX_METHODS = 25
MAX_README_LINES = 400
MAX_BENCH_README_LINES = 400
MAX_LINES = 400
#: The package's floors, bottom first: a module imports from its own folder (or module) and from
#: lower floors, never from its floor's other folders or from above. Each folder or top-level
#: module of the package stands on one.
FLOORS = (
    ("", "errors", "options", "selection", "state", "hookspecs", "ops"),  # "": the package's __init__
    ("compare", "distributed"),  # judging; the process group
    ("report", "store"),
    ("capture",),
    ("model",),  # loading the model
    ("noise",),  # the simulated noise, its runs and wider passes
    ("reference", "backends"),  # the extraction; the target devices
    ("ports",),
    ("replay",),  # the target side: the layer under test on the device
    ("session",),
    ("suites", "offline", "option_uses"),
    ("plugin", "__main__"),
)
#: At most this share of the package's lines in one folder.
MAX_FOLDER_SHARE = 0.2


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
    assert "pytest_layerparity.replay.runner" in graph["pytest_layerparity.session"]  # a TYPE_CHECKING import
    assert "pytest_layerparity.model.streaming" in graph["pytest_layerparity.reference.extract"]  # in a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_loop():
    assert cycles(import_graph()) == []


def floor_of(module: str) -> tuple[str, int]:
    """The folder (or top-level module) of a package module, and its floor."""
    part = module.removeprefix("pytest_layerparity").lstrip(".").split(".")[0]
    floors = [i for i, names in enumerate(FLOORS) if part in names]
    assert floors, f"{module}: {part!r} stands on no floor (add it to FLOORS)"
    return part, floors[0]


def test_no_import_up_a_floor():
    upward = []
    for name, targets in import_graph().items():
        part, floor = floor_of(name)
        for target in sorted(targets):
            other, other_floor = floor_of(target)
            if other != part and other_floor >= floor:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_floors_are_read_right():
    assert floor_of("pytest_layerparity.noise.perturb") == ("noise", 5)
    assert floor_of("pytest_layerparity.errors")[1] < floor_of("pytest_layerparity.capture.calls")[1]


def test_no_folder_over_a_fifth_of_the_package():
    lines = {name: len(path.read_text().splitlines()) for name, path in package_modules().items()}
    total = sum(lines.values())
    folders: dict[str, int] = {}
    for name, count in lines.items():
        parts = name.split(".")
        if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
            folders[parts[1]] = folders.get(parts[1], 0) + count
    assert max(folders.values()) > 0
    big = {folder: f"{count / total:.0%}" for folder, count in folders.items() if count > MAX_FOLDER_SHARE * total}
    assert big == {}


def test_no_name_used_for_two_modules():
    seen: dict[str, list[str]] = {}
    for name, path in package_modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(name)
    assert {stem: names for stem, names in seen.items() if len(names) > 1} == {}


def test_no_class_over_25_methods():
    big = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                if count > MAX_METHODS:
                    big.append(f"{name}.{node.name}: {count} methods")
    assert big == []


def markdown_outside_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (links there are examples)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (lower case, punctuation but
    hyphens and underscores dropped, spaces as hyphens; a repeated slug gets -1, -2, ...)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file, or heading anchor in a markdown file, is missing."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown_outside_code(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not relative
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def test_heading_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# `--plan`: will it fit?\n\n```\n# not a heading\n```\n## NxDI's ports\n## NxDI's ports\n")
    assert heading_anchors(page) == {"--plan-will-it-fit", "nxdis-ports", "nxdis-ports-1"}


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_bench_readme_stays_short():
    lines = (ROOT / "bench" / "README.md").read_text().count("\n")
    assert lines <= MAX_BENCH_README_LINES, (
        f"bench/README.md has {lines} lines (at most {MAX_BENCH_README_LINES}): each bench's latest figures only; "
        "earlier runs live in git, result rows in bench/results/"
    )


def test_every_relative_link_of_the_docs_resolves():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", ROOT / "bench" / "verdicts.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "examples").glob("*/README.md"))
    assert len(pages) > 8
    broken = [link for page in pages for link in broken_links(page)]
    assert broken == []


def test_no_module_over_400_lines():
    long = []
    for name, path in package_modules().items():
        count = len(path.read_text().splitlines())
        if count > MAX_LINES:
            long.append(f"{name}: {count} lines (at most {MAX_LINES}: split it where its concepts part)")
    assert long == []


def resolves(dotted: list[str]) -> bool:
    """Whether the longest importable prefix of ``dotted`` has the rest as attributes."""
    import importlib

    for cut in range(len(dotted), 0, -1):
        try:
            obj = importlib.import_module(".".join(dotted[:cut]))
        except ImportError:
            continue
        for attribute in dotted[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_docstrings_cross_references_resolve():
    """A relative Sphinx role in the package's text (``:mod:`.wide_pass```, ``:func:`..x.y```)
    names a module or object that exists: a move leaves none pointing at an old name."""
    role = re.compile(r":(?:mod|func|class|meth|data|attr):`~?(\.+[\w.]+)`")
    missing = []
    for name, path in package_modules().items():
        here = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
        for reference in role.findall(path.read_text()):
            rest = reference.lstrip(".")
            base = here[: len(here) - (len(reference) - len(rest) - 1)]
            if not resolves([*base, *rest.split(".")]):
                missing.append(f"{name}: {reference}")
    assert missing == []
    assert resolves(["pytest_layerparity", "noise", "wide_pass", "FloorEvaluator"])
    assert not resolves(["pytest_layerparity", "noise", "floor"])
