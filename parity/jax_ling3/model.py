"""Embedding, final norm, LM head, and whole-model prefill / decode, one layer resident at a time (DESIGN §9)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from parity.model.config import Ling3Config
from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS
from parity.jax_ling3.layer import decoder_layer_jit
from parity.jax_ling3.mla import init_mla_cache
from parity.jax_ling3.norms import rms_norm
from parity.jax_ling3.ops import linear
from parity.jax_ling3.spec import LayerSpec, dtype_of, layer_spec, model_spec

F32 = jnp.float32


def embed(emb: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """`model.word_embeddings` lookup, no scaling (facts §6)."""
    return jnp.take(emb, ids, axis=0)


def head(final_norm_w: jnp.ndarray, lm_head: jnp.ndarray, h: jnp.ndarray, eps: float):
    """Final RMSNorm, then lm_head in the model dtype and `.float()` after (facts §6, §8).
    lm_head [D,V]. Returns {"final_norm": [B,T,D], "logits": [B,T,V] fp32}."""
    x = rms_norm(h, final_norm_w, eps)
    return {"final_norm": x, "logits": lm_head_logits(lm_head, x)}


def lm_head_logits(lm_head: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    """The second half of `head`: lm_head on an already normalised x (the variant shadow of the head feeds it the
    final norm a named variant gives, parity.replay.strategies)."""
    return linear(x, lm_head).astype(F32)


embed_jit = jax.jit(embed, compiler_options=REFERENCE_COMPILER_OPTIONS)
lm_head_logits_jit = jax.jit(lm_head_logits, compiler_options=REFERENCE_COMPILER_OPTIONS)
head_jit = jax.jit(head, static_argnames=("eps",), compiler_options=REFERENCE_COMPILER_OPTIONS)


def to_device(tree, sharding_fn: Callable | None = None):
    """numpy params -> jax arrays (optionally placed by `sharding_fn(path, array)`, see `sharding.place_layer`)."""
    if sharding_fn is not None:
        return sharding_fn(tree)
    return jax.tree_util.tree_map(jax.device_put, tree)  # not jnp.asarray: that compiles a `stage` per shape


@dataclass
class Ling3Model:
    """Whole-model runner over a `CheckpointReader` (or anything with `.config`, `.layer_params(i, dtype)`,
    `.global_params(dtype)`).

    keep_weights=False: each layer's weights are loaded, used and dropped in turn (peak ≈ one layer), also at every
    decode step; True keeps them resident (faster decode on small models).
    clamp=False drops the SwiGLU clamp (to compare with runtimes without it, facts §10.1); kda_gate_dtype /
    kda_beta_dtype / kda_chunk_dtype follow a runtime's KDA gate / beta / chunk-kernel precision
    (parity.model.semantics.reference_options)."""

    reader: Any
    dtype: str = "float32"
    clamp: bool = True
    kda_mode: str = "auto"
    mla_absorbed: bool = True
    kda_gate_dtype: str = "float32"
    kda_beta_dtype: str = "float32"
    kda_chunk_dtype: str = "float32"
    keep_weights: bool = False
    place: Callable | None = None  # e.g. sharding.placer(mesh)
    _weights: dict = field(default_factory=dict, repr=False)

    @property
    def config(self) -> Ling3Config:
        return self.reader.config

    def spec(self, i: int) -> LayerSpec:
        return layer_spec(self.config, i, self.dtype, clamp=self.clamp, kda_mode=self.kda_mode,
                          mla_absorbed=self.mla_absorbed, kda_gate_dtype=self.kda_gate_dtype,
                          kda_beta_dtype=self.kda_beta_dtype, kda_chunk_dtype=self.kda_chunk_dtype)

    def _layer(self, i: int):
        if i in self._weights:
            return self._weights[i]
        if self.place is None:  # stream each tensor to the device as it is converted (peak ≈ one layer)
            p = self.reader.layer_params(i, self.dtype, put=jnp.asarray)
        else:
            p = to_device(self.reader.layer_params(i, self.dtype), self.place)
        if self.keep_weights:
            self._weights[i] = p
        return p

    def _globals(self):
        if "g" in self._weights:
            return self._weights["g"]
        g = to_device(self.reader.global_params(self.dtype))
        if self.keep_weights:
            self._weights["g"] = g
        return g

    def forward(self, ids, positions, states=None, *, capacity: int | None = None,
                on_points: Callable[[int | None, dict], None] | None = None, forced: dict | None = None):
        """Run ids [B,T] at positions [T] through every layer. states: None (prefill) or the list returned by the
        previous call. With `capacity`, MLA layers get a latent cache of that many tokens (needed to decode after).
        on_points(layer, points) receives each layer's points (layer None: embed / final_norm / logits).
        forced: {layer: topk ids [B,T,k]}. Returns (logits [B,T,V] fp32, new states)."""
        cfg = self.config
        ids = jnp.asarray(ids, jnp.int32)
        positions = jnp.asarray(positions, jnp.int32)
        B, T = ids.shape
        g = self._globals()
        h = embed_jit(g["embed"], ids)
        if on_points:
            on_points(None, {"embed": h})
        new_states = []
        for i in range(cfg.num_hidden_layers):
            spec = self.spec(i)
            st = None if states is None else states[i]
            if st is None and spec.kind == "mla" and capacity is not None:
                st = init_mla_cache(B, capacity, spec)
            p = self._layer(i)
            fi = None if not forced or i not in forced else jnp.asarray(forced[i], jnp.int32)
            h, pts, st = decoder_layer_jit(p, h, positions, spec, st, fi)
            del p
            new_states.append(st)
            if on_points:
                on_points(i, pts)
        out = head_jit(g["final_norm"], g["lm_head"], h, model_spec(cfg, self.dtype).eps)
        if on_points:
            on_points(None, out)
        return out["logits"], new_states

    def prefill(self, ids, *, capacity: int | None = None, **kw):
        ids = np.asarray(ids)
        T = ids.shape[1]
        return self.forward(ids, np.arange(T), None, capacity=capacity or T + 64, **kw)

    def decode(self, ids, start: int, states, **kw):
        """Decode step(s): ids [B,t] at positions start..start+t-1 with the states of the previous call."""
        ids = np.asarray(ids)
        return self.forward(ids, start + np.arange(ids.shape[1]), states, **kw)
