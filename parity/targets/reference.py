"""`reference`: the suite's own pure-JAX Ling3 (`parity.jax_ling3`) as a target (DESIGN §7).

It is also the template for an external adapter: convert HF tensors in `load_layer`, run one decoder layer in
`layer_forward`, return the canonical points as numpy arrays.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import numpy as np

from parity.targets.base import BackwardResult, LayerResult, Target

# Decode steps a prefill's MLA latent cache leaves room for (the dump's decode steps must fit).
DECODE_ROOM = 128


_COMPILED: "OrderedDict[tuple, Any]" = OrderedDict()  # (jitted fn, spec, argument avals) -> compiled executable
COMPILED_KEEP = 64  # executables kept (least recently used dropped): a replay uses ~2 per layer kind and dump


def compiled_call(fn, spec, *args):
    """`fn(args[0], args[1], args[2], spec, *args[3:])` for a jitted layer function with static `spec`, compiled
    ahead of time once per (fn, spec, argument shapes/dtypes/shardings), the host memory freed before it runs.

    Why not a plain jit call: its first call traces, lowers, compiles (or loads from the persistent cache) and runs in
    one go, so the freed lowering / deserialisation scratch is still held by the allocator while the layer's
    temporaries are live. Compiling first and then calling `release_freed_heap` lowered the peak RSS of a Ling3-Tiny
    KDA+dense layer at T=512 (cache warm) from 251-266 to 244-245 MB above the process base (weights + activations
    124 MB; tools/bench.py's JAX child, AMD EPYC, 2026-11-25). Same executable, same bits."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(args)
    # an executable is compiled for its inputs' shapes, dtypes and shardings (a meshed replay places params sharded)
    key = (fn, spec, tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
    c = _COMPILED.get(key)
    if c is None:
        c = fn.lower(args[0], args[1], args[2], spec, *args[3:]).compile()
        release_freed_heap()
        _COMPILED[key] = c
        while len(_COMPILED) > COMPILED_KEEP:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return c(*args)


def release_freed_heap() -> None:
    """Give the loader's freed host scratch back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Converting a layer frees one numpy temporary per weight (transposes, the expert stacks); glibc keeps such freed
    heap memory in the process, so one-layer replay held ~50 MB more than the layer's weights after loading a
    Ling3-Tiny KDA+dense layer (77 MB of weights; measured with tools/bench.py's JAX child)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim from the running process's own symbols (no `find_library`: it spawns ldconfig), or None."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


class ReferenceTarget(Target):
    name = "reference"
    capabilities = frozenset({"q_lora", "swiglu_clamp", "absorbed_decode", "forced_routing", "kda_chunked",
                              "kda_recurrent", "decode", "mesh", "isolated", "mtp", "backward"})

    def __init__(self, *, clamp: bool = True, kda_mode: str = "auto", mla_absorbed: bool = True,
                 kda_gate_dtype: str = "float32", kda_beta_dtype: str = "float32",
                 kda_chunk_dtype: str = "float32") -> None:
        self.clamp, self.kda_mode, self.mla_absorbed = clamp, kda_mode, mla_absorbed
        self.kda_gate_dtype, self.kda_beta_dtype, self.kda_chunk_dtype = kda_gate_dtype, kda_beta_dtype, kda_chunk_dtype
        self.params: dict[int, Any] = {}
        self.globals: dict | None = None

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import jax  # noqa: F401
        except ImportError as e:
            return False, f"jax is not installed ({e})"
        return True, ""

    def build(self, config, dtype: str, mesh=None) -> None:
        from parity.jax_ling3.spec import dtype_name, dtype_of

        self.cfg = config
        self.dtype = dtype_name(dtype_of(dtype))
        self.mesh = mesh
        self._place = None
        if mesh is not None:
            from parity.jax_ling3.sharding import placer

            self._place = placer(mesh)

    def spec(self, i: int):
        from parity.jax_ling3.spec import layer_spec

        return layer_spec(self.cfg, i, self.dtype, clamp=self.clamp, kda_mode=self.kda_mode,
                          mla_absorbed=self.mla_absorbed, kda_gate_dtype=self.kda_gate_dtype,
                          kda_beta_dtype=self.kda_beta_dtype, kda_chunk_dtype=self.kda_chunk_dtype)

    # The semantic forks (parity/model/semantics.py) this instance follows: the replay sets them from the dump's recorded
    # semantics (or the intended ones) on a reference it constructs itself.
    follows_semantics = True

    def semantic_options(self) -> dict:
        return {"clamp": self.clamp, "kda_gate_dtype": self.kda_gate_dtype, "kda_beta_dtype": self.kda_beta_dtype,
                "kda_chunk_dtype": self.kda_chunk_dtype}

    def use_semantics(self, clamp: bool, kda_gate_dtype: str, kda_beta_dtype: str,
                      kda_chunk_dtype: str = "float32") -> None:  # default: repro bundles written before this fork
        self.clamp, self.kda_gate_dtype, self.kda_beta_dtype = clamp, kda_gate_dtype, kda_beta_dtype
        self.kda_chunk_dtype = kda_chunk_dtype

    def load_globals(self, hf_tensors: dict[str, np.ndarray]) -> None:
        from parity.jax_ling3.model import to_device
        from parity.jax_ling3.weights import convert_globals

        if self.globals is None:
            self.globals = to_device(convert_globals(self.cfg, hf_tensors, self.dtype))

    def load_layer(self, i: int, hf_tensors: dict[str, np.ndarray]) -> None:
        import jax

        from parity.jax_ling3.model import to_device
        from parity.jax_ling3.weights import convert_layer

        if self._place is None:  # stream: each converted array goes to the device at once (peak ≈ layer + one array)
            # jax.device_put, not jnp.asarray: that compiles a `stage` per shape (36 compiles on the bundled dumps)
            self.params[i] = convert_layer(self.cfg, i, hf_tensors, self.dtype, put=jax.device_put)
        else:  # the placer shards the whole layer tree at once
            self.params[i] = to_device(convert_layer(self.cfg, i, hf_tensors, self.dtype), self._place)
        release_freed_heap()

    def unload_layer(self, i: int) -> None:
        self.params.pop(i, None)

    def release(self) -> None:
        """Drop the globals (embedding + LM head: ~970 MB at Ling3-Tiny's vocabulary in bf16) and any loaded layer."""
        self.globals = None
        self.params.clear()
        release_freed_heap()

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.model import embed_jit

        return np.asarray(embed_jit(self.globals["embed"], jnp.asarray(input_ids, jnp.int32)))

    def head(self, hidden: np.ndarray) -> dict[str, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.model import head_jit
        from parity.jax_ling3.spec import dtype_of

        h = jnp.asarray(hidden, dtype_of(self.dtype))
        out = head_jit(self.globals["final_norm"], self.globals["lm_head"], h, float(self.cfg.rms_norm_eps))
        return {k: np.asarray(v) for k, v in out.items()}

    def logits_of(self, normed: np.ndarray) -> np.ndarray:
        """The LM head alone on an already normalised [B,T,D] (the head's variant shadow)."""
        import jax.numpy as jnp

        from parity.jax_ling3.model import lm_head_logits_jit
        from parity.jax_ling3.spec import dtype_of

        return np.asarray(lm_head_logits_jit(self.globals["lm_head"], jnp.asarray(normed, dtype_of(self.dtype))))

    def layer_forward(self, i: int, hidden: np.ndarray, positions: np.ndarray, state: Any = None,
                      forced_topk: np.ndarray | None = None) -> LayerResult:
        import jax.numpy as jnp

        from parity.jax_ling3.mla import init_mla_cache
        from parity.jax_ling3.spec import dtype_of

        spec = self.spec(i)
        h = jnp.asarray(hidden, dtype_of(self.dtype))
        B, T = h.shape[:2]
        if state is None and spec.kind == "mla":
            state = init_mla_cache(B, T + DECODE_ROOM, spec)
        fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
        out, pts, new_state = compiled_call(self._layer_fn(), spec, self.params[i], h,
                                            jnp.asarray(positions, jnp.int32), state, fi)
        return LayerResult(np.asarray(out), {k: np.asarray(v) for k, v in pts.items()}, new_state)

    # ---------------------------------------------------------------- backward (issue 26, parity/jax_ling3/backward.py)
    # Not a buffer: `mlp.gate.expert_bias` only selects experts (facts §5.4), it is no trainable parameter (the
    # twin registers it as a buffer), so it has no gradient.
    NOT_TRAINABLE = ("mlp.gate.expert_bias",)

    def layer_backward(self, i: int, hidden: np.ndarray, positions: np.ndarray, cotangent: np.ndarray,
                       forced_topk: np.ndarray | None = None) -> BackwardResult:
        """`jax.vjp` of the same layer function `layer_forward` runs (`_layer_pure_fn`, a mutant's too), through the
        suite's helper (`parity.targets.backward.layer_vjp`); weight gradients mapped back to HF names and shapes
        (`weights.to_hf_layout`; the routed experts' stacks come out of the jitted VJP in the HF layout already,
        `backward.experts_to_hf`)."""
        import jax.numpy as jnp

        from parity.jax_ling3.spec import dtype_of
        from parity.jax_ling3.weights import to_hf_layout

        spec = self.spec(i)
        dt = dtype_of(self.dtype)
        fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
        dh, dp, dpr = self._backward_fn()(self.params[i], jnp.asarray(hidden, dt), jnp.asarray(positions, jnp.int32),
                                          jnp.asarray(cotangent, dt), fi, spec=spec, hf_experts=True)
        grads = {k: v for k, v in to_hf_layout(self.cfg, i, dp, experts_hf=True).items()
                 if k not in self.NOT_TRAINABLE}
        return BackwardResult(np.asarray(dh), grads, {k: np.asarray(v) for k, v in dpr.items()})

    def head_backward(self, hidden: np.ndarray, d_logits: np.ndarray, d_final_norm: np.ndarray | None = None
                      ) -> dict[str, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import head_backward
        from parity.jax_ling3.spec import dtype_of

        g = self.globals
        dt = dtype_of(self.dtype)
        extra = None if d_final_norm is None else jnp.asarray(d_final_norm, dt)
        out = head_backward(g["final_norm"], g["lm_head"], jnp.asarray(hidden, dt),
                            jnp.asarray(d_logits, jnp.float32), eps=float(self.cfg.rms_norm_eps), d_final_norm=extra)
        return {"final_norm": np.asarray(out["final_norm"]), "input": np.asarray(out["input"]),
                "grad.model.norm.weight": np.asarray(out["final_norm_w"]),
                "grad.lm_head.weight": np.ascontiguousarray(np.asarray(out["lm_head"]).T)}  # [D,V] -> HF [V,D]

    def embed_backward(self, input_ids: np.ndarray, d_embed: np.ndarray) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import embed_backward

        pad = getattr(self.cfg, "pad_token_id", None)
        return np.asarray(embed_backward(self.globals["embed"], jnp.asarray(input_ids, jnp.int32),
                                         jnp.asarray(d_embed), pad_id=None if pad is None else int(pad)))

    def loss_backward(self, logits: np.ndarray, input_ids: np.ndarray) -> tuple[float, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import loss_backward

        loss, d = loss_backward(jnp.asarray(logits, jnp.float32), jnp.asarray(input_ids, jnp.int32))
        return float(loss), np.asarray(d)

    def _layer_pure_fn(self):
        """The un-jitted layer function (`decoder_layer`'s signature, with `probes`) the backward differentiates:
        `_layer_fn`'s computation (a subclass swapping one swaps the other, e.g. `mutants.MutantTarget`)."""
        from parity.jax_ling3.layer import decoder_layer

        return decoder_layer

    def _backward_fn(self):
        """The jitted layer VJP over `_layer_pure_fn` (one per layer function in the process, shared by targets)."""
        from parity.jax_ling3.backward import make_layer_backward_jit

        return make_layer_backward_jit(self._layer_pure_fn())

    # ---------------------------------------------------------------- MTP layers (parity/jax_ling3/mtp.py)
    def load_mtp(self, j: int, hf_tensors: dict[str, np.ndarray]) -> None:
        import jax

        from parity.jax_ling3.model import to_device
        from parity.jax_ling3.weights import convert_mtp

        put = jax.device_put if self._place is None else None
        p = convert_mtp(self.cfg, j, hf_tensors, self.dtype, put=put)
        self.params[("mtp", j)] = p if self._place is None else to_device(p, self._place)

    def unload_mtp(self, j: int) -> None:
        self.params.pop(("mtp", j), None)

    def mtp_embed(self, input_ids: np.ndarray) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.model import embed_jit
        from parity.jax_ling3.mtp import shift_ids

        return np.asarray(embed_jit(self.globals["embed"], shift_ids(jnp.asarray(input_ids, jnp.int32))))

    def mtp_forward(self, j: int, embedded: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
                    state: Any = None, forced_topk: np.ndarray | None = None) -> LayerResult:
        import jax.numpy as jnp

        from parity.jax_ling3.mla import init_mla_cache
        from parity.jax_ling3.spec import dtype_of

        spec = self.spec(self.cfg.num_hidden_layers + j)  # MLA + MoE block (facts §2)
        e, h = (jnp.asarray(a, dtype_of(self.dtype)) for a in (embedded, hidden))
        if state is None:
            state = init_mla_cache(h.shape[0], h.shape[1] + DECODE_ROOM, spec)
        fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
        out, pts, new_state = self._mtp_fn()(self.params[("mtp", j)], e, h, jnp.asarray(positions, jnp.int32), spec,
                                             state, fi)
        return LayerResult(np.asarray(out), {k: np.asarray(v) for k, v in pts.items()}, new_state)

    def mtp_head(self, out: np.ndarray) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.mtp import mtp_logits_jit
        from parity.jax_ling3.spec import dtype_of

        return np.asarray(mtp_logits_jit(self.globals["lm_head"], jnp.asarray(out, dtype_of(self.dtype))))

    def _mtp_fn(self):
        """The jitted MTP layer function (a subclass may swap it, e.g. a mutant)."""
        from parity.jax_ling3.mtp import mtp_layer_jit

        return mtp_layer_jit

    # ---------------------------------------------------------------- MTP backward (issue 33, jax_ling3/backward.py)
    def mtp_loss_backward(self, logits: np.ndarray, input_ids: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import mtp_loss_backward

        term, d = mtp_loss_backward(jnp.asarray(logits, jnp.float32), jnp.asarray(input_ids, jnp.int32),
                                    jnp.asarray(scale, jnp.float32))
        return float(term), np.asarray(d)

    def mtp_head_backward(self, out: np.ndarray, d_logits: np.ndarray) -> dict[str, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import mtp_head_backward
        from parity.jax_ling3.spec import dtype_of

        r = mtp_head_backward(self.globals["lm_head"], jnp.asarray(out, dtype_of(self.dtype)),
                              jnp.asarray(d_logits, jnp.float32))
        return {"input": np.asarray(r["input"]),
                "grad.lm_head.weight": np.ascontiguousarray(np.asarray(r["lm_head"]).T)}  # [D,V] -> HF [V,D]

    def mtp_backward(self, j: int, embedded: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
                     cotangent: np.ndarray, forced_topk: np.ndarray | None = None) -> BackwardResult:
        """`jax.vjp` of the MTP layer function `_mtp_pure_fn` (`mtp.mtp_layer`) with probes at its sites; weight
        gradients under HF names: enorm / hnorm / final_layernorm [D], eh_proj [D, 2D] (HF layout, the transpose of
        the JAX [2D, D]), the block's through `weights.to_hf_layout` of layer N+j."""
        import jax.numpy as jnp

        from parity.jax_ling3.backward import make_mtp_backward_jit
        from parity.jax_ling3.spec import dtype_of
        from parity.jax_ling3.weights import to_hf_layout

        i = self.cfg.num_hidden_layers + j
        dt = dtype_of(self.dtype)
        fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
        de, dh, dp, dpr = make_mtp_backward_jit(self._mtp_pure_fn())(
            self.params[("mtp", j)], jnp.asarray(embedded, dt), jnp.asarray(hidden, dt),
            jnp.asarray(positions, jnp.int32), jnp.asarray(cotangent, dt), fi, spec=self.spec(i))
        grads = {f"{n}.weight": np.asarray(dp[n]) for n in ("enorm", "hnorm", "final_layernorm")}
        grads["eh_proj.weight"] = np.ascontiguousarray(np.asarray(dp["eh_proj"]).T)  # [2D, D] -> HF [D, 2D]
        grads.update({k: v for k, v in to_hf_layout(self.cfg, i, dp["block"]).items() if k not in self.NOT_TRAINABLE})
        points = {k: np.asarray(v) for k, v in dpr.items()}
        points["embed"] = np.asarray(de)
        return BackwardResult(np.asarray(dh), grads, points)

    def _mtp_pure_fn(self):
        """The un-jitted MTP layer function (`mtp.mtp_layer`'s signature, with `probes`) the MTP backward
        differentiates (a subclass may swap it, e.g. a planted bug in a test)."""
        from parity.jax_ling3.mtp import mtp_layer

        return mtp_layer

    def _layer_fn(self):
        """The jitted layer function `layer_forward` calls (a subclass may swap it, e.g. `mutants.MutantTarget`)."""
        from parity.jax_ling3.layer import decoder_layer_jit

        return decoder_layer_jit

    def submodule(self, i: int, site: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray] | None = None
                  ) -> np.ndarray | None:
        """One site of layer i from its dumped inputs (protocol: `Target.submodule`), by the same `jax_ling3`
        functions the layer uses; one jitted function per (site, spec, shapes)."""
        import jax.numpy as jnp

        spec = self.spec(i)
        if (spec.kind, site) not in ISOLATED_SITES and ("*", site) not in ISOLATED_SITES:
            return None
        arrs = {k: jnp.asarray(v) for k, v in inputs.items()}  # the dump's own dtypes: what the module was fed
        st = None if state is None else {k: jnp.asarray(v) for k, v in state.items()}
        return np.asarray(self._isolated_fn()(self.params[i], arrs, st, site=site, spec=spec))

    def _isolated_fn(self):
        """The jitted site function `submodule` calls (a subclass may swap it, e.g. `mutants.MutantTarget`)."""
        return _isolated_jit

    def submodule_backward(self, i: int, site: str, inputs: dict[str, np.ndarray], cotangent: np.ndarray
                           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """Isolated backward (protocol: `Target.submodule_backward`, issue 33): `jax.vjp` of the very site function
        `submodule` runs (`ISOLATED_SITES`), at prefill, at the dumped `inputs`, fed the dumped `cotangent` of the
        site's output. Returns ({float input site: its cotangent}, {HF name relative to the layer: gradient}) — the
        trainable parameters the site reads (`_leaves_read`; the caller keeps the site's own)."""
        import jax.numpy as jnp

        from parity.jax_ling3.weights import to_hf_layout

        spec = self.spec(i)
        if (spec.kind, site) not in ISOLATED_SITES and ("*", site) not in ISOLATED_SITES:
            return None
        arrs = {k: jnp.asarray(v) for k, v in inputs.items()}
        dx, dp = self._isolated_vjp_fn()(self.params[i], arrs, jnp.asarray(cotangent), site=site, spec=spec)
        grads = {k: v for k, v in to_hf_layout(self.cfg, i, dp).items() if k not in self.NOT_TRAINABLE}
        return {k: np.asarray(v) for k, v in dx.items()}, grads

    def _isolated_vjp_fn(self):
        """The jitted site VJP `submodule_backward` calls (a subclass may swap it, as `_isolated_fn`)."""
        return _isolated_vjp_jit


# ------------------------------------------------------------------------------------------------ isolated sites
# Each function computes one site from the dumped tensors it is fed (`x`, keyed by site name), with the layer's
# converted params `p` and, on decode steps, the dumped state of earlier steps (`st`). They reuse the `jax_ling3`
# pure functions, so the isolated replay measures exactly the code the layer replay runs.
def _kda_conv(name: str):
    def f(p, x, st, spec):
        from parity.jax_ling3.kda import short_conv

        cache = None if st is None else st["attention.conv_state"]["qkv".index(name)]  # fla: last W inputs (§3.11)
        return short_conv(x[f"attention.{name}_proj"], p["attention"][f"{name}_conv1d"], cache)[0]
    return f


def _kda_conv_state(p, x, st, spec):
    import jax.numpy as jnp

    from parity.jax_ling3.kda import short_conv

    out = []
    for j, name in enumerate("qkv"):
        cache = None if st is None else st["attention.conv_state"][j]
        out.append(short_conv(x[f"attention.{name}_proj"], p["attention"][f"{name}_conv1d"], cache)[1])
    return jnp.stack(out)


def _kda_kernel(p, x, st, spec):
    """(core, state) from dumped conv outputs, gate, beta (facts §3.3, §3.6); kernel as the official code picks it:
    recurrent for T <= 64, chunked beyond (§3.10), unless the spec forces one."""
    from parity.jax_ling3.kda import CHUNK, KERNELS, chunk_options
    from parity.jax_ling3.norms import l2_normalize

    m = spec.model
    H, d = m.num_heads, m.kda_head_dim
    q, k, v = (x[f"attention.{n}_conv1d"] for n in "qkv")
    B, T = q.shape[:2]
    q, k, v = (t.reshape(B, T, H, d) for t in (q, k, v))
    mode = spec.kda_mode if spec.kda_mode != "auto" else ("recurrent" if T <= CHUNK else "chunked")
    S0 = None if st is None else st["attention.state"]
    o, S = KERNELS[mode](l2_normalize(q), l2_normalize(k), v, x["attention.gate"], x["attention.beta"], d ** -0.5,
                         S0, **chunk_options(mode, spec))
    return o.astype(q.dtype), S  # kernel output cast back to the q dtype (facts §8)


def _kda_o_norm(p, x, st, spec):
    from parity.jax_ling3.norms import gated_rms_norm

    core = x["attention.core"]
    gp = x["attention.g_proj"].reshape(core.shape)  # [B,T,P] -> [B,T,H,d] (facts §3.7: per head)
    return gated_rms_norm(core, gp, p["attention"]["o_norm"], spec.model.eps)


def _mla_core(p, x, st, spec):
    """MLA attention output from the dumped q and K/V of every token so far (keys at positions 0..S-1, queries at
    `positions`), in the form the target runs: naive causal (facts §4.2–4.4) over the dumped expanded K/V at prefill
    (and at decode with `mla_absorbed=False`); at decode with `mla_absorbed` (the default) the absorbed form over the
    latent cache, `_mla_core_absorbed`."""
    import jax.numpy as jnp

    from parity.jax_ling3.mla import _naive
    from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin

    m = spec.model
    H, n, r, vd, c = m.num_heads, m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank
    q = x["attention.q_proj"] if m.q_lora_rank is None else x["attention.q_b_proj"]
    kv, kv_a = x["attention.kv_b_proj"], x["attention.kv_a_proj_with_mqa"]
    if st is not None:
        kv = jnp.concatenate([st["attention.kv_b_proj"].astype(kv.dtype), kv], axis=1)
        kv_a = jnp.concatenate([st["attention.kv_a_proj_with_mqa"].astype(kv_a.dtype), kv_a], axis=1)
    B, T = q.shape[:2]
    S = kv.shape[1]
    dt = q.dtype
    q = q.reshape(B, T, H, n + r)
    if st is not None and spec.mla_absorbed:  # decode as the target runs it: absorbed, over the latent cache
        return _mla_core_absorbed(p, x, st, spec, q, kv_a)
    qpos = jnp.broadcast_to(x["positions"], (B, T))
    kpos = jnp.broadcast_to(jnp.arange(S), (B, S))
    cq, sq = cos_sin(qpos, r, m.rope_theta, dt)
    ck, sk = cos_sin(kpos, r, m.rope_theta, dt)
    q_rope = apply_rope_interleaved(q[..., n:], cq, sq)
    k_rope = apply_rope_interleaved(kv_a[..., None, c:], ck, sk)[..., 0, :]
    kvh = kv.reshape(B, S, H, n + vd)
    allowed = jnp.arange(S)[None, :] <= (S - T + jnp.arange(T))[:, None]  # the T new tokens are the last T keys
    core = _naive(q[..., :n], q_rope, kvh[..., :n], kvh[..., n:], k_rope, allowed, m.attn_scale, dt)
    return core.reshape(B, T, H * vd)


def _mla_core_absorbed(p, x, st, spec, q, kv_a):
    """Decode step in the absorbed form (facts §4.5), as `mla.mla_attention` runs it over its latent cache: the cache
    is the dumped normalised latents (kv_a_layernorm) and RoPE'd k_rope (kv_a_proj_with_mqa[..., c:]) of every token
    so far; W_UK / W_UV from kv_b_proj."""
    import jax.numpy as jnp

    from parity.jax_ling3.mla import _absorbed
    from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin

    m = spec.model
    H, n, r, vd, c = m.num_heads, m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank
    dt = q.dtype
    c_kv = jnp.concatenate([st["attention.kv_a_layernorm"].astype(dt), x["attention.kv_a_layernorm"].astype(dt)],
                           axis=1)
    B, T = q.shape[:2]
    S = c_kv.shape[1]
    qpos = jnp.broadcast_to(x["positions"], (B, T))
    kpos = jnp.broadcast_to(jnp.arange(S), (B, S))
    cq, sq = cos_sin(qpos, r, m.rope_theta, dt)
    ck, sk = cos_sin(kpos, r, m.rope_theta, dt)
    q_rope = apply_rope_interleaved(q[..., n:], cq, sq)
    k_rope = apply_rope_interleaved(kv_a[..., None, c:], ck, sk)[..., 0, :]
    w_kv = p["attention"]["kv_b_proj"].reshape(c, H, n + vd)
    allowed = jnp.arange(S)[None, :] <= (S - T + jnp.arange(T))[:, None]  # the T new tokens are the last T keys
    core = _absorbed(q[..., :n], q_rope, c_kv, k_rope, w_kv[..., :n], w_kv[..., n:], allowed, m.attn_scale, dt)
    return core.reshape(B, T, H * vd)


def _dense_in(p, x, st, spec):
    core, gate = x["attention.core"], x["attention.gate"]
    B, T, HV = core.shape
    H = gate.shape[-1]
    return (core.reshape(B, T, H, HV // H) * gate[..., None]).reshape(B, T, HV)  # head gate before dense (§4.6)


def _lin(src: str, w: str, group: str = "attention"):
    """linear(x[src] with its leading [B,T] kept and the rest flattened, p[group][w])."""
    def f(p, x, st, spec):
        from parity.jax_ling3.ops import linear

        a = x[src]
        return linear(a.reshape(*a.shape[:2], -1), p[group][w])  # KDA o_norm [B,T,H,d] -> [B,T,P]
    return f


def _norm(src: str, w: str, mla: bool = False):
    """RMSNorm of x[src]: layer norms with rms_norm_eps (facts §6); MLA q_a/kv_a norms with their class-default eps
    (facts §4.2), kv_a_layernorm on the latent part [:c] of kv_a_proj_with_mqa."""
    def f(p, x, st, spec):
        from parity.jax_ling3.mla import MLA_NORM_EPS
        from parity.jax_ling3.norms import rms_norm

        if not mla:
            return rms_norm(x[src], p[w], spec.model.eps)
        a = x[src][..., :spec.model.kv_lora_rank] if w == "kv_a_layernorm" else x[src]
        return rms_norm(a, p["attention"][w], MLA_NORM_EPS)
    return f


def _post_norm(p, x, st, spec):
    from parity.jax_ling3.norms import rms_norm

    h = x["input"] + x["attention"]  # residual stream in the model dtype (facts §8)
    return rms_norm(h, p["post_attention_layernorm"], spec.model.eps)


def _output(p, x, st, spec):
    return (x["input"] + x["attention"]) + x["mlp"]


def _down(p, x, st, spec):
    from parity.jax_ling3.moe import swiglu
    from parity.jax_ling3.ops import linear

    # dense layers never clamp (facts §5.7)
    return linear(swiglu(x["mlp.gate_proj"], x["mlp.up_proj"], None), p["mlp"]["down_proj"])


def _router_logits(p, x, st, spec):
    from parity.jax_ling3.moe import router_logits

    return router_logits(x["post_attention_layernorm"], p["mlp"]["router"])


def _topk_idx(p, x, st, spec):
    import jax.numpy as jnp

    from parity.jax_ling3.moe import select_experts

    idx = select_experts(x["mlp.gate.logits"].astype(jnp.float32), p["mlp"]["expert_bias"], spec.model)
    return jnp.sort(idx, axis=-1)  # canonical order: ascending expert id (parity.model.points)


def _topk_weight(p, x, st, spec):
    import jax.numpy as jnp

    from parity.jax_ling3.moe import routing_weights

    return routing_weights(x["mlp.gate.logits"].astype(jnp.float32), x["mlp.gate.topk_idx"].astype(jnp.int32),
                           spec.model)


def _routed(p, x, st, spec):
    from parity.jax_ling3.moe import routed_experts

    h = x["post_attention_layernorm"]
    B, T, D = h.shape
    idx, w = x["mlp.gate.topk_idx"], x["mlp.gate.topk_weight"]
    k = idx.shape[-1]
    y = routed_experts(p["mlp"], h.reshape(B * T, D), idx.reshape(B * T, k).astype("int32"), w.reshape(B * T, k),
                       spec.routed_limit)
    return y.reshape(B, T, D)


def _shared(p, x, st, spec):
    from parity.jax_ling3.moe import dense_mlp

    sp = {k: p["mlp"][f"shared_{k}"] for k in ("gate_proj", "up_proj", "down_proj")}
    return dense_mlp(sp, x["post_attention_layernorm"], spec.shared_limit)[0]


def _moe_sum(p, x, st, spec):
    return x["mlp.routed"] + x["mlp.shared_experts"] if spec.model.has_shared else x["mlp.routed"]


def _beta(p, x, st, spec):
    import jax
    import jax.numpy as jnp

    return jax.nn.sigmoid(x["attention.b_proj"].astype(jnp.float32))  # fp32 (facts §3.4)


def _gate(p, x, st, spec):
    from parity.jax_ling3.kda import kda_gate

    a = x["attention.f_proj"]
    B, T = a.shape[:2]
    H, d = spec.model.num_heads, spec.model.kda_head_dim
    return kda_gate(a.reshape(B, T, H, d), p["attention"]["A_log"], p["attention"]["dt_bias"],
                    spec.model.lower_bound)  # fp32 (facts §3.5)


def _mla_gate(p, x, st, spec):
    import jax
    import jax.numpy as jnp

    gp = x["attention.g_proj"]
    return jax.nn.sigmoid(gp.astype(jnp.float32)).astype(gp.dtype)  # fp32 then cast (facts §4.6)


# (layer kind | "*", site) -> fn(p, x, st, spec). Sites with no computation of their own (`input`; `attention`, which
# *is* the o_proj/dense output; a dense layer's `mlp`, which is `mlp.down_proj`) are absent: see `Site.alias` in parity.model.points.
ISOLATED_SITES = {
    ("*", "input_layernorm"): _norm("input", "input_layernorm"),
    **{("kda", f"attention.{n}"): _lin("input_layernorm", n) for n in
       ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj")},
    **{("kda", f"attention.{n}_conv1d"): _kda_conv(n) for n in "qkv"},
    ("kda", "attention.conv_state"): _kda_conv_state,
    ("kda", "attention.gate"): _gate,
    ("kda", "attention.beta"): _beta,
    ("kda", "attention.core"): lambda p, x, st, spec: _kda_kernel(p, x, st, spec)[0],
    # the state update reads no q (facts §3.6), so the site graph feeds none: k stands in for the kernel's q argument
    ("kda", "attention.state"): lambda p, x, st, spec: _kda_kernel(p, {**x, "attention.q_conv1d": x["attention.k_conv1d"]},
                                                                   st, spec)[1],
    ("kda", "attention.o_norm"): _kda_o_norm,
    ("kda", "attention.o_proj"): _lin("attention.o_norm", "o_proj"),
    **{("mla", f"attention.{n}"): _lin("input_layernorm", n) for n in
       ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "g_proj")},
    ("mla", "attention.q_a_layernorm"): _norm("attention.q_a_proj", "q_a_layernorm", mla=True),
    ("mla", "attention.q_b_proj"): _lin("attention.q_a_layernorm", "q_b_proj"),
    ("mla", "attention.kv_a_layernorm"): _norm("attention.kv_a_proj_with_mqa", "kv_a_layernorm", mla=True),
    ("mla", "attention.kv_b_proj"): _lin("attention.kv_a_layernorm", "kv_b_proj"),
    ("mla", "attention.core"): _mla_core,
    ("mla", "attention.gate"): _mla_gate,
    ("mla", "attention.dense:in"): _dense_in,
    ("mla", "attention.dense"): _lin("attention.dense:in", "dense"),
    ("*", "post_attention_layernorm"): _post_norm,
    ("*", "mlp.gate_proj"): _lin("post_attention_layernorm", "gate_proj", "mlp"),
    ("*", "mlp.up_proj"): _lin("post_attention_layernorm", "up_proj", "mlp"),
    ("*", "mlp.down_proj"): _down,
    ("*", "mlp.gate.logits"): _router_logits,
    ("*", "mlp.gate.topk_idx"): _topk_idx,
    ("*", "mlp.gate.topk_weight"): _topk_weight,
    ("*", "mlp.routed"): _routed,
    ("*", "mlp.shared_experts"): _shared,
    ("*", "mlp"): _moe_sum,  # only asked for MoE layers (a dense layer's `mlp` is an alias)
    ("*", "output"): _output,
}


def _isolated(p, x, st, site, spec):
    fn = ISOLATED_SITES.get((spec.kind, site)) or ISOLATED_SITES[("*", site)]
    return fn(p, x, st, spec)


def _isolated_vjp(p, x, ct, site, spec):
    """(dx, dp): the VJP of site `site`'s function (`_isolated`, prefill: no state) at params p and inputs x, fed the
    cotangent ct of its output. dx holds the floating inputs only: integer inputs (top-k ids, positions) select,
    they are not differentiated (as the layer's backward forces routing). dp has p's structure, None at every
    weight the site does not read (`_leaves_read`)."""
    import jax
    import jax.numpy as jnp

    fixed = {k: v for k, v in x.items() if not jnp.issubdtype(v.dtype, jnp.floating)}
    floats = {k: v for k, v in x.items() if k not in fixed}
    leaves, tree = jax.tree.flatten(p)
    read = _leaves_read(lambda ls: _isolated(tree.unflatten(ls), x, None, site, spec), leaves)

    def site_fn(read_leaves, xf):
        full = list(leaves)
        for j, leaf in zip(read, read_leaves):
            full[j] = leaf
        return _isolated(tree.unflatten(full), {**fixed, **xf}, None, site, spec)

    out, vjp = jax.vjp(site_fn, [leaves[j] for j in read], floats)
    d_read, dx = vjp(ct.astype(out.dtype))  # the cotangent in the output's dtype, as torch's autograd hands it on
    d_leaves = [None] * len(leaves)
    for j, g in zip(read, d_read):
        d_leaves[j] = g
    return dx, tree.unflatten(d_leaves)


def _leaves_read(fn, leaves: list) -> list[int]:
    """Indices of the leaves `fn(leaves)` reads (its jaxpr's inputs that some equation or output uses). A site
    reads a few of its layer's weights: differentiating only those keeps the VJP from materialising a zero
    gradient for every other weight (the expert stacks included), which was most of an isolated VJP's compile and
    run time (issue 35)."""
    import jax

    closed = jax.make_jaxpr(fn)([jax.ShapeDtypeStruct(l.shape, l.dtype) for l in leaves])
    used = {id(v) for e in closed.jaxpr.eqns for v in e.invars} | {id(v) for v in closed.jaxpr.outvars}
    return [j for j, v in enumerate(closed.jaxpr.invars) if id(v) in used]


def _make_isolated_jit(fn=None):
    import jax

    from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

    return jax.jit(fn or _isolated, static_argnames=("site", "spec"), compiler_options=REFERENCE_COMPILER_OPTIONS)


class _LazyJit:
    """jax imported on first use, as everywhere in this module (the target must import without jax)."""

    def __init__(self, fn=None) -> None:
        self.base, self.fn = fn, None

    def __call__(self, *a, **kw):
        if self.fn is None:
            self.fn = _make_isolated_jit(self.base)
        return self.fn(*a, **kw)


_isolated_jit = _LazyJit()
_isolated_vjp_jit = _LazyJit(_isolated_vjp)
