"""Module tracking: which ``nn.Module`` is running the current aten op.

:func:`open_module_tracker` registers, on every submodule of a model, a forward
pre-hook that pushes the module onto :class:`ModuleInfo`'s stack and a forward
hook (``always_call=True``, so an exception inside ``forward`` still pops) that
pops it.  For the backward pass it does what ``torch.utils.module_tracker``
does: after a module's forward, a multi-grad hook on its outputs makes it the
current module once their gradients are ready (its backward starts), and a
multi-grad hook on its inputs makes its parent current again once theirs are
(its backward is done).  In backward the current path is the forward stack
the module ran in (so the same path as in forward), which also copes with
modules whose inputs need no grad (their "done" hook never fires) and with
outer modules sharing an inner module's output.  Backward state is kept per
autograd graph task, since the engine may run device work on its own threads;
forward stacks are per thread.  Independent branches that autograd
interleaves can still be attributed to the branch that started last.

The path shown in logs is the class names joined by ``/``:
``MiniMaxM2DecoderLayer/MiniMaxM2Attention/Linear``.  The dotted attribute
path of the innermost module (``layers.0.self_attn.q_proj``) is kept too.

The hooks are plain ``nn.Module`` hooks and run outside the dispatcher, so
they work unchanged under a ``TorchDispatchMode``.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["ModuleInfo", "ModuleTrackerHandle", "open_module_tracker"]


@dataclass(frozen=True)
class ModuleInfo:
    """One frame of the module stack; the classmethods read the current stack.

    ``name`` is the module's class name, ``qualname`` its dotted path inside the
    tracked model (``''`` for the root), ``path`` the class names of the whole
    stack up to and including this frame joined by ``/``.
    """

    name: str
    qualname: str
    path: str
    module_id: int

    _local = threading.local()
    _bw_stacks: ClassVar[dict[int, list]] = {}  # graph task id -> stack (not a dataclass field)
    _bw_lock = threading.Lock()

    # -- reading ---------------------------------------------------------
    @classmethod
    def current_stack(cls) -> list[ModuleInfo]:
        """The frames of the current thread's forward stack, or of the running
        backward graph task's stack while autograd is executing."""
        task = torch._C._current_graph_task_id()
        if task != -1:
            return cls._bw_stacks.get(task, [])
        return cls._fw_stack()

    @classmethod
    def current(cls) -> ModuleInfo | None:
        st = cls.current_stack()
        return st[-1] if st else None

    @classmethod
    def current_path(cls) -> str:
        st = cls.current_stack()
        return st[-1].path if st else ""

    @classmethod
    def current_qualname(cls) -> str:
        st = cls.current_stack()
        return st[-1].qualname if st else ""

    @classmethod
    def reset(cls) -> None:
        """Forget every stack (e.g. after an interrupted run)."""
        cls._local.stack = []
        with cls._bw_lock:
            cls._bw_stacks.clear()

    # -- internals -------------------------------------------------------
    @classmethod
    def _fw_stack(cls) -> list[ModuleInfo]:
        st = getattr(cls._local, "stack", None)
        if st is None:
            st = cls._local.stack = []
        return st

    @classmethod
    def _push(cls, stack: list, module: nn.Module, qualname: str) -> None:
        name = type(module).__name__
        path = f"{stack[-1].path}/{name}" if stack else name
        stack.append(ModuleInfo(name, qualname, path, id(module)))

    @staticmethod
    def _pop(stack: list, module: nn.Module) -> None:
        mid = id(module)
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].module_id == mid:
                del stack[i:]
                return

    @classmethod
    def _bw_enter(cls, chain: tuple) -> None:
        """A module's backward starts (its outputs' grads are ready); ``chain``
        is the forward stack it ran in, itself last.  If it is already on the
        current chain (an outer module whose output is an inner module's output:
        both hooks fire on the same tensor, inner first), nothing changes."""
        task = torch._C._current_graph_task_id()
        mid = chain[-1].module_id
        with cls._bw_lock:
            if task != -1 and len(cls._bw_stacks) > 64:  # drop finished tasks
                for k in [k for k in cls._bw_stacks if k != task][:32]:
                    del cls._bw_stacks[k]
            current = cls._bw_stacks.get(task)
            if current and any(f.module_id == mid for f in current):
                return
            cls._bw_stacks[task] = list(chain)

    @classmethod
    def _bw_exit(cls, chain: tuple) -> None:
        """A module's backward is done (its inputs' grads are ready): back to
        its parent's chain, if it is on the current one."""
        task = torch._C._current_graph_task_id()
        mid = chain[-1].module_id
        with cls._bw_lock:
            current = cls._bw_stacks.get(task)
            if current and any(f.module_id == mid for f in current):
                if len(chain) > 1:
                    cls._bw_stacks[task] = list(chain[:-1])
                else:
                    del cls._bw_stacks[task]


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "to_tuple") and callable(x.to_tuple):  # HF ModelOutput
            walk(x.to_tuple())

    walk(obj)
    return out


class ModuleTrackerHandle:
    """Returned by :func:`open_module_tracker`; ``.remove()`` takes the hooks off."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._handles: list[Any] = []
        self.active = True

    def remove(self) -> None:
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        m = self._model()
        if m is not None and _TRACKED.get(m) is self:
            del _TRACKED[m]

    def __enter__(self) -> ModuleTrackerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


_TRACKED: weakref.WeakKeyDictionary[nn.Module, ModuleTrackerHandle] = weakref.WeakKeyDictionary()


def open_module_tracker(model: nn.Module, backward: bool = True) -> ModuleTrackerHandle:
    """Track ``model``'s submodules so that op logs carry the module path.

    Calling it again on an already tracked model returns the existing handle.
    ``backward=False`` skips the autograd hooks (forward paths only).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"open_module_tracker expects an nn.Module, got {type(model)!r}")
    existing = _TRACKED.get(model)
    if existing is not None and existing.active:
        return existing
    handle = ModuleTrackerHandle(model)

    for qualname, mod in model.named_modules():

        def pre_hook(module, inputs, kwargs, _q=qualname):
            if not handle.active:
                return
            stack = ModuleInfo._fw_stack()
            ModuleInfo._push(stack, module, _q)
            if backward and torch.is_grad_enabled():
                ts = _grad_tensors((inputs, kwargs))
                if ts:
                    chain = tuple(stack)
                    torch.autograd.graph.register_multi_grad_hook(
                        ts, lambda _g, _c=chain: handle.active and ModuleInfo._bw_exit(_c)
                    )

        def post_hook(module, inputs, output, _q=qualname):
            if not handle.active:
                return
            stack = ModuleInfo._fw_stack()
            if backward and torch.is_grad_enabled():
                ts = _grad_tensors(output)
                if ts:
                    mid = id(module)
                    idx = max((i for i, f in enumerate(stack) if f.module_id == mid), default=None)
                    if idx is not None:
                        chain = tuple(stack[: idx + 1])
                        torch.autograd.graph.register_multi_grad_hook(
                            ts, lambda _g, _c=chain: handle.active and ModuleInfo._bw_enter(_c)
                        )
            ModuleInfo._pop(stack, module)

        handle._handles.append(mod.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True))
        handle._handles.append(mod.register_forward_hook(post_hook, always_call=True))
    _TRACKED[model] = handle
    return handle
