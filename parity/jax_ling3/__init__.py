"""Pure-JAX Ling3 (plain jax + numpy, no flax): HF-checkpoint loader and layer-by-layer model (DESIGN §7).

Modules: `spec` (hashable statics from a Ling3Config), `weights` (HF -> JAX mapping, lazy per-layer reader),
`norms`, `rope`, `kda`, `mla`, `moe` (router, experts, dense MLP), `layer` (decoder layer), `model` (embedding,
head, whole-model prefill/decode), `sharding` (device mesh helpers), `ops` (small shared ops in the reference
precision), `testing` (comparison helpers of the tests). The DESIGN §7 target over this package is
`parity.targets.reference`.

Every numerical function is pure: `(params, inputs, statics) -> (output, points)` (stateful ones also return their new
state), where `points` maps canonical site names (`parity.model.points`) to arrays in canonical shapes.

Every jitted function here is compiled with `REFERENCE_COMPILER_OPTIONS` (the reference's own XLA options, set
per computation, not process-wide). Importing this package turns on JAX's persistent compilation cache (jit compile
time dominates layer replay): directory `$LING3_JAX_CACHE`, else `$XDG_CACHE_HOME/ling3-parity/jax` (default `~/.cache/...`); set
`LING3_JAX_CACHE=off` to disable.
"""

from __future__ import annotations

import os
from pathlib import Path


def _reference_compiler_options() -> dict:
    """Keep every bf16 rounding the code asks for. XLA's default `xla_allow_excess_precision=true` drops
    f32→bf16→f32 round trips (e.g. the KDA core cast to bf16 before o_norm, `silu(g)·u` before down_proj), so the
    JAX reference would skip roundings torch does: measured on the bundled tiny-flash bf16 dump, layer 1 o_norm
    differed by up to 0.33 (a near-zero head row amplified by the norm) with it on, by 1 bf16 ULP with it off.

    Applied per computation (`jax.jit(..., compiler_options=...)`, jax >= 0.4.36) to the suite's own jitted
    functions only — never through the process-wide XLA_FLAGS — so a port replayed in the same process runs under
    its production flags (DESIGN §7). `LING3_REFERENCE_XLA_DEFAULTS=1` drops it (to measure the reference under
    XLA's defaults)."""
    if os.environ.get("LING3_REFERENCE_XLA_DEFAULTS", "").strip() in ("1", "true", "yes"):
        return {}
    return {"xla_allow_excess_precision": False, **_MEMORY_LEAN_CPU_SCHEDULE, **_legacy_cpu_emitters(), **_ynn_dots_only()}


# XLA:CPU's default (concurrency-optimised) scheduler starts every weight's fp32 upcast early, so all of a layer's
# fp32 weight copies are live at once; the memory-optimised one converts each just before its product. Ling3-Tiny,
# `compiled.memory_analysis()` temporaries: KDA+dense 193 -> 68 MB at T=128, KDA+MoE 156 -> 93 MB and MLA+MoE
# 89 -> 56 MB at T=512; the same bits (scheduling only); not slower (KDA+dense T=512 on one core: 1.29 vs 1.42 s).
# A CPU option (other backends ignore it); per computation like the flag above (issue 17, README "Performance").
_MEMORY_LEAN_CPU_SCHEDULE = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}



def _legacy_cpu_emitters() -> dict:
    """XLA:CPU's MLIR fusion emitters (its default in jaxlib 0.10) spend most of a small program's compile setting
    up MLIR passes; its older emitters compile the reference's programs ~40 % faster and give the same bits
    (measured 2026-11-28, jaxlib 0.10.2, 2-core Xeon VM, one core, cache off: a trivial jit 0.24 -> 0.085 s; the
    tiny-bf16 golden's layer replay 17-19 -> 10-11 s of compile; every point of the five goldens in layer and
    isolated mode, forward and backward — 13,255 arrays — hashed identical; Ling3-Tiny-shaped layers at T=512 warm
    0-15 % faster, same output bits). Compile time is most of the test suite's time (issue 35). Applied only on
    the jaxlib minor version it was measured on: another may not know the option (a compile error) or may emit
    other code; tests/test_reference_options.py pins the bits."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except Exception:  # no jaxlib metadata: leave XLA's default
        return {}
    return {"xla_cpu_use_fusion_emitters": False} if (major, minor) == (0, 10) else {}


def _ynn_dots_only() -> dict:
    """XLA:CPU (jaxlib 0.10) hands dots to YNNPACK (its native bf16 × bf16 -> fp32 kernels) and by default also
    fuses a dot with the elementwise ops and reduction that consume it into one YNNPACK kernel. That reduce fusion
    drops the f32 -> bf16 -> f32 round trips inside it even with `xla_allow_excess_precision=false` (measured
    2026-11-29, AMD EPYC with avx512_bf16: MLA's attention VJP, `mla._core_bf16`, d probs = bf16(dO · Vᵀ) fused with
    the softmax VJP's row sum: dq 0.36 % rel-L2 off the same program run op by op, i.e. one bf16 rounding lost on
    most elements). Dots alone keep YNNPACK's speed (a [512, 1536] x [1536, 2048] bf16 dot 6.7 ms as with the
    default, 13.5 ms with YNNPACK off) and every rounding. Only on the jaxlib minor version it was measured on
    (another may not know the option); tests/test_jax_native_bwd.py fails without it."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except Exception:  # no jaxlib metadata: leave XLA's default
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"} if (major, minor) == (0, 10) \
        else {}


REFERENCE_COMPILER_OPTIONS = _reference_compiler_options()

import jax  # noqa: E402


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
