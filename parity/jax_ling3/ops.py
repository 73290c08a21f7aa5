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
    matmuls accumulate in fp32 on both), so no silent promotion: bf16 in -> bf16 out. A bf16 linear on CPU with bf16
    weights differentiates through `_linear_bf16` (same forward bits; its VJP's products as native bf16 dots).
    """
    if w.ndim == 2 and native_bf16_backward(x, w):
        return _linear_bf16(x, w)
    return _linear_ref(x, w)


def _linear_ref(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """The readable linear: its plain-AD VJP is the reference `_linear_bf16`'s is checked against."""
    return matmul_f32(x, w.astype(x.dtype)).astype(x.dtype)


# A bf16 linear's VJP (dx = dy Wᵀ, dW = xᵀ dy) as bf16 × bf16 -> fp32 dots on the bf16 operands rather than plain
# AD's fp32 dots on upcast copies: the same exact products, fp32 sums in another order, each rounded once to bf16 as
# torch's bf16 autograd rounds them. XLA:CPU (jax 0.10) runs a row-major `[M, K] @ [K, N]` or `[M, K] @ [N, K]ᵀ`
# bf16 dot natively (on a CPU with avx512_bf16, ~2x its fp32 dot: 6.7 vs 14 ms for Ling3-Tiny's [512, 1536] x
# [1536, 2048], and torch's oneDNN bf16 GEMM 6.7 ms), but a dot that contracts its lhs's leading dim (the weight
# gradient xᵀ dy) falls to a slower path (19 ms) unless xᵀ is laid out in memory (`contiguous_t`). Only the
# backward changes: the forward bits stay the upcast path's (pinned). Read at trace time; False = plain AD.
BWD_NATIVE_BF16 = True


def native_bf16_backward(*arrays: jnp.ndarray) -> bool:
    """Whether a VJP over these operands takes its native-bf16 form (`BWD_NATIVE_BF16`: all bf16, on CPU)."""
    return (BWD_NATIVE_BF16 and jax.default_backend() == "cpu"
            and all(a.dtype == jnp.bfloat16 for a in arrays))


def bf16_dot(eq: str, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """bf16 × bf16 -> fp32 einsum without an upcast (a VJP's native-bf16 products, `BWD_NATIVE_BF16`). Only layouts
    XLA:CPU runs natively: row-major products and the attention layouts of `mla._core_bf16` (each one used runs in
    tests/test_jax_native_bwd.py)."""
    return jnp.einsum(eq, a, b, preferred_element_type=F32)


def contiguous_t(a: jnp.ndarray) -> jnp.ndarray:
    """aᵀ of a 2-D array, materialised row-major. XLA's layout assignment turns a plain transpose into a layout
    change of the dot's operand (no copy), which XLA:CPU's native bf16 dot does not take; a 1-D array has one layout,
    so a transpose that passes through one (behind an optimisation barrier, so the reshapes are not folded) is
    copied."""
    m, n = a.shape
    return jax.lax.optimization_barrier(a.T.reshape(-1)).reshape(n, m)


def row_major(a: jnp.ndarray) -> jnp.ndarray:
    """a, pinned to a row-major layout (through a 1-D array behind an optimisation barrier, as `contiguous_t`).
    Applied to a dot's output, it stops XLA's layout assignment from choosing a transposed output layout for it,
    which makes XLA transpose the dot's other operand to produce it: in MLA's attention VJP at T = 2048 that was a
    [16, 2048, 2048] bf16 copy for P·V and one for dS·k, 0.41 s each."""
    return jax.lax.optimization_barrier(a.reshape(-1)).reshape(a.shape)


def bf16_dot_wgrad(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """aᵀ b for bf16 a [R, M], b [R, N] in fp32 (a weight gradient: the rows contracted), as a native bf16 dot."""
    return jnp.matmul(contiguous_t(a), b, preferred_element_type=F32)


@jax.custom_vjp
def _linear_bf16(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    return _linear_ref(x, w)


def _linear_bf16_fwd(x, w):
    # under a VJP the forward is a native bf16 dot too: its primal output is not what a forward replay compares (the
    # reference's VJPs discard it, `backward.layer_vjp`); it may differ from `_linear_ref`'s pinned bits by a last-bit
    # rounding where the two fp32 sums straddle a bf16 tie, as torch's own kernels do between CPUs
    K, N = w.shape
    y = bf16_dot("tk,kn->tn", x.reshape(-1, K), w).astype(x.dtype).reshape(*x.shape[:-1], N)
    return y, (x, w)


def _linear_bf16_bwd(res, dy):
    x, w = res
    K, N = w.shape
    dy2 = dy.astype(jnp.bfloat16).reshape(-1, N)
    dx = bf16_dot("tn,kn->tk", dy2, w).astype(x.dtype).reshape(x.shape)
    dw = bf16_dot_wgrad(x.reshape(-1, K), dy2).astype(w.dtype)
    return dx, dw


_linear_bf16.defvjp(_linear_bf16_fwd, _linear_bf16_bwd)


def silu(x: jnp.ndarray) -> jnp.ndarray:
    """x·σ(x) computed in fp32 and rounded once to x.dtype, as torch's elementwise bf16 kernels do."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)
