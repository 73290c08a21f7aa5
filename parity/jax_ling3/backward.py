"""Backward pass of the reference Ling3 (issue 26): the VJP of one decoder layer with its sub-module cotangents,
the head's and the embedding's VJPs, and the recorded loss (`next_token_ce_mean_fp32`); with a dump's MTP loss
(issue 33, `backward.mtp_loss`) the MTP term (`mtp_loss_backward`), the MTP head's VJP and the MTP layer's VJP.

All are `jax.vjp` of the forward functions the forward replay runs (`layer.decoder_layer`, `model.head`,
`model.embed`, `mtp.mtp_layer`, `mtp.mtp_logits`), through the suite's helper `parity.targets.backward.layer_vjp`
where it fits; no hand-written backward.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.model import embed, head, lm_head_logits
from parity.jax_ling3.mtp import mtp_logits
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.spec import LayerSpec
from parity.targets.backward import NOT_PROBED, layer_vjp, probe_shapes, zero_probes

F32 = jnp.float32
LOSS_NAME = "next_token_ce_mean_fp32"


EXPERT_STACKS = ("experts_gate", "experts_up", "experts_down")


def experts_to_hf(dp: dict) -> dict:
    """d_params with the routed experts' gradient stacks swapped from the JAX layout [E, in, out] to the HF one
    [E, out, in] (the rest unchanged). Inside the jitted VJP this costs nothing: the experts' VJP computes its stacks
    in the HF layout and ends with the opposite swap (`moe._routed_blocked_bwd`), and XLA cancels the two; on the
    host the same transposes took ~0.5 s per Ling3-Tiny stack (3 per MoE layer)."""
    mlp = dp.get("mlp") if isinstance(dp, dict) else None
    if not isinstance(mlp, dict) or not all(n in mlp for n in EXPERT_STACKS):
        return dp
    return {**dp, "mlp": {**mlp, **{n: jnp.swapaxes(mlp[n], -1, -2) for n in EXPERT_STACKS}}}


def layer_backward(layer_fn, p: dict, h: jnp.ndarray, positions: jnp.ndarray, cotangent: jnp.ndarray,
                   forced_idx, spec: LayerSpec, hf_experts: bool = False):
    """(d_hidden, d_params (JAX layout), {site: cotangent}) of `layer_fn` (`decoder_layer`'s signature, with
    `probes`) at prefill (no state), routing forced to `forced_idx` (the forward's experts: discrete top-k is not
    differentiated). `hf_experts`: the routed experts' stacks in d_params in the HF layout (`experts_to_hf`)."""
    def fn(params, hidden, probes):
        out, pts, _ = layer_fn(params, hidden, positions, spec, None, forced_idx, probes=probes)
        return out, pts

    shapes = probe_shapes(fn, p, h)
    dh, dp, dpr, _ = layer_vjp(fn, p, h, cotangent, zero_probes(shapes))
    return dh, experts_to_hf(dp) if hf_experts else dp, dpr


@lru_cache(maxsize=64)
def make_layer_backward_jit(layer_fn):
    """`layer_backward` of `layer_fn`, jitted (static spec and hf_experts) with the reference's compiler options.

    One jitted function per layer function in the process (not per target instance): a second target replaying the
    same layer function reuses its traces and `reference.compiled_call`'s executables instead of tracing and
    lowering the layer's VJP again (seconds per layer kind; what the test suite's many short replays paid)."""
    return jax.jit(partial(layer_backward, layer_fn), static_argnames=("spec", "hf_experts"),
                   compiler_options=REFERENCE_COMPILER_OPTIONS)


def next_token_loss(logits: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """The recorded loss: mean over the B·(T-1) positions t = 0..T-2 of CE(logits[b,t] in fp32, ids[b,t+1]),
    natural log (backward contract)."""
    return _shifted_ce(logits, ids, 1)


def _shifted_ce(logits: jnp.ndarray, ids: jnp.ndarray, shift: int) -> jnp.ndarray:
    """Mean over positions t = 0..T-1-shift of CE(logits[b,t] in fp32, ids[b,t+shift]), natural log."""
    lg = logits[:, :-shift].astype(F32)
    tgt = ids[:, shift:]
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


@jax.jit
def loss_backward(logits: jnp.ndarray, ids: jnp.ndarray):
    """(loss, dL/dlogits fp32 [B,T,V]); the last position's cotangent is zero (no target)."""
    return jax.value_and_grad(next_token_loss)(logits.astype(F32), ids)


@partial(jax.jit, static_argnames=("eps",), compiler_options=REFERENCE_COMPILER_OPTIONS)
def head_backward(final_norm_w, lm_head, h, d_logits, eps: float, d_final_norm=None):
    """VJP of `model.head` at the last layer's output h with dL/dlogits: {"input": dL/dh, "final_norm": dL/d(final
    norm output) (a probe), "final_norm_w": grad of the norm weight, "lm_head": grad of lm_head [D,V]}.
    `d_final_norm` (None: none): the cotangent the final norm's output gets from its other consumer, the MTP layer
    (its `hnorm:in`, issue 33; facts §2: the MTP layer reads the main state after model.norm) — added to the LM
    head's in the model dtype, as autograd sums a tensor's two uses, before the norm's VJP."""
    x_shape = jax.eval_shape(lambda w, hh: head(w, lm_head, hh, eps)["final_norm"], final_norm_w, h)

    def f(w, lm, hh, probe):
        x = rms_norm(hh, w, eps) + probe  # the same two steps as `model.head`, with a -0.0 probe between them
        return lm_head_logits(lm, x)

    def f2(w, lm, hh, probe):  # also returns the norm's output, which the MTP layer reads
        x = rms_norm(hh, w, eps) + probe
        return lm_head_logits(lm, x), x

    probe = jnp.full(x_shape.shape, -0.0, x_shape.dtype)
    if d_final_norm is None:
        _, vjp = jax.vjp(f, final_norm_w, lm_head, h, probe)
        dw, dlm, dh, dx = vjp(d_logits.astype(F32))
    else:
        _, vjp = jax.vjp(f2, final_norm_w, lm_head, h, probe)
        dw, dlm, dh, dx = vjp((d_logits.astype(F32), d_final_norm.astype(x_shape.dtype)))
    return {"input": dh, "final_norm": dx, "final_norm_w": dw, "lm_head": dlm}


@partial(jax.jit, static_argnames=("pad_id",))
def embed_backward(emb: jnp.ndarray, ids: jnp.ndarray, d_embed: jnp.ndarray, pad_id: int | None = None) -> jnp.ndarray:
    """Grad of the embedding table [V,D] from dL/d(embedding output): the VJP of `model.embed` (a scatter-add over
    repeated ids). The official `word_embeddings` is `nn.Embedding(V, D, padding_idx=pad_token_id)`, whose backward
    leaves the padding row's gradient zero (torch semantics of `padding_idx`): positions holding `pad_id` contribute
    nothing (found by tests/test_backward_replay.py: a prompt with id 0 in the tiny checkpoints, pad_token_id 0)."""
    d = d_embed.astype(emb.dtype)
    if pad_id is not None:
        d = jnp.where((ids == pad_id)[..., None], jnp.zeros((), d.dtype), d)
    _, vjp = jax.vjp(lambda e: embed(e, ids), emb)
    return vjp(d)[0]


# ------------------------------------------------------------------------------------------ MTP (issue 33)
MTP_LOSS_NAME = "mtp_next_next_token_ce_mean_fp32"


def mtp_token_loss(logits: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """The MTP term of the dump's `backward.mtp_loss` (unscaled): mean over the B·(T-2) positions t = 0..T-3 of
    CE(mtp_logits[b,t] in fp32, ids[b,t+2]), natural log. Why t+2: the MTP layer at t reads token t+1 and the main
    state at t (facts §2), and the official loss scores it against labels shifted twice (once by its own roll, once
    by transformers' causal-LM loss; parity.torch_ref.backward.MTP_LOSS_DEFINITION)."""
    return _shifted_ce(logits, ids, 2)


@jax.jit
def mtp_loss_backward(logits: jnp.ndarray, ids: jnp.ndarray, scale: jnp.ndarray):
    """(the unscaled MTP term, dL/d mtp_logits fp32 [B,T,V] of `scale` · term); the last two positions' cotangent is
    zero (no target)."""
    def scaled(lg):  # (what is differentiated, the unscaled term)
        term = mtp_token_loss(lg, ids)
        return scale * term, term

    (_, term), d = jax.value_and_grad(scaled, has_aux=True)(logits.astype(F32))
    return term, d


@partial(jax.jit, compiler_options=REFERENCE_COMPILER_OPTIONS)
def mtp_head_backward(lm_head, out, d_logits):
    """VJP of `mtp.mtp_logits` (lm_head on the MTP output, no model.norm, facts §2) at the MTP layer's output `out`
    with dL/d mtp_logits: {"input": dL/d out (the `final_layernorm` cotangent), "lm_head": the MTP term's share of
    the LM head's gradient [D,V]}."""
    _, vjp = jax.vjp(mtp_logits, lm_head, out)
    dlm, dout = vjp(d_logits.astype(F32))
    return {"input": dout, "lm_head": dlm}


def mtp_backward(mtp_fn, p: dict, embedded: jnp.ndarray, hidden: jnp.ndarray, positions: jnp.ndarray,
                 cotangent: jnp.ndarray, forced_idx, spec: LayerSpec):
    """VJP of one MTP layer (`mtp_fn`: `mtp.mtp_layer`'s signature, with `probes`) at prefill (no state), fed dL/d
    its output (the final_layernorm output) and routed to `forced_idx` (the forward's experts): (d_embedded,
    d_hidden — the layer's `hnorm:in` —, d_params (JAX layout), {site: cotangent} for every floating point it
    returns)."""
    def fn(params, emb, hid, probes):
        out, pts, _ = mtp_fn(params, emb, hid, positions, spec, None, forced_idx, probes=probes)
        return out, pts

    _, pts = jax.eval_shape(lambda pp, e, h: fn(pp, e, h, None), p, embedded, hidden)
    probes = zero_probes({k: v for k, v in pts.items()
                          if k not in NOT_PROBED and jnp.issubdtype(v.dtype, jnp.floating)})
    out, vjp = jax.vjp(lambda pp, e, h, pr: fn(pp, e, h, pr)[0], p, embedded, hidden, probes)
    dp, de, dh, dpr = vjp(cotangent.astype(out.dtype))
    return de, dh, dp, dpr


@lru_cache(maxsize=16)
def make_mtp_backward_jit(mtp_fn):
    """`mtp_backward` of `mtp_fn`, jitted (static spec) with the reference's compiler options (one per function in
    the process, as `make_layer_backward_jit`)."""
    return jax.jit(partial(mtp_backward, mtp_fn), static_argnames=("spec",),
                   compiler_options=REFERENCE_COMPILER_OPTIONS)
