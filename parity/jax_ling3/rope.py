"""Interleaved RoPE of the MLA rope dims (facts §4.3)."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def inv_freq(rope_dim: int, theta: float) -> np.ndarray:
    """inv_freq_j = θ^{-2j/r}, j = 0..r/2-1, computed in float64 then rounded to fp32 (facts §4.3)."""
    return (1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)).astype(np.float32)


def cos_sin(positions: jnp.ndarray, rope_dim: int, theta: float, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin [..., r/2] of position·inv_freq, computed in fp32 and cast to the activation dtype (facts §8)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rope_dim, theta))
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def apply_rope_interleaved(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """`rope_interleave=true` (facts §4.3): de-interleave x' = [x_0,x_2,…, x_1,x_3,…] then rotate-half:
    out_j = x'_j cos f_j − x'_{j+r/2} sin f_j ; out_{j+r/2} = x'_{j+r/2} cos f_j + x'_j sin f_j.
    x [..., T, h, r] with cos/sin [..., T, r/2] (broadcast over the head axis h)."""
    c, s = cos[..., None, :], sin[..., None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * c - odd * s, odd * c + even * s], axis=-1)
