"""Pure-JAX Ling3 (plain jax + numpy, no flax): HF-checkpoint loader and layer-by-layer model (DESIGN §7).

Modules: `spec` (hashable statics from a Ling3Config), `weights` (HF -> JAX mapping, lazy per-layer reader),
`norms`, `rope`, `kda`, `mla`, `moe` (router, experts, dense MLP), `layer` (decoder layer), `model` (embedding,
head, whole-model prefill/decode), `sharding` (device mesh helpers), `target` (the DESIGN §7 target protocol).

Every numerical function is pure: `(params, inputs, statics) -> (output, points)` (stateful ones also return their new
state), where `points` maps canonical site names (`parity.points`) to arrays in canonical shapes.

Importing this package turns on JAX's persistent compilation cache (jit compile time dominates layer replay):
directory `$LING3_JAX_CACHE`, else `$XDG_CACHE_HOME/ling3-parity/jax` (default `~/.cache/...`); set
`LING3_JAX_CACHE=off` to disable.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def _enable_compilation_cache() -> str | None:
    where = os.environ.get("LING3_JAX_CACHE")
    if where is not None and where.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if not where:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        where = str(Path(base) / "ling3-parity" / "jax")
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", where)
    # Layer kernels compile in 0.1-2 s on CPU; cache them all (the default threshold is 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


COMPILATION_CACHE_DIR = _enable_compilation_cache()
