"""The reference process's own memory: glibc made to give large frees back at once, the CPU
matmul libraries' kernel caches bounded, and freed heap memory returned to the system, so
that a reference run's memory follows the layer it holds and not the run's length."""

from __future__ import annotations

import os

_LARGE_FREES_RELEASED = False


def release_large_frees() -> None:
    """Have glibc give freed blocks of 1 MiB and more back to the system at once (a fixed
    ``M_MMAP_THRESHOLD``). By default the threshold follows the largest block freed, up to
    32 MiB, after which freed tensors stay in the heap of the thread that allocated them,
    where other threads do not reuse them: a layer loaded by transformers' loader threads
    would leave its sources' memory resident (bench/README.md). Once per process; Linux only."""
    global _LARGE_FREES_RELEASED
    import sys

    if _LARGE_FREES_RELEASED or not sys.platform.startswith("linux"):
        return
    _LARGE_FREES_RELEASED = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


#: Entries oneDNN's primitive cache and ideep's computation cache keep during a reference run
#: (the libraries' default is 1024 each). A 16-bit matmul on the CPU compiles a kernel per
#: shape and both libraries keep it; a mixture of experts gives each expert a new number of
#: tokens, so every layer adds shapes: measured 4 MB a layer at seq 512, up to about 70 MB
#: before the default capacities fill, whatever the layers' size.
KERNEL_CACHE_ENTRIES = 16
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_reference_memory() -> None:
    """What a reference run (extraction, or verifying a store) sets at start-up, before its
    first matmul, so that its memory follows the layer and not the run's length: large
    frees given back at once (:func:`release_large_frees`, before the heap grows), and the
    CPU matmul libraries' kernel caches held to ``KERNEL_CACHE_ENTRIES`` (their sizes are
    read from the environment when each cache is first used; a value set by the user is
    kept)."""
    release_large_frees()
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))


def give_back_memory() -> None:
    """Return freed heap memory to the system (glibc keeps it otherwise, so peak RSS would
    grow with each layer loaded and freed)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
