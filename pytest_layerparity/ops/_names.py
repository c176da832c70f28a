"""Operator names, user-given op lists and the default white list.

Names are shown the way torch_musa's compare tool shows them:
``torch.ops.aten.addmm`` (the overload packet).  List entries given by the
user (``target_list`` / ``target_op`` / ``white_list``) may be spelled

* ``'torch.ops.aten.addmm'`` / ``'aten.addmm'`` / ``'aten::addmm'``: every
  overload of the op,
* ``'torch.ops.aten.addmm.default'`` / ``'aten::addmm.default'``: one overload,
* ``'addmm'``: an op of that name in any namespace,
* an ``OpOverloadPacket`` / ``OpOverload`` object (``torch.ops.aten.addmm``),
* shell-style patterns (``'aten.empty*'``), matched with :mod:`fnmatch`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "DEFAULT_WHITE_LIST",
    "OpMatcher",
    "op_display_name",
    "op_overload_name",
    "resolve_op",
]

# Ops that are not worth comparing (or cannot be compared): aliasing and view
# ops (their data is the input's), uninitialised memory, copies/transfers,
# random ops, scalar extraction and bookkeeping.  On top of these names, every
# op whose schema says it is a view (``OpOverload.is_view``), carries the
# ``view_copy`` tag (the functionalised ``*_copy`` twins that lazy backends
# such as torch-xla dispatch instead of views), the ``inplace_view`` tag, or
# the ``nondeterministic_seeded`` tag (random ops) is white-listed as well.
DEFAULT_WHITE_LIST: tuple[str, ...] = (
    # views / reshapes / aliasing
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten._reshape_alias",
    "aten.expand",
    "aten.expand_as",
    "aten.permute",
    "aten.transpose",
    "aten.t",
    "aten.squeeze",
    "aten.unsqueeze",
    "aten.as_strided",
    "aten.alias",
    "aten.slice",
    "aten.select",
    "aten.split",
    "aten.split_with_sizes",
    "aten.unbind",
    "aten.chunk",
    "aten.narrow",
    "aten.diagonal",
    "aten.unfold",
    "aten.view_as",
    "aten.view_as_real",
    "aten.view_as_complex",
    "aten.flatten",
    "aten.unflatten",
    "aten.movedim",
    "aten.swapaxes",
    "aten.contiguous",
    "aten.detach",
    "aten.lift_fresh",
    "aten.lift_fresh_copy",
    # uninitialised memory / metadata
    "aten.empty*",
    "aten.new_empty*",
    "aten.resize_",
    "aten.resize_as_",
    "aten.set_",
    "aten._has_compatible_shallow_copy_type",
    "aten.is_same_size",
    # copies / transfers
    "aten.copy_",
    "aten._to_copy",
    "aten.clone",
    "aten._copy_from",
    "aten._copy_from_and_resize",
    "aten.to",
    "aten.pin_memory",
    "aten._pin_memory",
    "aten.is_pinned",
    # random
    "aten.rand*",
    "aten.normal*",
    "aten.bernoulli*",
    "aten.uniform*",
    "aten.random_*",
    "aten.exponential_",
    "aten.geometric_",
    "aten.cauchy_",
    "aten.log_normal_",
    "aten.multinomial",
    "aten.poisson",
    "aten.*dropout*",
    "aten.rrelu*",
    # scalars / bookkeeping
    "aten._local_scalar_dense",
    "aten.item",
    "aten._record_function_*",
    "aten.record_stream",
    "aten._propagate_xla_data",
    "aten.sym_*",
    "aten._assert*",
    "profiler.*",
)

_AUTO_WHITE_TAGS = ("view_copy", "inplace_view", "nondeterministic_seeded")

# Copies that NanInfTracker checks even though they are in the default white
# list: a dtype conversion (fp32 -> fp16/fp8) overflows to Inf, the classic
# mixed-precision NaN/Inf source.
NAN_INF_CHECKED = ("aten._to_copy", "aten.copy_", "aten._copy_from", "aten._copy_from_and_resize", "aten.to")


def op_display_name(func: Any) -> str:
    """``torch.ops.<ns>.<op>`` for an OpOverload / OpOverloadPacket."""
    packet = getattr(func, "overloadpacket", func)
    qual = getattr(packet, "_qualified_op_name", None)
    if qual:
        ns, _, name = qual.partition("::")
        return f"torch.ops.{ns}.{name}"
    return f"torch.ops.{getattr(func, '__module__', '?')}.{getattr(func, '__name__', repr(func))}"


def op_overload_name(func: Any) -> str:
    """``<ns>::<op>.<overload>`` (the schema name), e.g. ``aten::addmm.default``."""
    schema = getattr(func, "_schema", None)
    if schema is not None and hasattr(func, "_overloadname"):
        return f"{schema.name}.{func._overloadname}"
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "_qualified_op_name", repr(func))


def _keys(func: Any) -> tuple[str, str, str]:
    """(``ns.op``, ``ns.op.overload``, ``op``) for an OpOverload."""
    packet = getattr(func, "overloadpacket", func)
    qual = getattr(packet, "_qualified_op_name", "") or ""
    ns, _, name = qual.partition("::")
    overload = getattr(func, "_overloadname", None) or "default"
    return f"{ns}.{name}", f"{ns}.{name}.{overload}", name


def _normalise_entry(entry: Any) -> str:
    if not isinstance(entry, str):
        if hasattr(entry, "_overloadname") and hasattr(entry, "_schema"):  # OpOverload
            return f"{entry._schema.name.replace('::', '.')}.{entry._overloadname}"
        qual = getattr(entry, "_qualified_op_name", None)  # OpOverloadPacket
        if qual:
            return qual.replace("::", ".")
        raise TypeError(f"cannot use {entry!r} as an op name")
    s = entry.strip()
    if s.startswith("torch.ops."):
        s = s[len("torch.ops.") :]
    return s.replace("::", ".")


class OpMatcher:
    """Matches OpOverloads against a list of names/patterns (cached per op)."""

    def __init__(self, entries: Iterable[Any] | None = None):
        self.entries: list[str] = [_normalise_entry(e) for e in (entries or ())]
        # exact names by level (0: op name, 1: ns.op, 2: ns.op.overload); patterns apart
        self._exact: tuple[set, set, set] = (set(), set(), set())
        self._patterns: list[tuple[int, str]] = []
        for e in self.entries:
            level = min(e.count("."), 2)
            if any(c in e for c in "*?["):
                self._patterns.append((level, e))
            else:
                self._exact[level].add(e)
        self._cache: dict[Any, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __contains__(self, func: Any) -> bool:
        hit = self._cache.get(func)
        if hit is None:
            hit = self._cache[func] = self._match(func)
        return hit

    def _match(self, func: Any) -> bool:
        packet, overload, name = _keys(func)
        keys = (name, packet, overload)
        if any(keys[i] in self._exact[i] for i in range(3)):
            return True
        return any(fnmatch.fnmatchcase(keys[level], pat) for level, pat in self._patterns)


_DEFAULT_MATCHER: OpMatcher | None = None
_NAN_INF_MATCHER: OpMatcher | None = None
_AUTO_CACHE: dict[tuple, bool] = {}


def is_default_white_listed(func: Any, for_nan_inf: bool = False) -> bool:
    """In :data:`DEFAULT_WHITE_LIST` or white-listed by schema/tags (cached,
    process-wide); with ``for_nan_inf`` the dtype copies of
    :data:`NAN_INF_CHECKED` are not white-listed."""
    global _DEFAULT_MATCHER, _NAN_INF_MATCHER
    key = (func, for_nan_inf)
    hit = _AUTO_CACHE.get(key)
    if hit is None:
        if _DEFAULT_MATCHER is None:
            _DEFAULT_MATCHER = OpMatcher(DEFAULT_WHITE_LIST)
            _NAN_INF_MATCHER = OpMatcher(NAN_INF_CHECKED)
        hit = func in _DEFAULT_MATCHER or is_auto_white_listed(func)
        if hit and for_nan_inf and func in _NAN_INF_MATCHER:
            hit = False
        _AUTO_CACHE[key] = hit
    return hit


def is_auto_white_listed(func: Any) -> bool:
    """Views, functionalised view copies and seeded-random ops (by schema/tags)."""
    try:
        if getattr(func, "is_view", False):
            return True
        tags = {getattr(t, "name", str(t)) for t in getattr(func, "tags", ())}
    except Exception:  # pragma: no cover - exotic op objects
        return False
    return any(t in tags for t in _AUTO_WHITE_TAGS)


def resolve_op(op: Any) -> Any:
    """Turn ``'torch.ops.aten.addmm'``, ``'aten::addmm.default'``, ``'addmm'``
    (aten assumed) or a callable into a callable op."""
    if not isinstance(op, str):
        if callable(op):
            return op
        raise TypeError(f"op must be a callable or a name, got {op!r}")
    s = _normalise_entry(op)
    parts = s.split(".")
    if len(parts) == 1:
        parts = ["aten", *parts]
    obj: Any = torch.ops
    try:
        obj = getattr(getattr(obj, parts[0]), parts[1])
        if len(parts) >= 3:
            obj = getattr(obj, parts[2])
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"unknown op {op!r}: {e}") from None
    return obj
