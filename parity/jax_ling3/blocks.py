"""The decoder layer (`layer.decoder_layer`) cut at its block boundaries, each piece jitted on its own, for targets
that compose a layer from blocks of different origins (`parity.targets.partial`: a port's KDA attention, the
reference's norms and MoE). Same functions and compiler options as the whole layer: with excess precision off every
piece boundary is a tensor the whole layer also rounds to the activation dtype, so the pieces give the layer's bits
(tests/test_partial_port.py checks it)."""

from __future__ import annotations

from functools import partial

import jax

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.kda import kda_attention
from parity.jax_ling3.mla import mla_attention
from parity.jax_ling3.moe import dense_mlp, moe_block
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.spec import LayerSpec

_jit = partial(jax.jit, static_argnames=("spec",), compiler_options=REFERENCE_COMPILER_OPTIONS)


@_jit
def input_norm(p: dict, h, spec: LayerSpec):
    """input_layernorm of the residual stream h [B,T,D]."""
    return rms_norm(h, p["input_layernorm"], spec.model.eps)


@_jit
def attention(p: dict, x, positions, spec: LayerSpec, state=None):
    """The attention block (KDA or MLA by `spec.kind`) on the normed x: (a, points, new_state)."""
    if spec.kind == "kda":
        return kda_attention(p["attention"], x, spec, state)
    return mla_attention(p["attention"], x, positions, spec, state)


@_jit
def post_attention(p: dict, h, a, spec: LayerSpec):
    """The residual add in the model dtype (facts §8) and post_attention_layernorm: (h + a, its norm)."""
    h2 = h + a
    return h2, rms_norm(h2, p["post_attention_layernorm"], spec.model.eps)


@_jit
def mlp(p: dict, x, spec: LayerSpec, forced_idx=None):
    """The MoE block (or the dense MLP, never clamped: facts §5.7) on the normed x: (y, points)."""
    if spec.moe:
        return moe_block(p["mlp"], x, spec, forced_idx)
    return dense_mlp(p["mlp"], x)


@jax.jit
def residual(h2, y):
    """The layer output h2 + y in the model dtype."""
    return h2 + y
