"""`KimiLinearDecoderLayer`: pre-norm residual block, h += Attn(RMSNorm_in(h)); h += MLP(RMSNorm_post(h)), the
attention KDA or MLA by `layer_types`, the MLP MoE or dense by `mlp_layer_types`. The RMSNorm (`KimiLinearRMSNorm`:
fp32 statistics, normalised value cast to the input dtype before the weight multiply) is Ling3's `rms_norm`; the
residual adds run in the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.norms import rms_norm
from parity.jax_kimi import kda, mla, moe
from parity.jax_kimi.spec import KimiLayerSpec


def decoder_layer(p: dict, h: jnp.ndarray, spec: KimiLayerSpec, state: tuple | None = None,
                  forced_idx: jnp.ndarray | None = None):
    """One decoder layer on the residual stream h [B,T,D]. Returns (out [B,T,D], points {name: array}); point names
    are the built-in's module names relative to the layer (`self_attn`, `self_attn.forget_gate`,
    `mlp.gate.topk_idx`, …). A KDA layer also returns its state as points `self_attn.recurrent_state` and
    `self_attn.conv_state`, an MLA layer its key/value cache as `self_attn.k_nope_cache`, `self_attn.k_rot_cache` and
    `self_attn.v_cache`; `state` = that pair or triple continues the sequence (decode). `forced_idx` [B,T,k]: a MoE
    layer's experts (`moe.moe_block`)."""
    m = spec.model
    pts: dict[str, jnp.ndarray] = {"input": h}
    x = pts["input_layernorm"] = rms_norm(h, p["input_layernorm"], m.eps)
    if spec.kind == "kda":
        a, apts, (S, conv) = kda.kda_attention(p["self_attn"], x, spec, state)
        apts["self_attn.recurrent_state"], apts["self_attn.conv_state"] = S, conv
    else:
        a, apts, cache = mla.mla_attention(p["self_attn"], x, spec, state)
        apts["self_attn.k_nope_cache"], apts["self_attn.k_rot_cache"], apts["self_attn.v_cache"] = cache
    pts.update(apts)
    pts["self_attn"] = a
    h = h + a
    x = pts["post_attention_layernorm"] = rms_norm(h, p["post_attention_layernorm"], m.eps)
    y, mpts = moe.mlp_block(p["mlp"], x, spec, forced_idx)
    pts.update(mpts)
    pts["mlp"] = y
    out = pts["output"] = h + y
    return out, pts


def decoder_layer_jit():
    """A freshly jitted `decoder_layer` (spec static) under the reference's XLA options (every bf16 rounding kept,
    `parity.jax_ling3.REFERENCE_COMPILER_OPTIONS`). Fresh per call, so a function patched in this package (a
    planted bug) is traced anew rather than served from an earlier trace."""
    return jax.jit(lambda p, h, spec, state=None, forced_idx=None: decoder_layer(p, h, spec, state, forced_idx),
                   static_argnames=("spec",),
                   compiler_options=REFERENCE_COMPILER_OPTIONS)
