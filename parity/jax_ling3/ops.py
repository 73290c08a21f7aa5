"""Small shared ops in the reference's precision."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


F32 = jnp.float32


def dot_f32(eq: str, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """einsum with fp32 accumulation, fp32 result (the caller rounds once to its dtype).

    XLA:CPU has no general bf16×bf16→f32 dot (`UNIMPLEMENTED: ... DotThunk` for layouts such as "nei,eid->ned" or
    "bhts,bsc->bthc"; plain matrix products do work, see `matmul_f32`), so on CPU the operands are upcast: a product of
    two bf16 values is exact in fp32, so this computes the same products with the same fp32 accumulation a bf16 GEMM
    with fp32 accumulate does. On TPU/GPU the bf16 operands go to the MXU/tensor cores directly.
    """
    if jax.default_backend() == "cpu" or (a.dtype == F32 and b.dtype == F32):
        return jnp.einsum(eq, a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(eq, a, b, preferred_element_type=F32)


# XLA:CPU (jax 0.10) runs a plain `[..., K] @ [K, N]` bf16×bf16→fp32 dot natively (fp32 accumulation: max relative
# difference 1e-7 from the upcast path; 2-4.5x faster on isolated products), though not every einsum layout
# (`dot_f32`'s note). Off by default: it gave no layer-level gain (Ling3-Tiny MLA+MoE at T=512, warm: 0.53 s on vs
# 0.51 s off; KDA+MoE not faster either; the routed experts alone, 128 x 3 weights at T=512: 0.42 s on vs 0.32 s off,
# README "Performance"). A hang seen once when such a layer was loaded from the persistent compilation cache did not
# reproduce (same bench child twice on one cache, and a minimal fori-loop repro).
# False = always the upcast path of `dot_f32` (the readable reference); LING3_NATIVE_BF16=1 turns it on.
NATIVE_BF16_MATMUL = os.environ.get("LING3_NATIVE_BF16", "0") == "1"


def matmul_f32(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """`a [..., K] @ b [K, N]` with fp32 accumulation and an fp32 result; bf16 operands stay bf16 when
    `NATIVE_BF16_MATMUL` (read at trace time), else as `dot_f32`."""
    if NATIVE_BF16_MATMUL and a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16 and b.ndim == 2:
        return jnp.matmul(a, b, preferred_element_type=F32)
    return dot_f32("...i,io->...o", a, b)


def linear(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """`x @ w` with w in JAX layout [in, out] (seed §3.6: HF [out, in] transposed at load).

    Accumulates in fp32 and rounds once to the activation dtype, as torch's bf16 GEMMs do (env_notes: bf16×bf16
    matmuls accumulate in fp32 on both), so no silent promotion: bf16 in -> bf16 out.
    """
    return matmul_f32(x, w.astype(x.dtype)).astype(x.dtype)


def silu(x: jnp.ndarray) -> jnp.ndarray:
    """x·σ(x) computed in fp32 and rounded once to x.dtype, as torch's elementwise bf16 kernels do."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)
