"""Backward pass of the reference Ling3 (issue 26): the VJP of one decoder layer with its sub-module cotangents,
the head's and the embedding's VJPs, and the recorded loss (`next_token_ce_mean_fp32`).

All are `jax.vjp` of the forward functions the forward replay runs (`layer.decoder_layer`, `model.head`,
`model.embed`), through the suite's helper `parity.targets.backward.layer_vjp`; no hand-written backward.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.model import embed, head
from parity.jax_ling3.spec import LayerSpec
from parity.targets.backward import layer_vjp, probe_shapes, zero_probes

F32 = jnp.float32
LOSS_NAME = "next_token_ce_mean_fp32"


def layer_backward(layer_fn, p: dict, h: jnp.ndarray, positions: jnp.ndarray, cotangent: jnp.ndarray,
                   forced_idx, spec: LayerSpec):
    """(d_hidden, d_params (JAX layout), {site: cotangent}) of `layer_fn` (`decoder_layer`'s signature, with
    `probes`) at prefill (no state), routing forced to `forced_idx` (the forward's experts: discrete top-k is not
    differentiated)."""
    def fn(params, hidden, probes):
        out, pts, _ = layer_fn(params, hidden, positions, spec, None, forced_idx, probes=probes)
        return out, pts

    shapes = probe_shapes(fn, p, h)
    dh, dp, dpr, _ = layer_vjp(fn, p, h, cotangent, zero_probes(shapes))
    return dh, dp, dpr


@lru_cache(maxsize=64)
def make_layer_backward_jit(layer_fn):
    """`layer_backward` of `layer_fn`, jitted (static spec) with the reference's compiler options.

    One jitted function per layer function in the process (not per target instance): a second target replaying the
    same layer function reuses its traces and `reference.compiled_call`'s executables instead of tracing and
    lowering the layer's VJP again (seconds per layer kind; what the test suite's many short replays paid)."""
    return jax.jit(partial(layer_backward, layer_fn), static_argnames=("spec",),
                   compiler_options=REFERENCE_COMPILER_OPTIONS)


def next_token_loss(logits: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """The recorded loss: mean over the B·(T-1) positions t = 0..T-2 of CE(logits[b,t] in fp32, ids[b,t+1]),
    natural log (backward contract)."""
    lg = logits[:, :-1].astype(F32)
    tgt = ids[:, 1:]
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


@jax.jit
def loss_backward(logits: jnp.ndarray, ids: jnp.ndarray):
    """(loss, dL/dlogits fp32 [B,T,V]); the last position's cotangent is zero (no target)."""
    return jax.value_and_grad(next_token_loss)(logits.astype(F32), ids)


@partial(jax.jit, static_argnames=("eps",), compiler_options=REFERENCE_COMPILER_OPTIONS)
def head_backward(final_norm_w, lm_head, h, d_logits, eps: float):
    """VJP of `model.head` at the last layer's output h with dL/dlogits: {"input": dL/dh, "final_norm": dL/d(final
    norm output) (a probe), "final_norm_w": grad of the norm weight, "lm_head": grad of lm_head [D,V]}."""
    x_shape = jax.eval_shape(lambda w, hh: head(w, lm_head, hh, eps)["final_norm"], final_norm_w, h)

    def f(w, lm, hh, probe):
        from parity.jax_ling3.model import lm_head_logits
        from parity.jax_ling3.norms import rms_norm

        x = rms_norm(hh, w, eps) + probe  # the same two steps as `model.head`, with a -0.0 probe between them
        return lm_head_logits(lm, x)

    probe = jnp.full(x_shape.shape, -0.0, x_shape.dtype)
    _, vjp = jax.vjp(f, final_norm_w, lm_head, h, probe)
    dw, dlm, dh, dx = vjp(d_logits.astype(F32))
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
