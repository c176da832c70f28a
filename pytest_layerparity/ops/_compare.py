"""Tensor trees: CPU copies, float32 upcast and comparison (the log's text: :mod:`._format`).

Everything here runs inside ``__torch_dispatch__`` (the mode is popped there,
so these ops are not intercepted again) or in the single-op replay helpers.
torch_xla is imported lazily, only when a tensor's device type is ``xla``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
MAX_PRINTED_INDICES = 20


# ---------------------------------------------------------------- trees ----
def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Map ``fn`` over the leaves of nested lists/tuples/dicts."""
    if isinstance(obj, (list, tuple)):
        mapped = [tree_map(fn, x) for x in obj]
        if isinstance(obj, tuple):
            return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
        return mapped
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(obj)
    return out


def tree_leaves_with_path(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        res: list[tuple[str, Any]] = []
        for i, x in enumerate(obj):
            res.extend(tree_leaves_with_path(x, f"{prefix}[{i}]" if prefix else str(i)))
        return res
    return [(prefix, obj)]


# -------------------------------------------------------------- devices ----
def sync_xla_if_needed(tensors: Iterable[torch.Tensor]) -> None:
    """Materialise pending lazy torch-xla computations (one graph execution).

    Cutting the graph here also keeps later per-op executions small: without a
    sync, ``.cpu()`` of an xla tensor computes it but leaves its IR in place,
    so every later op would re-execute the whole history.
    """
    for t in tensors:
        if t.device.type == "xla":
            import torch_xla

            torch_xla.sync()
            return


def device_label(args: Any, kwargs: Any, out: Any = None) -> str:
    for t in tree_tensors((args, kwargs, out)):
        if t.device.type != "cpu":
            return str(t.device)
    for _, x in tree_leaves_with_path((args, list((kwargs or {}).values()))):
        if isinstance(x, torch.device) and x.type != "cpu":
            return str(x)
    return "cpu"


def comparable(tensors: Iterable[torch.Tensor]) -> bool:
    """Plain strided tensors with storage (no meta/sparse/subclass tensors)."""
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if t.layout != torch.strided or t.device.type == "meta":
            return False
    return True


_WRITTEN: dict[Any, tuple[frozenset, frozenset]] = {}


def written_args(func: Any) -> tuple[frozenset, frozenset]:
    """(positional indices, kwarg names) that the op's schema marks as written."""
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = _written_args(func)
    return hit


def _written_args(func: Any) -> tuple[frozenset, frozenset]:
    pos, names = set(), set()
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            ai = a.alias_info
            if ai is not None and ai.is_write:
                if a.kwarg_only:
                    names.add(a.name)
                else:
                    pos.add(i)
                    names.add(a.name)
    return frozenset(pos), frozenset(names)


def cpu_inputs(args: tuple, kwargs: dict, written: tuple[frozenset, frozenset]):
    """CPU copies of an op's inputs, taken BEFORE the device op runs.

    Tensors already on the CPU are shared unless the op writes them (then
    cloned, so that neither run sees the other's mutation).  Device objects
    in the arguments (``device=xla:0`` of factory ops) become ``cpu``.
    Returns (args_cpu, kwargs_cpu, devices) where ``devices`` maps
    ``id(cpu_copy)`` to the original device string (for dumps).
    """
    sync_xla_if_needed(tree_tensors((args, kwargs)))
    devices: dict[int, str] = {}
    pos, names = written

    def conv(x: Any, write: bool) -> Any:
        if isinstance(x, torch.Tensor):
            c = (x.detach().clone() if write else x.detach()) if x.device.type == "cpu" else x.detach().to("cpu")
            devices[id(c)] = str(x.device)
            return c
        if isinstance(x, torch.device) and x.type != "cpu":
            return torch.device("cpu")
        return x

    with torch.no_grad():
        a = tuple(tree_map(lambda x, w=(i in pos): conv(x, w), v) for i, v in enumerate(args))
        k = {n: tree_map(lambda x, w=(n in names): conv(x, w), v) for n, v in kwargs.items()}
    return a, k, devices


def has_low_precision(obj: Any) -> bool:
    for leaf in tree_leaves_with_path(obj):
        x = leaf[1]
        if isinstance(x, dict):
            if has_low_precision(list(x.values())):
                return True
        elif (isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION) or (
            isinstance(x, torch.dtype) and x in LOW_PRECISION
        ):
            return True
    return False


def upcast_low_precision(obj: Any) -> Any:
    """Half/BF16 tensors (and dtype arguments) -> float32; the rest unchanged."""

    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION:
            return x.to(torch.float32)
        if isinstance(x, torch.dtype) and x in LOW_PRECISION:
            return torch.float32
        return x

    return tree_map(conv, obj)


def run_on_cpu(func: Callable, args: tuple, kwargs: dict):
    """Run ``func`` on CPU inputs; if that raises and Half/BF16 is involved,
    upcast to float32 and retry.  Returns (out, args, kwargs, upcast_error)
    where args/kwargs are those actually used (their written tensors hold the
    mutated values) and upcast_error is the first attempt's message or None."""
    with torch.no_grad():
        try:
            return func(*args, **kwargs), args, kwargs, None
        except Exception as e1:
            if not has_low_precision((args, kwargs)):
                raise
            a32 = upcast_low_precision(args)
            k32 = upcast_low_precision(kwargs)
            return func(*a32, **k32), a32, k32, str(e1).strip().splitlines()[0] if str(e1).strip() else repr(e1)


# ------------------------------------------------------------ compare ----
@dataclass
class Mismatch:
    """One output (or mutated input) whose device value differs from the CPU one."""

    where: str
    reason: str  # 'values' | 'shape' | 'type' | 'structure'
    lines: list[str] = field(default_factory=list)
    num_bad: int = 0
    numel: int = 0
    max_abs_diff: float | None = None
    first_bad_index: tuple | None = None
    device_value: Any = None
    cpu_value: Any = None


def _compare_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if a.is_complex or b.is_complex:
        return torch.complex128 if torch.complex128 in (a, b) else torch.complex64
    if torch.float64 in (a, b):
        return torch.float64
    return torch.float32


def _fmt_index(idx: tuple) -> str:
    return str(tuple(int(i) for i in idx))


def _item(t: torch.Tensor) -> Any:
    v = t.item()
    return v


def compare_tensor(
    dev: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, dev_label: str, where: str
) -> Mismatch | None:
    """``dev`` is the device result already copied to the CPU, ``ref`` the CPU
    result.  Floating/complex values: |dev - ref| <= atol + rtol * |ref|, NaNs
    equal NaNs, infinities must match; integer/bool values: exact."""
    if dev.shape != ref.shape:
        return Mismatch(
            where,
            "shape",
            [f"Tensor shapes differ: {dev.shape}({dev_label}) vs {ref.shape}(cpu)"],
            device_value=dev,
            cpu_value=ref,
        )
    floating = dev.is_floating_point() or dev.is_complex() or ref.is_floating_point() or ref.is_complex()
    if floating:
        ct = _compare_dtype(dev.dtype, ref.dtype)
        a, b = dev.to(ct), ref.to(ct)
        if torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return None
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        diff = (a - b).abs()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        diff = torch.where(same, torch.zeros((), dtype=diff.dtype), diff)
        diff = torch.nan_to_num(diff, nan=math.inf)
        max_abs = float(diff.max()) if diff.numel() else 0.0
    else:
        if torch.equal(dev, ref.to(dev.dtype)) if dev.dtype != ref.dtype else torch.equal(dev, ref):
            return None
        bad = dev.to(torch.int64) != ref.to(torch.int64) if dev.dtype != ref.dtype else dev != ref
        max_abs = float((dev.to(torch.float64) - ref.to(torch.float64)).abs().max()) if dev.numel() else 0.0
    flat = bad.reshape(-1)
    total = int(flat.sum())
    first = flat.nonzero().reshape(-1)[:MAX_PRINTED_INDICES]
    if dev.dim() == 0:
        idxs = [()] * len(first)
    else:
        coords = torch.unravel_index(first, dev.shape)
        idxs = [tuple(int(c[i]) for c in coords) for i in range(len(first))]
    lines = ["Tensor values are not close" if where == "output" else f"{where}: Tensor values are not close"]
    if total > MAX_PRINTED_INDICES:
        lines += ["", f"Too many indices (total {total}) to print ", "", "..."]
    lines.append("")
    for idx in idxs:
        dv = _item(dev[idx]) if idx else _item(dev)
        cv = _item(ref[idx]) if idx else _item(ref)
        lines.append(f"Element at index {_fmt_index(idx)} is not close: {dv}({dev_label}) vs {cv}(cpu)")
    return Mismatch(
        where,
        "values",
        lines,
        num_bad=total,
        numel=dev.numel(),
        max_abs_diff=max_abs,
        first_bad_index=idxs[0] if idxs else None,
        device_value=dev,
        cpu_value=ref,
    )


def compare_values(
    dev_items: list[tuple[str, Any, Any]], cpu_items: list[tuple[str, Any]], atol: float, rtol: float, dev_label: str
) -> list[Mismatch]:
    """Compare flattened leaves: ``dev_items`` are (where, value_on_cpu,
    original_value) and ``cpu_items`` (where, value)."""
    res: list[Mismatch] = []
    if len(dev_items) != len(cpu_items):
        res.append(
            Mismatch(
                "output",
                "structure",
                [f"Output structures differ: {len(dev_items)} leaves({dev_label}) vs {len(cpu_items)} leaves(cpu)"],
            )
        )
        return res
    for (where, d, orig), (_, c) in zip(dev_items, cpu_items, strict=False):
        if isinstance(d, torch.Tensor) and isinstance(c, torch.Tensor):
            m = compare_tensor(d, c, atol, rtol, dev_label, where)
            if m is not None:
                m.device_value = orig
                res.append(m)
        elif isinstance(d, torch.Tensor) or isinstance(c, torch.Tensor):
            res.append(
                Mismatch(where, "type", [f"{where}: {type(d).__name__}({dev_label}) vs {type(c).__name__}(cpu)"])
            )
        elif isinstance(d, float) or isinstance(c, float):
            try:
                ok = (math.isnan(d) and math.isnan(c)) or d == c or abs(d - c) <= atol + rtol * abs(c)
            except TypeError:
                ok = False
            if not ok:
                res.append(
                    Mismatch(
                        where,
                        "values",
                        [f"{where}: {d}({dev_label}) vs {c}(cpu)"],
                        num_bad=1,
                        numel=1,
                        max_abs_diff=_safe_absdiff(d, c),
                        first_bad_index=(),
                    )
                )
        else:
            try:
                ok = bool(d == c)
            except Exception:
                ok = False
            if not ok:
                res.append(
                    Mismatch(
                        where,
                        "values",
                        [f"{where}: {d!r}({dev_label}) vs {c!r}(cpu)"],
                        num_bad=1,
                        numel=1,
                        max_abs_diff=_safe_absdiff(d, c),
                        first_bad_index=(),
                    )
                )
    return res


def _safe_absdiff(a: Any, b: Any) -> float | None:
    try:
        return float(abs(a - b))
    except Exception:
        return None
