"""pytest glue: options, the tests the plugin adds, fixtures and reports. Nothing heavy is
imported here; torch and transformers load only when a layerparity mode is switched on."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import hookspecs
from .option_uses import current_settings, unused_ini_lines
from .options import (
    RunMode,
    add_options,
    conftest_builds_layer,
    read_settings,
    refuse_moved_flags,
)
from .state import NODEID, REGEN_KEY, SESSION_KEY

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    from .options import Settings
    from .session import LayerParitySession
    from .store.golden import GoldenEntry

__all__ = ["SESSION_KEY"]
REPORTER_NAME = "layerparity-reporter"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> Generator:
    """A flag that left the command line for an ini key is refused with the key and ``-o`` to
    write (pytest would only say "unrecognized arguments"); checked once the conftests have
    declared their own options."""
    result = yield
    refuse_moved_flags(parser, args)
    return result


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """Before pytest configures: torch's idle threads set to sleep (before torch loads), the
    torchrun ranks other than 0 quieted; ``--plan`` prints the memory plan and exits without
    running tests."""
    from .distributed.env import idle_threads_sleep
    from .distributed.runs import quiet_secondary_rank

    if read_settings(config).mode is not None:
        idle_threads_sleep(os.environ, sys.modules)
    quiet_secondary_rank(config)
    if not config.getoption("layerparity_plan", False):
        return None
    from .errors import ModelError
    from .model.build import capped_attention
    from .model.devices import resolve_golden_device
    from .reference.plan import RunOptions
    from .reference.plan_text import plan_lines
    from .session import LayerParitySession

    settings = current_settings(config)
    keep_xla_out()
    try:
        session = LayerParitySession(settings, Path(config.rootpath))
        lines = plan_lines(
            session.model,
            session.golden_dtype_name,
            settings.batch_size,
            settings.seq_len,
            resolve_golden_device(settings.golden_device),
            RunOptions(
                attn_implementation=settings.attn_implementation or capped_attention(session.model.hf_config),
                precision_floor=not settings.no_precision_floor,
                envelope=settings.envelope_samples > 1,
                envelope_samples=settings.envelope_samples,
                decode_steps=settings.decode_steps,
            ),
        )
    except (ModelError, OSError, ValueError) as exc:
        raise pytest.UsageError(f"--plan: {exc}") from None
    for line in lines:
        print(line)
    return 0


def pytest_configure(config: pytest.Config) -> None:
    from .distributed.runs import PLUGIN_NAME, DistributedRuns

    settings = current_settings(config)
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(DistributedRuns(settings), PLUGIN_NAME)
    if settings.mode is None:
        return
    if settings.mode in (RunMode.EXTRACT, RunMode.VERIFY):
        keep_xla_out()
        from .model.memory import bound_reference_memory

        bound_reference_memory()
    nxdi_builder = None  # --port nxdi --target neuron: a conftest's builder in place of NxDI's (no SDK needed)
    if settings.mode == RunMode.PARITY and settings.compiled:
        nxdi_builder = config.hook.pytest_layerparity_nxdi_build_module(settings=settings)
    _check_installed(settings, sdk_builds=nxdi_builder is None)
    session = _start_session(config, settings, nxdi_builder)
    session.notes = unused_ini_lines(settings, config)
    config.stash[SESSION_KEY] = session
    if settings.mode == RunMode.PARITY and session.port is not None:
        from .ports.nxdi import PortError

        try:
            session.port.start()  # imports the port: one that cannot be imported is a usage error
        except PortError as exc:
            raise pytest.UsageError(str(exc)) from None
    if not hasattr(config, "workerinput"):
        from .report.reporter import LayerParityReporter

        config.pluginmanager.register(LayerParityReporter(settings, session.header_lines()), REPORTER_NAME)


def keep_xla_out() -> None:
    """The reference side (and --plan) needs no XLA: keep accelerate and transformers from
    importing torch-xla (a few hundred MB of memory, and its "Defaulting to PJRT_DEVICE=CPU"
    warning) just because it is installed."""
    if "torch_xla" not in sys.modules:
        os.environ.setdefault("USE_TORCH_XLA", "0")


def _check_installed(settings: Settings, sdk_builds: bool = True) -> None:
    from .backends import BackendUnavailable, check_installed

    target = settings.target_name
    try:
        check_installed("reference")
        if settings.mode == RunMode.PARITY and (target == "xla" or (target == "neuron" and sdk_builds)):
            check_installed(settings.target_name)
    except BackendUnavailable as exc:
        if settings.mode != RunMode.PARITY:
            flag = "--gpu-golden"
        else:
            flag = f"--{target}" if target in ("xla", "neuron") else f"--target {target}"
        raise pytest.UsageError(f"{flag}: {exc}") from None


def _start_session(config: pytest.Config, settings: Settings, nxdi_builder: Any = None) -> LayerParitySession:
    """The session, with everything that can be refused before a test runs checked."""
    from .errors import ModelError
    from .reference.inputs import check_prompt
    from .reference.support import (
        check_attention_mode,
        check_checkpoint_names,
        check_decode_cache,
        check_recurrent_depth,
    )
    from .report.progress import for_pytest
    from .selection import SelectionError
    from .session import LayerParitySession, check_store_exists
    from .store.golden import GoldenError

    def build_target_layer(**kwargs: Any) -> Any:
        return config.hook.pytest_layerparity_build_target_layer(**kwargs)

    def build_target_model(**kwargs: Any) -> Any:
        return config.hook.pytest_layerparity_build_target_model(**kwargs)

    session = LayerParitySession(
        settings,
        Path(config.rootpath),
        build_target_layer if conftest_builds_layer(config) else None,
        build_target_model,
        nxdi_builder,
    )
    session.progress = for_pytest(config)
    if conftest_builds_layer(config):
        from .replay.contract import hook_location

        impls = config.pluginmanager.hook.pytest_layerparity_build_target_layer.get_hookimpls()
        session.hook_where = hook_location(impls[-1].function)  # the one called first (firstresult)
    try:
        session.selected_layers  # noqa: B018  parsed now: a bad spec is a usage error
        session.layer_ranges  # noqa: B018
        if settings.mode in (RunMode.EXTRACT, RunMode.VERIFY) or (
            settings.mode == RunMode.PARITY and settings.port != "nxdi"
        ):
            check_checkpoint_names(session.model, session.selected_layers)
            check_attention_mode(session.model, settings.seq_len)
        if settings.mode in (RunMode.EXTRACT, RunMode.VERIFY):
            check_recurrent_depth(session.model, session.selected_layers)
        if settings.mode == RunMode.EXTRACT:  # (a verification re-runs the prompt alone)
            check_decode_cache(session.model, session.selected_layers, settings.decode_steps)
            check_prompt(settings, session.model.model_dir)
            if not hasattr(config, "workerinput"):  # the controller decides for its workers
                if settings.force_regen:
                    from .store.regen import Regeneration

                    regeneration = Regeneration(session.store.root)
                    regeneration.start()
                    config.stash[REGEN_KEY] = regeneration
                else:
                    session.reference.check_store_takes_extraction(session.selected_layers[:1])
        else:
            check_store_exists(session)
            session.check_store_matches_model()
            if not hasattr(config, "workerinput"):  # one layer's weights now: goldens of other weights refused once
                session.weights.check(session.selected_layers[:1], unreadable_ok=True)
    except (ModelError, SelectionError) as exc:
        raise pytest.UsageError(str(exc)) from None
    except GoldenError as exc:
        raise pytest.UsageError(f"refusing the golden store: {exc}") from None
    return session


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    regeneration = session.config.stash.get(REGEN_KEY, None)
    if regeneration is None:
        return
    complete = exitstatus == 0 and session.testsfailed == 0 and session.testscollected > 0
    line = regeneration.finish(complete)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.teardown()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = config.stash.get(SESSION_KEY, None)
    return session.header_lines() if session is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if isinstance(collector, pytest.Session):
        session = collector.config.stash.get(SESSION_KEY, None)
        if session is not None:
            import importlib

            from .store.golden import MODEL_LOGITS_KEY
            from .suites import suite_modules

            parity = session.settings.mode == RunMode.PARITY
            has_decode = parity and session.store.has_decode()
            has_model = parity and session.settings.layers == "all" and session.store.has(MODEL_LOGITS_KEY)
            for name in suite_modules(session.settings, bool(session.layer_ranges), has_decode, has_model):
                module = importlib.import_module(name)
                assert module.__file__ is not None
                report.result.append(pytest.Module.from_parent(collector, path=Path(module.__file__), nodeid=NODEID))
    return report


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "layerparity_case" not in metafunc.fixturenames:
        return
    from .selection import layer_key
    from .suites import CASE_KINDS

    session = metafunc.config.stash[SESSION_KEY]
    kind = getattr(metafunc.module, "CASES", None)
    if kind not in CASE_KINDS:
        raise pytest.UsageError(
            f"{metafunc.module.__name__}: CASES must be one of {', '.join(CASE_KINDS)}, not {kind!r}"
        )
    if kind == "layers":
        metafunc.parametrize(
            "layerparity_case", session.selected_layers, ids=[layer_key(i) for i in session.selected_layers]
        )
        return
    cases = session.layer_ranges if kind == "ranges" else session.chains
    metafunc.parametrize("layerparity_case", cases, ids=[r.id for r in cases])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A port that cannot be built as asked, or a build hook's layer that breaks the hook's
    contract, fails its test with a message that names the fix, not with a traceback through
    NxD or the layer; a breach met again at another layer is named in full once."""
    try:
        return (yield)
    except Exception as exc:
        nxdi = sys.modules.get("pytest_layerparity.ports.nxdi")
        contract = sys.modules.get("pytest_layerparity.replay.contract")
        if contract is not None and isinstance(exc, contract.ContractError):
            message = _breach_text(item, exc)
        elif nxdi is not None and isinstance(exc, nxdi.PortError):
            message = str(exc)
        else:
            raise
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


def _breach_text(item: pytest.Item, breach: Any) -> str:
    """The breach's message in the first test of this process that meets its kind, else a
    line that points at that test."""
    first = item.config.stash[SESSION_KEY].contract_breaches.setdefault(breach.kind, item.nodeid)
    if first == item.nodeid:
        return str(breach)
    return (
        f"layer {breach.index}: the layer the build hook returned breaks the hook's contract as it does in {first} "
        f"({breach.kind}): that test's failure says how, and the fix"
    )


@pytest.hookimpl
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say what the compile cache did in this process, and what the first weight swap's check
    found (neither is known to an xdist controller)."""
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return
    for line in (session.cache_summary(), session.swap_summary()):
        if line:
            terminalreporter.write_line(f"layerparity: {line}")


@pytest.fixture(scope="session")
def layerparity_session(pytestconfig: pytest.Config) -> LayerParitySession:
    """The session's :class:`~pytest_layerparity.session.LayerParitySession`: the model,
    the golden store and the target runtime, set up once per process."""
    session = pytestconfig.stash.get(SESSION_KEY, None)
    if session is None:
        pytest.fail("layerparity is not active: add --xla, --neuron, --target NAME or --gpu-golden", pytrace=False)
    return session


@pytest.fixture
def layerparity_record(request: pytest.FixtureRequest) -> Callable[[str, Any], None]:
    """Like ``record_property``: adds (name, value) to the test's user properties, which
    JUnit XML, xdist and the layerparity reports carry; without record_property's warning
    under the default ``junit_family = xunit2`` (the properties are written either way)."""

    def record(name: str, value: Any) -> None:
        request.node.user_properties.append((name, value))

    return record


@pytest.fixture
def layerparity_golden(request: pytest.FixtureRequest, layerparity_session: LayerParitySession) -> list[GoldenEntry]:
    """The golden entries of this test's layer(s), verified; an unusable golden errors the
    test at setup with the file and the command that regenerates it."""
    from .selection import LayerRange
    from .store.golden import GoldenError

    case = request.getfixturevalue("layerparity_case")
    layers = case.layers() if isinstance(case, LayerRange) else [case]
    try:
        return [layerparity_session.load_golden(i) for i in layers]
    except GoldenError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the except: the message is printed once


@pytest.fixture
def compare_with_cpu(tmp_path: Path) -> Callable[..., Any]:
    """A factory of :class:`pytest_layerparity.ops.CompareWithCPU` for your own tests:
    ``with compare_with_cpu(atol=1e-3, rtol=1e-3) as tool: model(x)``; dumps and logs go
    to the test's tmp_path unless ``output_dir`` is given. ``tool.failures`` lists the ops
    that failed."""
    from .ops import CompareWithCPU

    def make(**kwargs: Any) -> CompareWithCPU:
        kwargs.setdefault("output_dir", str(tmp_path / "compare_with_cpu"))
        return CompareWithCPU(**kwargs)

    return make


@pytest.fixture
def nan_inf_tracker(tmp_path: Path) -> Callable[..., Any]:
    """A factory of :class:`pytest_layerparity.ops.NanInfTracker` for your own tests:
    ``with nan_inf_tracker() as tracker: model(x)``, then ``tracker.first_failure``."""
    from .ops import NanInfTracker

    def make(**kwargs: Any) -> NanInfTracker:
        kwargs.setdefault("output_dir", str(tmp_path / "nan_inf_tracker"))
        return NanInfTracker(**kwargs)

    return make
