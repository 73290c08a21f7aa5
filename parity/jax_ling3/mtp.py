"""The MTP (multi-token prediction) layer (facts §2; points of `parity.model.mtp_points`), pure functions.

    ids'  = ids shifted left by one, last position 0          (`shift_ids`)
    e     = enorm(embed(ids'))       h = hnorm(hidden)           (hidden: the main stack after model.norm, or the
    x     = eh_proj([e ; h])                                       previous MTP layer's output)
    x    += MLA(input_layernorm(x)); x += MoE(post_attention_layernorm(x))   (the decoder block, no SwiGLU clamp)
    out   = final_layernorm(x)       logits = lm_head(out), fp32 after the model-dtype GEMM (no model.norm)

Params: `weights.convert_mtp` ({"enorm", "hnorm", "final_layernorm", "eh_proj" [2D, D], "block"}); the block runs
`layer.decoder_layer` with the MTP layer's `LayerSpec` (`spec.layer_spec(cfg, N + j, ...)`: MLA + MoE; the clamp
lists do not reach index N, facts §5.7), so its KV state is an `MLACache` like any MLA layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.layer import decoder_layer
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.ops import linear
from parity.jax_ling3.probes import probing, tap
from parity.jax_ling3.spec import LayerSpec

F32 = jnp.float32


def shift_ids(ids: jnp.ndarray) -> jnp.ndarray:
    """[B, T] ids -> the MTP layer's input ids: position t gets token t+1, the last position 0 (a one-token decode
    step thus feeds token 0, as the official forward does)."""
    return jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)


def mtp_input(p: dict, embedded: jnp.ndarray, hidden: jnp.ndarray, eps: float):
    """(x [B,T,D], points): enorm / hnorm in the model dtype (Llama-convention RMSNorm, facts §6), then eh_proj on
    their concatenation, embedding first (facts §2). Each point is `tap`ped (a backward trace's probes)."""
    pts: dict = {}
    e = tap(pts, "enorm", rms_norm(embedded, p["enorm"], eps))
    h = tap(pts, "hnorm", rms_norm(hidden, p["hnorm"], eps))
    x = tap(pts, "eh_proj", linear(jnp.concatenate([e, h], axis=-1), p["eh_proj"]))
    return x, pts


def mtp_layer(p: dict, embedded: jnp.ndarray, hidden: jnp.ndarray, positions: jnp.ndarray, spec: LayerSpec,
              state=None, forced_idx=None, probes: dict | None = None):
    """One MTP layer: `embedded` = embed(shift_ids(ids)) [B,T,D], `hidden` [B,T,D], RoPE `positions` [T]/[B,T].
    state: the block's MLA cache (None / `mla.init_mla_cache` / the previous call's). probes {MTP site: array}:
    -0.0 additive probes at those sites (`parity.jax_ling3.probes`; the backward's sub-module cotangents, issue 33),
    the forward unchanged. Returns (out [B,T,D] = final_layernorm output, points {MTP site: array} (all but `embed` /
    `logits`), new_state)."""
    eps = spec.model.eps
    with probing(probes):
        x, pts = mtp_input(p, embedded, hidden, eps)
        y, bpts, new_state = decoder_layer(p["block"], x, positions, spec, state, forced_idx, probes=probes)
        bpts.pop("input")  # == eh_proj
        bpts.pop("output")  # == final_layernorm:in, tapped below
        pts.update(bpts)
        resid = tap(pts, "final_layernorm:in", y)
        out = tap(pts, "final_layernorm", rms_norm(resid, p["final_layernorm"], eps))
    return out, pts, new_state


def mtp_logits(lm_head: jnp.ndarray, out: jnp.ndarray) -> jnp.ndarray:
    """lm_head [D,V] on the MTP output in the model dtype, then fp32 (facts §6) — no final model.norm."""
    return linear(out, lm_head).astype(F32)


# The reference's bf16 roundings, as every jitted reference function (parity/jax_ling3/__init__.py).
mtp_layer_jit = jax.jit(mtp_layer, static_argnames=("spec",), compiler_options=REFERENCE_COMPILER_OPTIONS)
mtp_logits_jit = jax.jit(mtp_logits, compiler_options=REFERENCE_COMPILER_OPTIONS)

__all__ = ["shift_ids", "mtp_input", "mtp_layer", "mtp_logits", "mtp_layer_jit", "mtp_logits_jit"]
