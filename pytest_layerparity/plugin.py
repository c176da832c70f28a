"""pytest glue: options, the tests the plugin adds, fixtures and reports. Nothing heavy is
imported here; torch and transformers load only when a layerparity mode is switched on."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from . import hookspecs
from .options import add_options, check_combinations, read_settings, resolve_paths

SESSION_KEY = pytest.StashKey["Any"]()
REPORTER_NAME = "layerparity-reporter"
NODEID = "layerparity"
_SUITES = {"parity": "suite_parity", "extract": "suite_extract", "verify": "suite_verify"}


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def _usage(exc: Exception) -> pytest.UsageError:
    return pytest.UsageError(str(exc))


def pytest_configure(config: pytest.Config) -> None:
    settings = resolve_paths(read_settings(config), config)
    check_combinations(settings)
    if settings.mode is None:
        return
    if settings.mode in ("extract", "verify") and "torch_xla" not in sys.modules:
        # The reference side needs no XLA; keep accelerate and transformers from importing
        # torch-xla (a few hundred MB of memory) just because it is installed.
        os.environ.setdefault("USE_TORCH_XLA", "0")
    from .backends import BackendUnavailable, check_installed
    from .golden import GoldenError
    from .modeling import ModelError
    from .selection import SelectionError
    from .session import LayerParitySession

    try:
        check_installed("reference")
        if settings.mode == "parity" and settings.target_name in ("xla", "neuron"):
            check_installed(settings.target_name)
    except BackendUnavailable as exc:
        target = settings.target_name
        flag = "--gpu-golden" if settings.mode != "parity" else (f"--{target}" if target in ("xla", "neuron") else f"--target {target}")
        raise pytest.UsageError(f"{flag}: {exc}") from None

    def build_target_layer(**kwargs: Any) -> Any:
        return config.hook.pytest_layerparity_build_target_layer(**kwargs)

    session = LayerParitySession(settings, Path(config.rootpath), build_target_layer)
    try:
        session.selected_layers
        session.layer_ranges
        if settings.mode == "extract":
            session.check_prompt()
        if settings.mode != "extract":
            session.check_store_matches_model()
    except (ModelError, SelectionError) as exc:
        raise _usage(exc) from None
    except GoldenError as exc:
        raise pytest.UsageError(f"refusing the golden store: {exc}") from None
    config.stash[SESSION_KEY] = session
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(LayerParityReporter(settings, session.header_lines()), REPORTER_NAME)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--plan``: print the memory plan and exit without running tests."""
    if not config.getoption("layerparity_plan", False):
        return None
    from .modeling import ModelError
    from .planning import plan_lines
    from .session import LayerParitySession

    try:
        session = LayerParitySession(resolve_paths(read_settings(config), config), Path(config.rootpath))
        lines = plan_lines(session)
    except (ModelError, OSError, ValueError) as exc:
        raise pytest.UsageError(f"--plan: {exc}") from None
    for line in lines:
        print(line)
    return 0


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.teardown()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = config.stash.get(SESSION_KEY, None)
    return session.header_lines() if session is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if isinstance(collector, pytest.Session):
        session = collector.config.stash.get(SESSION_KEY, None)
        if session is not None:
            import importlib

            names = [_SUITES[session.settings.mode]]
            if session.layer_ranges:
                names.append("suite_ranges")
            if session.settings.chain:
                names.append("suite_chain")
            if session.settings.bisect:
                names.append("suite_bisect")
            for name in names:
                module = importlib.import_module(f"pytest_layerparity.{name}")
                report.result.append(pytest.Module.from_parent(collector, path=Path(module.__file__), nodeid=NODEID))
    return report


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "layerparity_case" not in metafunc.fixturenames:
        return
    session = metafunc.config.stash[SESSION_KEY]
    name = metafunc.function.__name__
    if name == "test_layer_range_parity":
        cases: list[Any] = session.layer_ranges
        ids = [r.id for r in cases]
    elif name in ("test_chain_parity", "test_bisect"):
        cases = session.chains
        ids = [r.id for r in cases]
    else:
        cases = session.selected_layers
        ids = [f"layer_{i}" for i in cases]
    metafunc.parametrize("layerparity_case", cases, ids=ids)


@pytest.fixture(scope="session")
def layerparity_session(pytestconfig: pytest.Config) -> Any:
    """The session's :class:`~pytest_layerparity.session.LayerParitySession`: the model,
    the golden store and the target runtime, set up once per process."""
    session = pytestconfig.stash.get(SESSION_KEY, None)
    if session is None:
        pytest.fail("layerparity is not active: add --xla, --neuron, --target NAME or --gpu-golden", pytrace=False)
    return session


@pytest.fixture
def layerparity_record(request: pytest.FixtureRequest) -> Any:
    """Like ``record_property``: adds (name, value) to the test's user properties, which
    JUnit XML, xdist and the layerparity reports carry; without record_property's warning
    under the default ``junit_family = xunit2`` (the properties are written either way)."""

    def record(name: str, value: Any) -> None:
        request.node.user_properties.append((name, value))

    return record


@pytest.fixture
def layerparity_golden(request: pytest.FixtureRequest, layerparity_session: Any) -> Any:
    """The golden entries of this test's layer(s), verified; an unusable golden errors the
    test at setup with the file and the command that regenerates it."""
    from .golden import GoldenError
    from .selection import LayerRange

    case = request.getfixturevalue("layerparity_case")
    layers = case.layers() if isinstance(case, LayerRange) else [case]
    try:
        return [layerparity_session.load_golden(i) for i in layers]
    except GoldenError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def compare_with_cpu(tmp_path: Path) -> Any:
    """A factory of :class:`pytest_layerparity.ops.CompareWithCPU` for your own tests:
    ``with compare_with_cpu(atol=1e-3, rtol=1e-3) as tool: model(x)``; dumps and logs go
    to the test's tmp_path unless ``output_dir`` is given. ``tool.failures`` lists the ops
    that failed."""
    from .ops import CompareWithCPU

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("output_dir", str(tmp_path / "compare_with_cpu"))
        return CompareWithCPU(**kwargs)

    return make


@pytest.fixture
def nan_inf_tracker(tmp_path: Path) -> Any:
    """A factory of :class:`pytest_layerparity.ops.NanInfTracker` for your own tests:
    ``with nan_inf_tracker() as tracker: model(x)``, then ``tracker.first_failure``."""
    from .ops import NanInfTracker

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("output_dir", str(tmp_path / "nan_inf_tracker"))
        return NanInfTracker(**kwargs)

    return make


class LayerParityReporter:
    """Collects each layerparity test's properties (also from xdist workers, through the
    reports) for the terminal summary and ``--parity-report``."""

    def __init__(self, settings: Any, header: list[str] | None = None) -> None:
        self.settings = settings
        self.header = header or []
        self.entries: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.nodeid.startswith(f"{NODEID}::"):
            return
        if report.when == "call" or (report.when == "setup" and report.failed):
            from .report import reported_metrics

            props = dict(report.user_properties)
            metrics = reported_metrics(props)
            verdict = props.get("verdict") or ("error" if report.when == "setup" else ("pass" if report.passed else "fail"))
            if report.failed and verdict == "pass":
                verdict = "fail"
            self.entries.append({
                "nodeid": report.nodeid,
                "layers": props.get("layers", report.nodeid.rsplit("[", 1)[-1].rstrip("]").split("_", 1)[-1]),
                "verdict": verdict,
                "metrics": metrics,
                "message": report.longreprtext if report.failed else "",
                "properties": {k: v for k, v in props.items() if "." in k},
                "placement": props.get("placement"),
            })

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from .report import summary_lines

        lines = summary_lines(sorted(self.entries, key=lambda e: _case_order(e["nodeid"])))
        placements = sorted({e["placement"] for e in self.entries if e.get("placement")})
        if lines:
            terminalreporter.write_sep("=", "layerparity summary")
            for placement in placements:
                terminalreporter.write_line(f"reference placement: {placement}")
            for line in lines:
                terminalreporter.write_line(line)
        if self.settings.parity_report:
            from .report import write_reports

            ordered = sorted(self.entries, key=lambda e: _case_order(e["nodeid"]))
            paths = write_reports(self.settings.parity_report, ordered, header=self.header)
            terminalreporter.write_line(f"layerparity: reports written to {', '.join(str(p) for p in paths)}")


def _case_order(nodeid: str) -> tuple:
    import re

    numbers = [int(n) for n in re.findall(r"\d+", nodeid.rsplit("[", 1)[-1])]
    return (nodeid.split("[")[0], numbers)


# -- runs over several processes (distributed.py): torchrun ranks, xdist workers pinned to
# their own NeuronCores / GPU, the compile cache's location. Registered before every other
# pytest_configure so that it sees the options before junitxml and the session read them.


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_distributed(config: pytest.Config) -> None:
    from .distributed import PLUGIN_NAME, DistributedRuns

    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(DistributedRuns(), PLUGIN_NAME)
