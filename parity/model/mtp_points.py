"""Canonical points of the MTP (multi-token prediction) layers (DESIGN §4; facts sheet §2).

Every real Ling-3.0 checkpoint carries an MTP layer `model.layers.{N}` (N = num_hidden_layers; Flash declares
`num_nextn_predict_layers: 1`). The official forward runs it after the main stack, on every prefill and decode step:

    e   = enorm(word_embeddings(ids shifted left by one, last position 0))      # `embed`, `enorm`
    h   = hnorm(main hidden state after model.norm)                           # `hnorm` (its input: model/final_norm)
    x   = eh_proj([e ; h])                                                    # `eh_proj` (embedding first)
    x  += MLA(input_layernorm(x))                                             # MLA sites as in a main layer
    x  += MoE(post_attention_layernorm(x))                                    # MoE sites as in a main layer
    out = final_layernorm(x)                                                  # `final_layernorm:in`, `final_layernorm`
    mtp_logits = lm_head(out).float()                                         # `logits` (no model.norm in between)

MTP layer j's points live in their own group, `/prefill/MTP{j}/<site>` and `/decode/S001/MTP{j}/<site>`, so the main
stack's points (`parity.model.points.Point`) are never touched. Site names follow the main layers' (the checkpoint's
module names relative to `model.layers.{N+j}`) plus the MTP-only ones above.

This module is self-contained so that `parity/model/points.py` can absorb it later (e.g. a `Point.mtp` field): the site
list, their dataflow inputs and the HDF5/report spellings are all here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parity.model.points import NO_COTANGENT, backward_param_sites, layer_sites

GROUP_RE = re.compile(r"^MTP(\d+)$")

MTP_SITES_BEFORE = ("embed", "enorm", "hnorm", "eh_proj")
MTP_SITES_AFTER = ("final_layernorm:in", "final_layernorm", "logits")


def mtp_sites(cfg, *, recorded_inputs: bool = False) -> tuple[str, ...]:
    """All sites of an MTP layer, in execution order. Its decoder block is MLA + MoE (facts §2); the main layers'
    `input` (= `eh_proj` here) and `output` (= `final_layernorm:in`) are not repeated. `recorded_inputs`: also the
    block's `<module>:in` sites (as `parity.model.points.layer_sites`)."""
    block = layer_sites("mla", True, cfg.q_lora, recorded_inputs=recorded_inputs)
    assert block[0] == "input" and block[-1] == "output"
    return (*MTP_SITES_BEFORE, *block[1:-1], *MTP_SITES_AFTER)


# Which sites an MTP site is computed from (same phase/step; "model/final_norm" is the main stack's point). The MLA
# and MoE sites of the block follow parity.model.points' per-layer graph with `input` replaced by `eh_proj`.
MTP_INPUTS = {
    "embed": (),
    "enorm": ("embed",),
    "hnorm": ("model/final_norm",),
    "eh_proj": ("enorm", "hnorm"),
    "input_layernorm": ("eh_proj",),
    "post_attention_layernorm": ("eh_proj", "attention"),
    "final_layernorm:in": ("eh_proj", "attention", "mlp"),
    "final_layernorm": ("final_layernorm:in",),
    "logits": ("final_layernorm",),
}


def mtp_group(j: int) -> str:
    return f"MTP{j}"


@dataclass(frozen=True, order=True)
class MtpPoint:
    """A point of MTP layer `mtp` (0-based; checkpoint layer `num_hidden_layers + mtp`)."""

    phase: str
    step: int
    mtp: int
    site: str

    def key(self) -> str:
        """Report spelling: `prefill/MTP0/eh_proj`, `decode/S001/MTP0/mlp`."""
        return "/".join(self.h5_parts())

    def h5_parts(self) -> tuple[str, ...]:
        if self.phase in ("prefill", "backward"):  # one step each: no step group (as `Point`)
            return (self.phase, mtp_group(self.mtp), self.site)
        return ("decode", f"S{self.step:03d}", mtp_group(self.mtp), self.site)

    def h5_path(self) -> str:
        """HDF5 dataset path, e.g. `/prefill/MTP0/eh_proj`, `/decode/S001/MTP0/attention.core`,
        `/backward/MTP0/grad.eh_proj.weight`."""
        return "/" + "/".join(self.h5_parts())


def expected_mtp_points(cfg, decode_steps: int) -> list[MtpPoint]:
    """Every MTP point a full dump holds (before runtime unavailability), in execution order."""
    out = []
    for phase, step in [("prefill", 0)] + [("decode", k) for k in range(1, decode_steps + 1)]:
        for j in range(cfg.num_nextn_predict_layers):
            out += [MtpPoint(phase, step, j, s) for s in mtp_sites(cfg)]
    return out


# ------------------------------------------------------------------------------------------ backward phase (issue 33)
# A `--grads --mtp-loss-scale F` dump (parity.torch_ref.backward, MTP_LOSS_DEFINITION) holds MTP layer j's backward
# points `/backward/MTP{j}/<site>`: the cotangent of each forward MTP site (`logits` = dL/d the fp32 MTP logits the
# loss reads), `hnorm:in` and the gradient of each of the layer's own parameters. `hnorm:in` is the MTP layer's
# contribution to dL/d(the hidden state it is fed) — dL/d hnorm's input through hnorm alone; the main stack's
# `backward/model/final_norm` is the sum of it and the LM head's contribution (facts §2: the MTP layer reads the main
# stack's state after model.norm), so the model-level replay is fed it as a main layer is fed its `output` cotangent.
MTP_BACKWARD_ONLY = ("hnorm:in",)


def mtp_param_sites(cfg) -> tuple[str, ...]:
    """`grad.<name relative to model.layers.{N+j}.>` of every trainable parameter of an MTP layer, in forward order:
    enorm, hnorm, eh_proj (facts §2), the MLA + MoE block's (`parity.model.points.backward_param_sites` of layer N:
    an MTP layer is MLA + MoE), final_layernorm."""
    own = ("grad.enorm.weight", "grad.hnorm.weight", "grad.eh_proj.weight")
    return (*own, *backward_param_sites(cfg, cfg.num_hidden_layers), "grad.final_layernorm.weight")


def mtp_backward_sites(cfg) -> tuple[str, ...]:
    """The backward points of an MTP layer: the cotangents of its forward sites (`mtp_sites` with recorded inputs, but
    `NO_COTANGENT`) with `hnorm:in` before `hnorm`, in forward order, then its weight gradients."""
    out: list[str] = []
    for s in mtp_sites(cfg, recorded_inputs=True):
        if s in NO_COTANGENT:
            continue
        if s == "hnorm":
            out.append("hnorm:in")
        out.append(s)
    return (*out, *mtp_param_sites(cfg))


__all__ = ["MtpPoint", "mtp_sites", "mtp_group", "MTP_INPUTS", "GROUP_RE", "expected_mtp_points",
           "MTP_BACKWARD_ONLY", "mtp_param_sites", "mtp_backward_sites"]
