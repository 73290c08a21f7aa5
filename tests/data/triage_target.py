"""A port-shaped test target for the triage test (tests/test_triage.py): the reference with three planted
differences of the three kinds triage tells apart."""

from dataclasses import replace

import jax
import jax.numpy as jnp

from parity.targets.mutants import MUTATIONS, VARIANT_PLANTS, MutantTarget, _mods


def conv_in_activation_dtype(x, w, cache=None):
    """short conv + SiLU computed in x.dtype (bf16 in a bf16 run, fp32 in an fp32 run): a precision error."""
    B, T, P = x.shape
    W = w.shape[-1]
    hist = jnp.zeros((B, P, W), x.dtype) if cache is None else cache.astype(x.dtype)
    full = jnp.concatenate([hist, jnp.swapaxes(x, 1, 2)], axis=-1)
    wf = w.astype(x.dtype)
    y = sum(wf[None, :, j, None] * full[:, :, 1 + j: 1 + j + T] for j in range(W))
    y = y * jax.nn.sigmoid(y)
    return jnp.swapaxes(y, 1, 2), full[:, :, -W:]


class Triage(MutantTarget):
    """variant (single-rounding RMSNorm) + precision (bf16 short conv) + semantic (top-k weights not renormalised)"""

    def __init__(self, **kw):
        super().__init__("rmsnorm_fused_scale", **kw)
        plant, bug = VARIANT_PLANTS["rmsnorm_fused_scale"], MUTATIONS["moe_no_topk_renorm"]
        kda = _mods()[0]
        self.mutation = replace(plant, name="triage-target", patches=lambda: {
            **plant.patches(), **bug.patches(), (kda, "short_conv"): conv_in_activation_dtype})
        self.name = "triage-target"
