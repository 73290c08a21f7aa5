"""Pre-norm decoder layer (facts §2): x += Attn(RMSNorm_in(x)); x += FFN(RMSNorm_post(x))."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.kda import kda_attention
from parity.jax_ling3.mla import mla_attention
from parity.jax_ling3.moe import dense_mlp, moe_block
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.probes import probing, tap
from parity.jax_ling3.spec import LayerSpec


def decoder_layer(p: dict, h: jnp.ndarray, positions: jnp.ndarray, spec: LayerSpec, state=None, forced_idx=None,
                  probes: dict | None = None):
    """One decoder layer on the residual stream h [B,T,D] (activation dtype) at RoPE `positions` [T] / [B,T].

    state: None (start) or what the previous call of this layer returned — KDA (S, conv) / MLA `MLACache`
    (an MLA prefill that should be continued by decode must be given an empty cache, `mla.init_mla_cache`).
    forced_idx [B,T,k]: route the MoE to these experts (forced routing).
    probes {site: array}: zero-valued (-0.0) additive probes at those sites (`parity.jax_ling3.probes`): the
    gradient w.r.t. probes[site] is the site's cotangent (backward replay, issue 26); the forward is unchanged.
    Returns (out [B,T,D], points {site: array}, new_state)."""
    with probing(probes):
        return _decoder_layer(p, h, positions, spec, state, forced_idx)


def _decoder_layer(p: dict, h: jnp.ndarray, positions: jnp.ndarray, spec: LayerSpec, state, forced_idx):
    m = spec.model
    pts = {"input": h}
    x = rms_norm(h, p["input_layernorm"], m.eps)
    x = tap(pts, "input_layernorm", x)
    if spec.kind == "kda":
        a, apts, new_state = kda_attention(p["attention"], x, spec, state)
    else:
        a, apts, new_state = mla_attention(p["attention"], x, positions, spec, state)
    pts.update(apts)
    a = tap(pts, "attention", a)
    h = h + a  # residual stream in the model dtype (facts §8)
    x = rms_norm(h, p["post_attention_layernorm"], m.eps)
    x = tap(pts, "post_attention_layernorm", x)
    if spec.moe:
        y, mpts = moe_block(p["mlp"], x, spec, forced_idx)
    else:
        y, mpts = dense_mlp(p["mlp"], x)  # the clamp never applies to dense layers (facts §5.7)
    pts.update(mpts)
    y = tap(pts, "mlp", y)
    out = h + y
    pts["output"] = out
    return out, pts, new_state


# One compiled function per (LayerSpec, shapes, state structure): every layer of the same kind shares it.
decoder_layer_jit = jax.jit(decoder_layer, static_argnames=("spec",), compiler_options=REFERENCE_COMPILER_OPTIONS)
