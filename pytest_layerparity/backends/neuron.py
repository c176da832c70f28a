"""AWS Trainium / Inferentia through torch-neuronx and neuronx-distributed.

Neuron modeling code (neuronx-distributed-inference's layers) builds only inside an initialised
distributed environment, which may be initialised once per process. ``setup()`` does it once
per session, the way neuronx-distributed's own ``trace()`` does on torch 2.x:

1. RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT where unset (torchrun's values win;
   MASTER_PORT defaults to a free port, so that xdist workers and concurrent sessions do not
   rendezvous on one port);
2. ``torch.distributed.init_process_group("xla")`` (the env:// rendezvous on those variables),
   unless a process group exists already;
3. ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_degree,
   lnc_size=...)``, unless ``parallel_state.model_parallel_is_initialized()``: the logical
   NeuronCore config as NxDI's NeuronConfig resolves it (:func:`logical_nc_config`; its
   tensor-parallel groups are laid over a Trn2 node's cores by it).

``teardown()`` undoes what ``setup()`` did and nothing else: ``destroy_model_parallel()``,
``torch.distributed.destroy_process_group()``, and the variables it set.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from .base import Backend, BackendUnavailable
from .torch_xla_device import TorchXlaBackend

DEFAULT_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}
CACHE_URL = "NEURON_COMPILE_CACHE_URL"


def apply_env_defaults(environ: MutableMapping[str, str] | None = None, port: int | None = None) -> dict[str, str]:
    """Set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where unset (torchrun's values win).
    MASTER_PORT defaults to ``port`` or a port nothing listens on. Returns what was set here."""
    environ = os.environ if environ is None else environ
    applied = {}
    for key, value in DEFAULT_ENV.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    if "MASTER_PORT" not in environ:
        from ..distributed.env import free_port

        environ["MASTER_PORT"] = applied["MASTER_PORT"] = str(
            port if port is not None else free_port(environ["MASTER_ADDR"])
        )
    return applied


def restore_env(applied: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Remove the variables ``apply_env_defaults`` (or the cache setup) set, unless changed since."""
    environ = os.environ if environ is None else environ
    for key, value in applied.items():
        if environ.get(key) == value:
            del environ[key]


def configure_compile_cache(location: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point Neuron's compile cache at ``location`` (a folder, or a URL such as s3://...) through
    NEURON_COMPILE_CACHE_URL. A ``--cache_dir`` in NEURON_CC_FLAGS takes precedence over that
    variable in the Neuron tools, so a different one there is refused rather than ignored.
    Returns the variables set here."""
    environ = os.environ if environ is None else environ
    flags = environ.get("NEURON_CC_FLAGS", "")
    match = re.search(r"--cache_dir[= ](\S+)", flags)
    if match and match.group(1) != location:
        raise BackendUnavailable(
            f"--compile-cache {location}: NEURON_CC_FLAGS sets --cache_dir={match.group(1)}, which takes precedence "
            f"over {CACHE_URL}; drop one of them"
        )
    current = environ.get(CACHE_URL)
    if current is not None and current != location:
        raise BackendUnavailable(f"--compile-cache {location}: {CACHE_URL} is already {current}; drop one of them")
    if "://" not in location:
        Path(location).mkdir(parents=True, exist_ok=True)
    if current is None:
        environ[CACHE_URL] = location
        return {CACHE_URL: location}
    return {}


def release_distributed(parallel_state_owned: bool, group_owned: bool, applied: Mapping[str, str]) -> None:
    """Undo what a setup did and nothing else: ``destroy_model_parallel()`` and
    ``destroy_process_group()`` where it set them up, and the variables it set."""
    import torch.distributed as dist

    if parallel_state_owned:
        import_parallel_state().destroy_model_parallel()
    if group_owned and dist.is_initialized():
        dist.destroy_process_group()
    restore_env(applied)


def import_parallel_state() -> Any:
    """neuronx-distributed's parallel_state module, or BackendUnavailable with the install hint."""
    try:
        from neuronx_distributed.parallel_layers import parallel_state
    except ImportError as exc:
        from .install import INSTALL_HINTS

        raise BackendUnavailable(
            f"--neuron: neuronx_distributed.parallel_layers.parallel_state does not import ({exc}); if the PyPI "
            f"placeholder of that name is what is installed, pip uninstall it, then {INSTALL_HINTS['neuron']}"
        ) from exc
    return parallel_state


#: The platforms whose NeuronCores NxDI's NeuronConfig groups two to a logical core by default.
TWO_CORE_PLATFORMS = ("trn2", "trn3")


def logical_nc_config(option: int | None) -> tuple[int, str]:
    """The logical NeuronCore config, as NxDI's NeuronConfig resolves it (``_get_lnc``), and
    where it came from: ``NEURON_LOGICAL_NC_CONFIG``, else ``layerparity_logical_nc_config``
    (``option``), else the platform's (``torch_neuronx.utils.get_platform_target()``: 2 on
    trn2 and trn3, else 1). A variable and an option that disagree are refused."""
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise BackendUnavailable(f"NEURON_LOGICAL_NC_CONFIG={env!r} is not a positive whole number")
        if option is not None and int(env) != option:
            raise BackendUnavailable(
                f"NEURON_LOGICAL_NC_CONFIG={env} and -o layerparity_logical_nc_config={option} disagree; NxDI's "
                "NeuronConfig takes the variable: unset it, or drop the option"
            )
        return int(env), "NEURON_LOGICAL_NC_CONFIG"
    if option is not None:
        return option, "layerparity_logical_nc_config"
    try:
        from torch_neuronx.utils import get_platform_target
    except ImportError as exc:
        raise BackendUnavailable(
            f"--neuron: torch_neuronx.utils.get_platform_target does not import ({exc}), so the platform's logical "
            "NeuronCore config is not known; set -o layerparity_logical_nc_config=N (2 on Trn2 with LNC2)"
        ) from exc
    platform = get_platform_target()
    return (2 if platform in TWO_CORE_PLATFORMS else 1), f"NxDI's NeuronConfig default on {platform}"


#: A NeuronCore's tensor engine accumulates every matmul in float32 (its PSUM), float16 ones too.
NEURON_SIXTEEN_BIT_SUMS = False


class NeuronBackend(TorchXlaBackend):
    name = "neuron"
    sixteen_bit_sums = NEURON_SIXTEEN_BIT_SUMS

    def __init__(
        self, tp_degree: int = 1, compile_cache: str | None = None, logical_nc_config: int | None = None
    ) -> None:
        self.tp_degree = tp_degree
        self.compile_cache = compile_cache
        self.logical_nc_option = logical_nc_config
        self.lnc: tuple[int, str] | None = None  # (value, where it came from), once resolved
        self._device = None
        self._env_applied: dict[str, str] = {}
        self._we_initialised_pg = False
        self._we_initialised_mp = False
        self.process_group_backend: str | None = None
        self.tensor_parallel_size: int | None = None

    def setup(self) -> None:
        if self._device is not None:
            return
        import torch.distributed as dist

        applied: dict[str, str] = {}
        if self.compile_cache:
            applied.update(configure_compile_cache(self.compile_cache))
        applied.update(apply_env_defaults())
        self._env_applied = applied
        try:
            import torch_xla

            parallel_state = import_parallel_state()
            if not dist.is_initialized():
                import torch_xla.distributed.xla_backend

                # As neuronx_distributed.trace.trace does on torch 2.x (init_method="pjrt://" was for torch 2.0).
                dist.init_process_group("xla")
                self._we_initialised_pg = True
            self.process_group_backend = str(dist.get_backend())
            if not parallel_state.model_parallel_is_initialized():
                self.lnc = logical_nc_config(self.logical_nc_option)
                with warnings.catch_warnings():
                    # NxD's own notice: its collective set-up calls torch-xla's deprecated mark_step
                    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"neuronx_distributed")
                    parallel_state.initialize_model_parallel(
                        tensor_model_parallel_size=self.tp_degree, lnc_size=self.lnc[0]
                    )
                self._we_initialised_mp = True
            self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_size()
            self._device = torch_xla.device()
        except BaseException:
            self.teardown()  # leave nothing half set up: the next layer's test tries again
            raise

    def teardown(self) -> None:
        release_distributed(self._we_initialised_mp, self._we_initialised_pg, self._env_applied)
        self._we_initialised_mp = self._we_initialised_pg = False
        self._env_applied = {}
        self._device = None

    def describe(self) -> str:
        pg = "set up here" if self._we_initialised_pg else "already set up"
        mp = "set up here" if self._we_initialised_mp else "already set up"
        text = (
            f"neuron {self._device} (RANK {os.environ.get('RANK')} of WORLD_SIZE {os.environ.get('WORLD_SIZE')}, "
            f"tensor parallel {self.tensor_parallel_size}; process group {self.process_group_backend} {pg}, "
            f"parallel_state {mp}"
        )
        if self.lnc is not None:
            text += f" with logical NeuronCore config {self.lnc[0]} ({self.lnc[1]})"
        if self.compile_cache:
            text += f"; compile cache {self.compile_cache}"
        return text + ")"


class CompiledProgramsBackend(Backend):
    """``--port nxdi --target neuron``: the programs NxDI's builder compiles take and return host
    tensors, so the tests' tensors stay on the CPU. No process group is set up here (ModelBuilder
    sets up its own for each trace). What this sets: the compile cache, and the NeuronCores of
    the process (``NEURON_RT_VISIBLE_CORES``, 0 to tp_degree-1 where unset; a setting with
    fewer cores than tp_degree is refused)."""

    name = "neuron"
    sixteen_bit_sums = NEURON_SIXTEEN_BIT_SUMS

    def __init__(self, tp_degree: int = 1, compile_cache: str | None = None) -> None:
        self.tp_degree = tp_degree
        self.compile_cache = compile_cache
        self._env_applied: dict[str, str] = {}
        self.cores: str | None = None

    def setup(self) -> None:
        from ..distributed.env import NEURON_CORES, format_core_list, parse_core_list

        applied: dict[str, str] = {}
        visible = os.environ.get(NEURON_CORES)
        if visible is None:
            applied[NEURON_CORES] = os.environ[NEURON_CORES] = format_core_list(list(range(self.tp_degree)))
        elif (count := len(parse_core_list(visible))) < self.tp_degree:
            raise BackendUnavailable(
                f"--tp-degree {self.tp_degree}: each layer's program runs on {self.tp_degree} NeuronCores, and "
                f"{NEURON_CORES}={visible} has {count}; widen it or lower --tp-degree"
            )
        if self.compile_cache:
            applied.update(configure_compile_cache(self.compile_cache))
        self._env_applied = applied
        self.cores = os.environ[NEURON_CORES]

    def teardown(self) -> None:
        restore_env(self._env_applied)
        self._env_applied = {}

    def describe(self) -> str:
        cores = f"NeuronCores {self.cores}" if self.cores else "NeuronCores not yet chosen"
        text = f"neuron (NxDI's compiled programs, called with host tensors; {cores}"
        if self.compile_cache:
            text += f"; compile cache {self.compile_cache}"
        return text + ")"
