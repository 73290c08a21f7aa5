"""The JAX-target protocol (DESIGN §7).

A target is the JAX implementation under test. The suite's own pure-JAX Ling3 is `reference`; external ports
(sglang-jax, MaxText) plug in as import-guarded adapters. A target takes **HF checkpoint names and shapes** per layer
(it owns its conversion), runs one decoder layer at a time, and returns the canonical points it produces
(`parity.model.points`), in the canonical shapes (`parity.model.points.canonical_shape`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Capability flags: a test that needs one the target lacks is skipped with the reason.
CAPABILITIES = {
    "q_lora": "MLA with q-LoRA (q_a_proj / q_a_layernorm / q_b_proj)",
    "swiglu_clamp": "SwiGLU clamp limits per layer (facts §5.7)",
    "absorbed_decode": "MLA decode in the absorbed form over a latent cache",
    "forced_routing": "MoE run on given expert ids (compare expert maths where routing flipped)",
    "kda_chunked": "KDA chunked prefill",
    "kda_recurrent": "KDA recurrent decode",
    "decode": "cached decode steps",
    "mesh": "runs sharded on a device mesh",
    "isolated": "sub-modules callable on dumped inputs",
    "backward": "VJP of a layer, the head, the embedding and the loss (backward replay, issue 26)",
}


@dataclass
class LayerResult:
    """What one decoder-layer call returns: the residual stream leaving it, its canonical points, and the state to
    pass to the next call of the same layer (KDA recurrent + conv state, MLA cache)."""

    output: np.ndarray
    points: dict[str, np.ndarray] = field(default_factory=dict)
    state: Any = None
    # protocol v2 (optional): declared transforms of points computed in another form (`parity.targets.taps`), whose
    # reference side the replay applies before comparing; and why a site the target taps did not fire this call.
    transforms: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


@dataclass
class BackwardResult:
    """What one `layer_backward` call returns (issue 26): dL/d input [B,T,D]; weight gradients under HF names relative
    to `model.layers.{i}.` in HF shapes (every trainable parameter of the layer; experts that got no token: zeros);
    the sub-module cotangents the target can tap ({site: dL/d(site)}, canonical shapes); and why a site it taps
    produced none."""

    input_grad: np.ndarray
    param_grads: dict[str, np.ndarray] = field(default_factory=dict)
    points: dict[str, np.ndarray] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


class Target(abc.ABC):
    name: str = "abstract"
    capabilities: frozenset[str] = frozenset()
    # protocol v2: a port whose loader reads a checkpoint directory sets this; the replay then calls
    # `use_checkpoint_dir` after `build` (and still passes HF tensors to `load_layer`, which it may ignore).
    needs_checkpoint_dir: bool = False
    # the environment variables the target's results depend on (e.g. an adapter reading `MYPORT_ATTN_IMPL`, or
    # XLA_FLAGS it needs): report.json `target_environment` records their values, the `reproduce:` line sets them, a
    # repro bundle carries them and its script sets them before building the target (issue 32)
    environment: tuple[str, ...] = ()

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(True, "") when the target can run here, else (False, reason) — a missing target is a skip."""
        return True, ""

    @abc.abstractmethod
    def build(self, config, dtype: str, mesh=None) -> None:
        """Prepare for a model of this Ling3Config in dtype "bfloat16" or "float32" (optionally on a device mesh)."""

    @abc.abstractmethod
    def load_globals(self, hf_tensors: dict[str, np.ndarray]) -> None:
        """`model.word_embeddings.weight`, `model.norm.weight`, `lm_head.weight` (HF names and shapes)."""

    @abc.abstractmethod
    def load_layer(self, i: int, hf_tensors: dict[str, np.ndarray]) -> None:
        """All `model.layers.{i}.*` tensors under their HF names and shapes; the target converts them."""

    def unload_layer(self, i: int) -> None:
        """Release layer i's weights (one layer resident at a time, DESIGN §9)."""

    @abc.abstractmethod
    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """[B,T] ids -> [B,T,D] hidden."""

    @abc.abstractmethod
    def layer_forward(self, i: int, hidden: np.ndarray, positions: np.ndarray, state: Any = None,
                      forced_topk: np.ndarray | None = None) -> LayerResult:
        """Decoder layer i on `hidden` [B,T,D] at absolute `positions` [T]. `state` is what the previous call of this
        layer returned (None: start of sequence). With T > 1 and no state this is a prefill; T == 1 with a state a
        decode step. `forced_topk` [B,T,k] expert ids replace the router's choice (capability forced_routing)."""

    @abc.abstractmethod
    def head(self, hidden: np.ndarray) -> dict[str, np.ndarray]:
        """Final norm and LM head: {"final_norm": [B,T,D], "logits": [B,T,V]}."""

    def submodule(self, i: int, site: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray] | None = None
                  ) -> np.ndarray | None:
        """Isolated replay (DESIGN §6, capability `isolated`): compute the one site `site` of layer i from the
        *dumped* tensors it is fed, and nothing else. Returns the site's tensor in its canonical shape
        (`parity.model.points.canonical_shape`, else the natural [B,T,...] shape), or None when the target cannot compute
        this site in isolation (the replay then records it as skipped, with this target's name in the reason).

        `inputs` maps canonical site names to the dumped tensors of the same phase/step, in the dump's dtypes, as
        listed per site by the site graph (`parity.model.points.SITE_GRAPH`, `Site.inputs`) — e.g. `attention.o_proj` gets
        {"attention.o_norm"}, `attention.core` (KDA) gets the q/k/v conv outputs, `attention.gate`,
        `attention.beta`, `attention.state` the same without q (the state update reads none); MLA `attention.core` gets
        its q, `kv_b_proj`, `kv_a_proj_with_mqa` and "positions" (int [T], absolute RoPE positions of
        these tokens). Sites needing the routing get the dumped "mlp.gate.topk_idx" / "mlp.gate.topk_weight".
        `state` (decode steps only, None at prefill) holds dumped tensors of *earlier* steps of this layer:
        KDA {"attention.conv_state": [3,B,P,W], "attention.state": [B,H,K,V]} of the previous step; MLA
        {"attention.kv_b_proj": [B,S,·], "attention.kv_a_proj_with_mqa": [B,S,·]} of all S earlier tokens
        (positions 0..S-1). The default implementation supports no site."""
        return None

    def submodule_backward(self, i: int, site: str, inputs: dict[str, np.ndarray], cotangent: np.ndarray
                           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """Isolated backward (capabilities `isolated` and `backward`, issue 33): the VJP of the one site `site` of
        layer i at prefill, at the dumped `inputs` `submodule` gets (no state), fed the dumped cotangent of the
        site's output. Returns ({input site: dL/d that input through this site} for its floating inputs, {parameter
        name relative to `model.layers.{i}.` (HF, as `layer_backward`'s `param_grads`): its gradient through this
        site}), or None when the target cannot (the replay then skips the backward points this site feeds, saying
        so). The replay sums each input's contributions over the sites that read it, so a site's cotangent is
        computed from its consumers' dumped cotangents. The default implementation supports no site."""
        return None

    # ------------------------------------------------------------------ MTP layers (capability `mtp`)
    # The MTP layer j (checkpoint layer N+j, facts §2; points `/prefill/MTP{j}/<site>`, parity.model.mtp_points) as the
    # official forward runs it after the main stack. A target without the capability has its MTP points skipped.
    def load_mtp(self, j: int, hf_tensors: dict[str, np.ndarray]) -> None:
        """All `model.layers.{N+j}.*` tensors under their HF names (enorm, hnorm, eh_proj, final_layernorm and the
        MLA + MoE block)."""
        raise NotImplementedError(f"target {self.name} has no MTP layer (capability `mtp`)")

    def unload_mtp(self, j: int) -> None:
        """Release MTP layer j's weights."""

    def mtp_embed(self, input_ids: np.ndarray) -> np.ndarray:
        """[B,T] ids of a step -> [B,T,D]: the embedding of the MTP layer's own input ids, the step's ids shifted left
        by one with 0 in the last position (the official forward's `roll_tensor`; a decode step thus embeds id 0)."""
        raise NotImplementedError(f"target {self.name} has no MTP layer (capability `mtp`)")

    def mtp_forward(self, j: int, embedded: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
                    state: Any = None, forced_topk: np.ndarray | None = None) -> LayerResult:
        """MTP layer j on `embedded` (its input embedding, [B,T,D]) and `hidden` (the main stack's output after
        model.norm, [B,T,D]) at absolute `positions`; `state` its own KV state from the previous call (None: start).
        Points: the MTP sites of `parity.model.mtp_points` but `embed` / `logits`; output: the final_layernorm output."""
        raise NotImplementedError(f"target {self.name} has no MTP layer (capability `mtp`)")

    def mtp_head(self, out: np.ndarray) -> np.ndarray:
        """lm_head on the MTP output (no model.norm in between, facts §2) -> [B,T,V] float32 logits."""
        raise NotImplementedError(f"target {self.name} has no MTP layer (capability `mtp`)")

    # ------------------------------------------------------------------ backward (capability `backward`, issue 26)
    # The loss is the dump's `next_token_ce_mean_fp32`. A port with a pure JAX layer function gets `layer_backward`
    # from `parity.targets.backward.layer_vjp` (jax.vjp); a target without the capability has backward points skipped.
    def layer_backward(self, i: int, hidden: np.ndarray, positions: np.ndarray, cotangent: np.ndarray,
                       forced_topk: np.ndarray | None = None) -> BackwardResult:
        """VJP of decoder layer i at prefill (no state) on `hidden` [B,T,D] at `positions` [T], with dL/d output
        `cotangent` [B,T,D] and the MoE routed to `forced_topk` [B,T,k] (the forward's experts: discrete top-k is not
        differentiated)."""
        raise NotImplementedError(f"target {self.name} has no backward (capability `backward`)")

    def head_backward(self, hidden: np.ndarray, d_logits: np.ndarray, d_final_norm: np.ndarray | None = None
                      ) -> dict[str, np.ndarray]:
        """VJP of final norm + LM head at the last layer's output `hidden` with dL/dlogits: {"final_norm": dL/d final
        norm output, "input": dL/d hidden, "grad.model.norm.weight": [D], "grad.lm_head.weight": [V,D]}.
        `d_final_norm` [B,T,D] (given only for a dump with the MTP loss, issue 33): the final norm output's cotangent
        from its other consumer, the MTP layer (the dump's `MTP0/hnorm:in`), added in the model dtype to the LM
        head's before the norm's VJP (so "final_norm" is the sum)."""
        raise NotImplementedError(f"target {self.name} has no backward (capability `backward`)")

    def embed_backward(self, input_ids: np.ndarray, d_embed: np.ndarray) -> np.ndarray:
        """Gradient of `model.word_embeddings.weight` [V,D] from dL/d(embedding output) [B,T,D]."""
        raise NotImplementedError(f"target {self.name} has no backward (capability `backward`)")

    def loss_backward(self, logits: np.ndarray, input_ids: np.ndarray) -> tuple[float, np.ndarray]:
        """(loss, dL/dlogits fp32 [B,T,V]) of `next_token_ce_mean_fp32` (mean over t = 0..T-2 of CE(logits[:, t],
        ids[:, t+1]) in fp32)."""
        raise NotImplementedError(f"target {self.name} has no backward (capability `backward`)")

    # ------------------------------------------------------------------ MTP backward (capabilities `mtp` + `backward`)
    # Issue 33: a dump made with `--grads --mtp-loss-scale F` (root attr `backward.mtp_loss`, docs/dumping.md). A
    # target that does not implement these has its MTP backward points skipped, saying so.
    def mtp_loss_backward(self, logits: np.ndarray, input_ids: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
        """(the unscaled MTP term, dL/d mtp_logits fp32 [B,T,V] of `scale` x the term): the term is the mean over
        t = 0..T-3 of CE(mtp_logits[:, t] in fp32, ids[:, t+2])."""
        raise NotImplementedError(f"target {self.name} has no MTP backward")

    def mtp_head_backward(self, out: np.ndarray, d_logits: np.ndarray) -> dict[str, np.ndarray]:
        """VJP of the LM head on the MTP layer's output `out` (no model.norm) with dL/d mtp_logits: {"input": dL/d out
        [B,T,D] (the `final_layernorm` cotangent), "grad.lm_head.weight": the MTP term's share [V,D]}."""
        raise NotImplementedError(f"target {self.name} has no MTP backward")

    def mtp_backward(self, j: int, embedded: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
                     cotangent: np.ndarray, forced_topk: np.ndarray | None = None) -> BackwardResult:
        """VJP of MTP layer j at prefill (no state) on `embedded` / `hidden` (as `mtp_forward`), with dL/d its output
        (the final_layernorm output) `cotangent`, routed to `forced_topk`: input_grad = dL/d hidden through this
        layer (its `hnorm:in`), param_grads under HF names relative to `model.layers.{N+j}.`, points {MTP site:
        cotangent} including "embed" (dL/d embedded)."""
        raise NotImplementedError(f"target {self.name} has no MTP backward")

    # ------------------------------------------------------------------ protocol v2 (optional, with defaults)
    def use_checkpoint_dir(self, path, layers: list[int] | None = None) -> None:
        """The checkpoint directory the dump was made from (config.json + safetensors, HF names) and the layers the
        replay will visit (None: all). For ports that load from disk; `parity.targets.ckptdir.layer_checkpoint`
        writes a trimmed copy when a port's loader cannot read the original (e.g. it rejects `auto_map`)."""

    def release(self) -> None:
        """Drop everything loaded (globals, layers, MTP layers) when a replay ends, so repeated replays in one process
        hold one replay's weights at most; a later `load_*` loads again. Default: nothing (a port that holds weights
        beyond `unload_layer` overrides it)."""

    def describe(self) -> dict:
        """What actually ran, for the report header: backends, kernels, interpret modes, XLA flags, versions. The
        default says what every JAX target shares; adapters add their own keys (`parity.targets.describe_jax`)."""
        return describe_jax(self.name, **({"environment": target_environment(self)} if self.environment else {}))


def target_environment(target) -> dict[str, str | None]:
    """{name: value in this process's environment, None when unset} of the variables a target (instance or class)
    declares in `environment`."""
    import os

    return {n: os.environ.get(n) for n in getattr(target, "environment", ()) or ()}


def describe_jax(name: str, **extra) -> dict:
    """The JAX side of a report header: target name, jax/jaxlib versions, backend and devices, process XLA_FLAGS."""
    import os

    out: dict = {"target": name, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    try:
        import jax

        out.update(jax=jax.__version__, backend=jax.default_backend(),
                   devices=[str(d) for d in jax.devices()][:8])
    except Exception as e:  # a describe() must never fail a replay
        out["jax"] = f"unavailable ({e})"
    out.update(extra)
    return out


def mark_provenance(target, records: list[dict]) -> None:
    """Set each report record's `provenance` ("port" / "reference") where the target says which side computed its
    point (`provenance(layer, site)`, a composed target such as `parity.targets.partial.PartialTarget`); a target
    without it leaves the records alone (all of it is the target's own)."""
    fn = getattr(target, "provenance", None)
    if fn is None:
        return
    for r in records:
        if r.get("phase") != "backward":
            r["provenance"] = fn(r.get("layer"), r["site"])
