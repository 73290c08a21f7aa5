"""Small shared ops in the reference's precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """`x @ w` with w in JAX layout [in, out] (seed §3.6: HF [out, in] transposed at load).

    Accumulates in fp32 and rounds once to the activation dtype, as torch's bf16 GEMMs do (env_notes: bf16×bf16
    matmuls accumulate in fp32 on both), so no silent promotion: bf16 in -> bf16 out.
    """
    y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def silu(x: jnp.ndarray) -> jnp.ndarray:
    """x·σ(x) computed in fp32 and rounded once to x.dtype, as torch's elementwise bf16 kernels do."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)
