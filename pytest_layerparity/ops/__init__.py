"""Per-op checks of a model port against the CPU, for any device.

A reimplementation, for any PyTorch device (CPU, torch-xla, CUDA, ...), of
torch_musa's compare tool (``torch_musa.utils.compare_tool``):

``CompareWithCPU(enabled=True, atol=0.001, rtol=0.001, verbose=False,
target_list=None, white_list=None, dump_error_data=False, output_dir=None,
should_log_to_file=False, enable_ranks=None, start_step=0,
end_step=sys.maxsize, target_op=None)``
    A context manager (a ``TorchDispatchMode``): every aten op runs on its
    device and again on CPU copies of its inputs; results are compared with
    ``|dev - cpu| <= atol + rtol * |cpu|``.  ``target_op`` is an alias of
    ``target_list``.  ``.step()`` advances ``step_cnt``; only
    ``start_step <= step_cnt < end_step`` is checked.  Results:
    ``.failures`` (list of :class:`OpFailure`), ``.first_failure``,
    ``.skipped``, ``.stats``.

``NanInfTracker(enabled=True, target_list=None, white_list=None,
should_log_to_file=False, output_dir=None, enable_ranks=None, start_step=0,
end_step=sys.maxsize, dump_error_data=False)``
    Checks each op's outputs for NaN/Inf on the device (no CPU re-run);
    ``[WARNING] ... has nan/inf`` log lines, ``.first_failure`` /
    ``.first_nan_inf``.

``open_module_tracker(model)`` / ``ModuleInfo``
    Forward (and backward) hooks on every submodule, so log lines and
    records carry the module path ``DecoderLayer/Attention/Linear``.

``compare_for_single_op(path, op, atol, rtol)`` / ``nan_inf_track_for_single_op(path, op)``
    Replay an op saved with ``dump_error_data=True``:
    ``(correct, args, kwargs, out)``.

Logging goes to the ``logging`` logger ``pytest_layerparity.ops`` (per-op
chatter at INFO and only with ``verbose=True``; failures at ERROR; NaN/Inf at
WARNING) and, with ``should_log_to_file=True``, also to
``<output_dir>/compare_with_cpu_rank{rank}.log`` /
``nan_inf_tracker_rank{rank}.log`` (rank from torch.distributed if
initialised, else env ``RANK``, else 0).  ``enable_ranks=[0]`` makes the
tools no-ops on other ranks.  Log format (as torch_musa's)::

    2024-04-07, 15:11:10
    -------------------------  step = 0  ----------------------
    DecoderLayer/Attention/torch.ops.aten.view(forward) is in white_list, pass
    DecoderLayer/Attention/Linear/torch.ops.aten.addmm(forward) starts to run ...

    ============================
    [ERROR] DecoderLayer/Attention/Linear/torch.ops.aten.addmm(forward) fails to pass CompareWithCPU test
    ....... input .........
    0: Tensor <shape=torch.Size([16]), dtype=torch.float32, device=xla:0, size=16, >,
    ...
    ...... output ........
    Tensor <shape=...>

    ...... compare with cpu .......
    Tensor values are not close

    Element at index (0, 14) is not close: -0.845(xla:0) vs -0.8450(cpu)
    ...
    ============================

Dumps (``dump_error_data=True``) are written as
``<output_dir>/torch.ops.aten.addmm_inputs.safetensors`` and
``..._outputs.safetensors``: safetensors tensors plus a JSON description of
the args/kwargs structure in the safetensors metadata; loading never
unpickles anything (see :mod:`pytest_layerparity.ops._dump` for the format).

torch-xla: its ops are lazy, so comparing at op granularity materialises
every compared op (``torch_xla.sync()`` before copying inputs and after the
op): one XLA graph compile/execution per op, which is slow; restrict the
comparison with ``target_list`` on anything big.  torch_xla is imported only
when a tensor's device type is ``xla``.  NanInfTracker defers its checks on
non-CPU devices (no per-op sync).

Dispatch-mode notes: ``__torch_dispatch__`` runs with the mode popped, so the
CPU re-run and the comparison ops are not intercepted again; the module
tracker uses ordinary ``nn.Module`` hooks (outside the dispatcher); errors of
the CPU re-run (an op the CPU cannot run, even in float32) are logged and the
op is skipped.
"""

from ._compare_with_cpu import CompareError, CompareWithCPU
from ._dump import DUMP_FORMAT, DumpFormatError, load_op_dump, save_op_dump
from ._names import DEFAULT_WHITE_LIST, op_display_name, resolve_op
from ._nan_inf import NanInfError, NanInfTracker
from ._single import compare_for_single_op, nan_inf_track_for_single_op
from ._tool import OpCheckError, OpFailure, get_rank
from ._tracker import ModuleInfo, ModuleTrackerHandle, open_module_tracker

__all__ = [
    "DEFAULT_WHITE_LIST",
    "DUMP_FORMAT",
    "CompareError",
    "CompareWithCPU",
    "DumpFormatError",
    "ModuleInfo",
    "ModuleTrackerHandle",
    "NanInfError",
    "NanInfTracker",
    "OpCheckError",
    "OpFailure",
    "compare_for_single_op",
    "get_rank",
    "load_op_dump",
    "nan_inf_track_for_single_op",
    "op_display_name",
    "open_module_tracker",
    "resolve_op",
    "save_op_dump",
]
