"""Keep a long-lived process below the kernel's limit on memory mappings by releasing jax's compiled programs.

Why: every program XLA:CPU compiles is loaded as JIT code in its own mappings (about 9-16 per small program, hundreds
for a layer's VJP), and jax keeps every compiled program of a live jitted function in memory. A process that
compiles thousands of programs — an xdist worker running this suite (one reached 50,112 mappings in README command
two, 2026-11-28), a long calibration run — reaches Linux's `vm.max_map_count` (65,530 by default), and then the next
compilation's mmap fails *inside* XLA: a segmentation fault in `backend_compile_and_load`, not an error (both crashes
of the full sweep, and reproduced by compiling small programs until the limit: tests/test_memory_maps.py).
`jax.clear_caches()` drops the compiled programs (mappings released); a program needed again is reloaded from the
persistent compilation cache or recompiled.
"""

from __future__ import annotations

import gc
from pathlib import Path

# release past 60 % of the limit: README command two's busiest worker peaked at 76 % without a release (so it releases
# about once); the fastest growth sampled was ~2,000 mappings in 30 s, so the 40 % left (26,000 at the default limit)
# covers a test file or a dump many times over
DEFAULT_FRACTION = 0.6


def map_count() -> int | None:
    """This process's number of memory mappings (lines of /proc/self/maps); None where /proc is not available."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The kernel's per-process limit (`vm.max_map_count`); None where it cannot be read."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def release_if_near_limit(fraction: float = DEFAULT_FRACTION) -> tuple[int, int] | None:
    """If this process uses more than `fraction` of the mapping limit, drop jax's compiled programs and return the
    mapping counts (before, after); otherwise (or where the counts cannot be read) None."""
    n, limit = map_count(), map_limit()
    if n is None or limit is None or n <= fraction * limit:
        return None
    import jax

    jax.clear_caches()
    gc.collect()
    return n, map_count() or 0
