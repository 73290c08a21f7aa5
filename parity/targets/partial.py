"""Partial ports (issue 32): a target made of the blocks a port provides and the reference for everything else.

A port that implements only some of Ling3 — a KDA attention, an MoE — is tested by composing, not by subclassing the
reference: write each block it provides as a `Part`, and hand the parts to `PartialTarget`:

    from parity.targets.partial import Part, PartialTarget, PartResult

    class MyKDA(Part):
        block, kinds = "attention", ("kda",)          # the attention block of KDA layers
        def load(self, i, hf_tensors): ...            # model.layers.{i}.* under HF names (take the attention.* ones)
        def forward(self, i, x, positions, state):    # x: the input_layernorm output [B,T,D], from the reference
            return PartResult(out, points={"attention.core": core}, state=new_state)

    class MyPort(PartialTarget):
        def __init__(self):
            super().__init__(MyKDA(), name="my-kda")

`--parity-target my_pkg.adapter:MyPort`. The layer runs as `decoder_layer` does — input norm, attention, residual
add, post-attention norm, MLP, residual add — each block from its part where a part covers this layer's kind, else
from the reference (`parity.jax_ling3.blocks`, the reference's own functions). Layers no part covers, the embedding,
the head and MTP layers are the reference's. Every compared point is marked with its provenance: `port` where a part
computed it (its block's sites: `attention` and `attention.*`, or `mlp` and `mlp.*`), `reference` otherwise
(report.json `provenance`, the terminal and the HTML report).

`follows_semantics`: a target that sets it (the reference, its mutants, this class) has the replay set the dump's
semantic forks on it (`use_semantics`: SwiGLU clamp, KDA gate / beta / chunk precision, parity/model/semantics.py), so
it computes what the dump's runtime computed. Here it reaches the reference blocks only: a part computes what the
port computes, and a departure of the dump's runtime on a fork in a port block is judged as for any port.

Isolated mode: the reference's sites by its `submodule`; a part's sites by the part's `submodule` where it has one,
else they are skipped saying the port part offers none.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.targets.base import LayerResult, Target, describe_jax

BLOCKS = ("attention", "mlp")


@dataclass
class PartResult:
    """What a part's `forward` returns: the block's output [B,T,D], the canonical points of its block it can tap
    (`attention.core`, `mlp.gate.topk_idx`, ... in canonical shapes), the state its next call of this layer continues
    (attention parts; None for an MLP), declared transforms and why a tapped site did not fire (as `LayerResult`)."""

    output: Any
    points: dict[str, Any] = field(default_factory=dict)
    state: Any = None
    transforms: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


class Part(abc.ABC):
    """One block of the decoder layer a port computes. `block`: "attention" (the attention block on the
    input-layernormed stream; its output is added to the residual) or "mlp" (the MoE / dense MLP on the
    post-attention-normed stream). `kinds`: the layer kinds it covers ("kda", "mla"; for an MLP part "moe",
    "dense")."""

    block: str = "attention"
    kinds: tuple[str, ...] = ("kda",)

    def build(self, config, dtype: str) -> None:
        """The model config and the compute dtype ("bfloat16" / "float32"), before any load."""
        self.cfg, self.dtype = config, dtype

    @abc.abstractmethod
    def load(self, i: int, hf_tensors: dict[str, np.ndarray]) -> None:
        """Every `model.layers.{i}.*` tensor under its HF name and shape (the part converts what its block reads)."""

    def unload(self, i: int) -> None:
        """Release layer i's weights."""

    @abc.abstractmethod
    def forward(self, i: int, x: np.ndarray, positions: np.ndarray, state: Any = None,
                forced_topk: np.ndarray | None = None) -> PartResult:
        """The block of layer i on its normed input `x` [B,T,D] at absolute `positions`; `state` what its previous
        call of this layer returned (None: start); `forced_topk` the experts an MLP part is routed to (forced mode)."""

    def submodule(self, i: int, site: str, inputs: dict, state: dict | None = None):
        """Isolated replay of one of its block's sites (`Target.submodule`); None: not offered."""
        return None

    def describe(self) -> dict:
        """What the part runs, for the report header."""
        return {"part": type(self).__qualname__}


def block_of(site: str) -> str | None:
    """The block a layer site belongs to ("attention", "mlp"), None for the layer's own glue (norms, input,
    output)."""
    for b in BLOCKS:
        if site == b or site.startswith(b + "."):
            return b
    return None


class PartialTarget(Target):
    """The reference with some blocks computed by a port's `Part`s (see the module doc)."""

    name = "partial"
    follows_semantics = True  # forwarded to the reference blocks (module doc)

    def __init__(self, *parts: Part, name: str | None = None, **reference_options) -> None:
        from parity.targets.reference import ReferenceTarget

        self.reference = ReferenceTarget(**reference_options)
        self.parts: list[Part] = list(parts)
        for p in self.parts:
            if p.block not in BLOCKS:
                raise ValueError(f"part {type(p).__qualname__}: block {p.block!r}, expected one of {BLOCKS}")
        self.name = name or "partial(" + ", ".join(f"{type(p).__name__}:{p.block}/{'+'.join(p.kinds)}"
                                                  for p in self.parts) + ")"
        caps = set(self.reference.capabilities) - {"backward", "mesh"}
        if any(p.block == "mlp" for p in self.parts):
            caps.discard("forced_routing")  # unless every MLP part honours forced_topk; a part may say so itself
        self.capabilities = frozenset(caps)

    # ------------------------------------------------------------------ which block comes from where
    def part_for(self, i: int, block: str) -> Part | None:
        """The part computing `block` of layer i, None: the reference's."""
        kind = self.cfg.layer_kind(i) if block == "attention" else ("moe" if self.cfg.is_moe(i) else "dense")
        return next((p for p in self.parts if p.block == block and kind in p.kinds), None)

    def provenance(self, layer: int | None, site: str) -> str:
        """"port" where a part computes the site (its block's output and sub-sites), else "reference"."""
        b = block_of(site)
        if layer is None or b is None or layer >= self.cfg.num_hidden_layers:
            return "reference"
        return "port" if self.part_for(layer, b) is not None else "reference"

    # ------------------------------------------------------------------ the protocol
    def build(self, config, dtype: str, mesh=None) -> None:
        self.cfg, self.dtype = config, dtype
        self.reference.build(config, dtype)
        for p in self.parts:
            p.build(config, self.reference.dtype)

    def semantic_options(self) -> dict:
        return self.reference.semantic_options()

    def use_semantics(self, **options) -> None:
        self.reference.use_semantics(**options)

    def describe(self) -> dict:
        return describe_jax(self.name, parts=[dict(p.describe(), block=p.block, kinds=list(p.kinds))
                                              for p in self.parts], rest="reference (parity.targets.reference)")

    def load_globals(self, hf_tensors):
        self.reference.load_globals(hf_tensors)

    def load_layer(self, i: int, hf_tensors):
        self.reference.load_layer(i, hf_tensors)
        for b in BLOCKS:
            if (p := self.part_for(i, b)) is not None:
                p.load(i, hf_tensors)

    def unload_layer(self, i: int) -> None:
        self.reference.unload_layer(i)
        for p in self.parts:
            p.unload(i)

    def release(self) -> None:
        self.reference.release()

    def embed(self, input_ids):
        return self.reference.embed(input_ids)

    def head(self, hidden):
        return self.reference.head(hidden)

    def layer_forward(self, i: int, hidden, positions, state=None, forced_topk=None) -> LayerResult:
        attn, mlp = self.part_for(i, "attention"), self.part_for(i, "mlp")
        if attn is None and mlp is None:
            return self.reference.layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
        import jax.numpy as jnp

        from parity.jax_ling3 import blocks
        from parity.jax_ling3.mla import init_mla_cache
        from parity.jax_ling3.spec import dtype_of

        spec, p = self.reference.spec(i), self.reference.params[i]
        dt = dtype_of(self.reference.dtype)
        h = jnp.asarray(hidden, dt)
        pos = jnp.asarray(positions, jnp.int32)
        pts: dict = {"input": np.asarray(hidden)}
        transforms: dict = {}
        missing: dict = {}
        x = blocks.input_norm(p, h, spec=spec)
        pts["input_layernorm"] = np.asarray(x)
        if attn is not None:
            r = attn.forward(i, np.asarray(x), np.asarray(positions), state, None)
            a, new_state = jnp.asarray(r.output, dt), r.state
            self._take(pts, transforms, missing, r, "attention")
        else:
            st = state
            if st is None and spec.kind == "mla":
                from parity.targets.reference import DECODE_ROOM

                st = init_mla_cache(h.shape[0], h.shape[1] + DECODE_ROOM, spec)
            a, apts, new_state = blocks.attention(p, x, pos, spec=spec, state=st)
            pts.update({k: np.asarray(v) for k, v in apts.items()})
        pts["attention"] = np.asarray(a)
        h2, x2 = blocks.post_attention(p, h, a, spec=spec)
        pts["post_attention_layernorm"] = np.asarray(x2)
        if mlp is not None:
            r = mlp.forward(i, np.asarray(x2), np.asarray(positions), None, forced_topk)
            y = jnp.asarray(r.output, dt)
            self._take(pts, transforms, missing, r, "mlp")
        else:
            fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
            y, mpts = blocks.mlp(p, x2, spec=spec, forced_idx=fi)
            pts.update({k: np.asarray(v) for k, v in mpts.items()})
        pts["mlp"] = np.asarray(y)
        out = np.asarray(blocks.residual(h2, y))
        pts["output"] = out
        return LayerResult(out, pts, new_state, transforms=transforms, missing=missing)

    @staticmethod
    def _take(pts: dict, transforms: dict, missing: dict, r: PartResult, block: str) -> None:
        """A part's points, transforms and reasons of its own block (a part cannot overwrite another block's)."""
        own = lambda d: {k: v for k, v in d.items() if block_of(k) == block}  # noqa: E731
        pts.update(own(r.points))
        transforms.update(own(r.transforms))
        missing.update(own(r.missing))

    def submodule(self, i: int, site: str, inputs: dict, state=None):
        b = block_of(site)
        part = None if b is None else self.part_for(i, b)
        if part is None:
            return self.reference.submodule(i, site, inputs, state)
        return part.submodule(i, site, inputs, state)

    # MTP layers: the reference's (no part covers them)
    def load_mtp(self, j, hf_tensors):
        return self.reference.load_mtp(j, hf_tensors)

    def unload_mtp(self, j):
        return self.reference.unload_mtp(j)

    def mtp_embed(self, input_ids):
        return self.reference.mtp_embed(input_ids)

    def mtp_forward(self, j, embedded, hidden, positions, state=None, forced_topk=None):
        return self.reference.mtp_forward(j, embedded, hidden, positions, state, forced_topk=forced_topk)

    def mtp_head(self, out):
        return self.reference.mtp_head(out)
