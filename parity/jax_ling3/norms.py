"""RMSNorm variants (facts §6, §3.3, §3.7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """Llama-convention RMSNorm (facts §6): statistics in fp32, normalised value cast back to x.dtype *before* the
    weight multiply, which then runs in x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * y.astype(x.dtype)


def gated_rms_norm(o: jnp.ndarray, gate: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """KDA output norm (fla FusedRMSNormGated, activation sigmoid, facts §3.7): all in fp32 —
    normalise over the last axis (head dim), multiply the shared weight, *then* gate — cast once to o.dtype."""
    of = o.astype(jnp.float32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
    return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)


def l2_normalize(x: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    """fla l2norm (facts §3.3): x / sqrt(sum(x²) + eps), eps inside the sqrt on the *sum*; fp32."""
    xf = x.astype(jnp.float32)
    return xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
