"""Mutation self-test of the replay: a catalogue of realistic porting bugs injected into the reference target.

Each `Mutation` models one mistake a JAX port of Ling3 really makes (the doc says which), and states — from the bug's
semantics and the checkpoint config alone, never from the tool's output — the point where the error must *start*:
`expected(cfg) -> Expected(phase, step, layer, sites)`. `tests/test_mutations.py` replays every mutant against a dump
and asserts the report fails with `first_divergence.source` at exactly that (phase, step, layer, site).

How bugs are injected (the reference code in `parity/jax_ling3/` is never edited):
- numerics bugs replace a module attribute that the reference looks up at trace time (e.g. `kda.kda_gate`,
  `moe.routing_weights`, `layer.kda_attention`). Where the bug sits inline in a function body (β's sigmoid, the KDA
  kernel call), that function is *cloned with some globals rebound* (`_rebind`): the same code object, run against
  a namespace where e.g. `jax.nn.sigmoid` is the identity — only that function's body sees the change.
- patches are active only while `MutantTarget`'s own jitted layer function is being **traced**. Why this is robust
  against jit caching: the reference's module-level `decoder_layer_jit` is never called here (its traces stay clean,
  and nothing patched leaks into them); every `MutantTarget` instance jits a *fresh closure* (a new function object,
  so no trace cache entry of another instance or of the reference can be reused), and that closure installs the
  patches around the call to `layer.decoder_layer`, which is exactly when the jaxpr is built. Compiled executables are
  then cached per instance and per shape as usual; the persistent compile cache is keyed on the HLO, so it can only
  return an executable of the same (mutated) computation. Patching module globals is not thread-safe: do not run a
  mutant and the reference concurrently in one process (pytest-xdist uses processes, which is fine).
- weight-layout bugs (a square weight not transposed, the MTP layer loaded as the last layer) mutate `load_layer`.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from parity.targets.reference import ReferenceTarget


@dataclass(frozen=True)
class Expected:
    """Where the bug's error starts: phase/step/layer and the site(s) allowed as `first_divergence.source`."""

    phase: str
    step: int
    layer: int
    sites: tuple[str, ...]


@dataclass(frozen=True)
class Mutation:
    name: str
    doc: str  # the real porting mistake this models
    preset: str  # which bundled checkpoint shows it ("tiny" | "tiny-flash")
    expected: Callable[[Any], Expected]  # Ling3Config -> Expected, from the bug's semantics
    patches: Callable[[], dict] = field(default=lambda: {})  # {(module, attr): replacement} for the trace
    load: Callable[["MutantTarget", int, dict], None] | None = None  # weight-layout bugs: mutate params after load
    needs_decode: bool = False
    # isolated mode: {(layer kind | "*", site): fn} replacing entries of reference.ISOLATED_SITES where the bug sits in
    # code the isolated site function does not share with the layer (e.g. beta's sigmoid, written inline in both)
    isolated: Callable[[], dict] = field(default=lambda: {})
    cls: str = "porting"  # "porting" | "precision" (precision placement) | "sub-tolerance" (numerics below the tier)
    # backward-only bugs outside the layer function: a replacement of the embedding's VJP,
    # fn(emb [V,D], ids [B,T], d_embed [B,T,D], pad_id) -> grad [V,D] (`MutantTarget.embed_backward` calls it)
    embed_backward: Callable | None = None


# ------------------------------------------------------------------------------------------------ helpers
def _mods():
    from parity.jax_ling3 import kda, layer, mla, moe

    return kda, layer, mla, moe


def _rebind(fn, **overrides):
    """A copy of `fn` whose *own* body sees `overrides` instead of its module globals (callees keep theirs)."""
    g = dict(fn.__globals__)
    g.update(overrides)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


class _JaxProxy:
    """Stands in for the `jax` module inside one rebound function: everything is jax's, except `jax.nn.<name>`
    overrides."""

    def __init__(self, **nn_overrides):
        import jax

        self._jax = jax
        self.nn = types.SimpleNamespace(**{k: getattr(jax.nn, k) for k in dir(jax.nn) if not k.startswith("_")})
        for k, v in nn_overrides.items():
            setattr(self.nn, k, v)

    def __getattr__(self, name):
        return getattr(self._jax, name)


@contextlib.contextmanager
def patched(patches: dict):
    """Install {(module, attr): value} and restore the originals on exit (also on error)."""
    saved = [(mod, attr, getattr(mod, attr)) for (mod, attr) in patches]
    try:
        for (mod, attr), value in patches.items():
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def _first(cfg, pred) -> int:
    for i in range(cfg.num_hidden_layers):
        if pred(i):
            return i
    raise ValueError("no layer of the required kind in this config")


def first_kda(cfg) -> int:
    return _first(cfg, lambda i: cfg.layer_kind(i) == "kda")


def first_mla(cfg) -> int:
    return _first(cfg, lambda i: cfg.layer_kind(i) == "mla")


def first_moe(cfg) -> int:
    return _first(cfg, cfg.is_moe)


# ------------------------------------------------------------------------------------------------ the bugs
def _p_rope_not_interleaved():
    import jax.numpy as jnp

    _, _, mla, _ = _mods()

    def rope_halves(x, cos, sin):  # plain NeoX rotate-half on the raw layout: skips the de-interleave of facts §4.3
        c, s = cos[..., None, :], sin[..., None, :]
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    return {(mla, "apply_rope_interleaved"): rope_halves}


def _p_gate_softplus_in_decode():
    kda, *_ = _mods()
    orig = kda.kda_gate

    def gate(a, A_log, dt_bias, lower_bound):  # decode kernel (T == 1) uses fla's default softplus gate
        return orig(a, A_log, dt_bias, None if a.shape[1] == 1 else lower_bound)

    return {(kda, "kda_gate"): gate}


def _p_a_log_not_exp():
    import jax
    import jax.numpy as jnp

    kda, *_ = _mods()

    def gate(a, A_log, dt_bias, lower_bound):  # rate = A_log instead of exp(A_log) (facts §3.5)
        H, d = a.shape[-2], a.shape[-1]
        x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, d)
        rate = A_log.astype(jnp.float32).reshape(H, 1)
        if lower_bound is None:
            return -rate * jax.nn.softplus(x)
        return lower_bound * jax.nn.sigmoid(rate * x)

    return {(kda, "kda_gate"): gate}


def _p_beta_not_sigmoided():
    kda, layer, _, _ = _mods()
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, jax=_JaxProxy(sigmoid=lambda x: x))}


def _p_conv_without_silu():
    import jax.numpy as jnp

    kda, *_ = _mods()
    orig = kda.short_conv

    def conv(x, w, cache=None):  # depthwise conv only; the fused kernel's SiLU forgotten (facts §3.2)
        silu_y, new_cache = orig(x, w, cache)
        B, T, P = x.shape
        W = w.shape[-1]
        hist = jnp.zeros((B, P, W), x.dtype) if cache is None else cache.astype(x.dtype)
        full = jnp.concatenate([hist, jnp.swapaxes(x, 1, 2)], axis=-1).astype(jnp.float32)
        y = sum(w.astype(jnp.float32)[None, :, j, None] * full[:, :, 1 + j: 1 + j + T] for j in range(W))
        return jnp.swapaxes(y.astype(x.dtype), 1, 2), new_cache

    return {(kda, "short_conv"): conv}


def _p_conv_cache_dropped():
    kda, *_ = _mods()
    orig = kda.short_conv

    def conv(x, w, cache=None):  # decode step run with zero conv history (cache not threaded through)
        return orig(x, w, None)

    return {(kda, "short_conv"): conv}


def _p_l2norm_missing():
    import jax.numpy as jnp

    kda, *_ = _mods()
    # use_qk_l2norm_in_kernel=True dropped: q, k go to the recurrence un-normalised (facts §3.3)
    return {(kda, "l2_normalize"): lambda x, eps=1e-6: x.astype(jnp.float32)}


def _p_kda_scale_missing():
    kda, layer, _, _ = _mods()
    kernels = {k: (lambda f: lambda q, k, v, g, beta, scale, s0=None, **kw: f(q, k, v, g, beta, 1.0, s0, **kw))(f)
               for k, f in kda.KERNELS.items()}  # q not scaled by d^-1/2 (facts §3.6)
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, KERNELS=kernels)}


def _p_o_norm_eps():
    kda, *_ = _mods()
    orig = kda.gated_rms_norm

    def gnorm(o, gate, w, eps):  # FusedRMSNormGated's own default eps 1e-5 instead of config rms_norm_eps 1e-6
        return orig(o, gate, w, 1e-5)

    return {(kda, "gated_rms_norm"): gnorm}


def _mla_wrapper(post):
    _, layer, mla, _ = _mods()
    orig = mla.mla_attention

    def wrapped(p, x, positions, spec, cache=None):
        out, pts, new_cache = orig(p, x, positions, spec, cache)
        out, pts = post(p, pts, x)
        return out, pts, new_cache

    return {(layer, "mla_attention"): wrapped}


def _p_mla_gate_missing():
    from parity.jax_ling3.ops import linear

    def post(p, pts, x):  # head gate dropped: dense(core)
        core = pts["attention.core"]
        pts = {k: v for k, v in pts.items() if k not in ("attention.gate", "attention.g_proj")}
        pts["attention.dense:in"] = core
        pts["attention.dense"] = out = linear(core, p["dense"])
        return out, pts

    return _mla_wrapper(post)


def _p_mla_gate_after_dense():
    from parity.jax_ling3.ops import linear

    def post(p, pts, x):  # gate applied to dense(core), per head-sized slice of the hidden state
        core, gate = pts["attention.core"], pts["attention.gate"]
        y = linear(core, p["dense"])
        B, T, D = y.shape
        H = gate.shape[-1]
        out = (y.reshape(B, T, H, D // H) * gate[..., None]).reshape(B, T, D)
        pts = dict(pts)
        pts["attention.dense:in"] = core
        pts["attention.dense"] = out
        return out, pts

    return _mla_wrapper(post)


def _p_mla_gate_no_sigmoid():
    _, layer, mla, _ = _mods()
    return {(layer, "mla_attention"): _rebind(mla.mla_attention, jax=_JaxProxy(sigmoid=lambda x: x))}


def _p_mla_decode_position_zero():
    import jax.numpy as jnp

    _, layer, mla, _ = _mods()
    orig = mla.mla_attention

    def wrapped(p, x, positions, spec, cache=None):  # decode without explicit positions: RoPE at 0 (ORC trap)
        if x.shape[1] == 1:
            positions = jnp.zeros_like(positions)
        return orig(p, x, positions, spec, cache)

    return {(layer, "mla_attention"): wrapped}


def _p_expert_bias_in_weights():
    import jax
    import jax.numpy as jnp

    *_, moe = _mods()

    def route(x, w_router, bias, m, forced_idx=None):  # weights from the *biased* scores (facts §5.4: unbiased)
        logits = moe.router_logits(x, w_router)
        idx = moe.select_experts(logits, bias, m) if forced_idx is None else jnp.asarray(forced_idx).astype(jnp.int32)
        w = jnp.take_along_axis(jax.nn.sigmoid(logits) + bias.astype(jnp.float32), idx, axis=-1)
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return logits, idx, w * m.routed_scaling

    return {(moe, "route"): route}


def _p_routed_scaling_twice():
    *_, moe = _mods()
    orig = moe.routing_weights
    return {(moe, "routing_weights"): lambda logits, idx, m: orig(logits, idx, m) * m.routed_scaling}


def _p_no_topk_renorm():
    import jax
    import jax.numpy as jnp

    *_, moe = _mods()

    def weights(logits, idx, m):  # norm_topk_prob ignored the other way round: no renormalisation
        return jnp.take_along_axis(jax.nn.sigmoid(logits), idx, axis=-1) * m.routed_scaling

    return {(moe, "routing_weights"): weights}


def _p_no_group_limit():
    import jax
    import jax.numpy as jnp

    *_, moe = _mods()

    def select(logits, bias, m):  # plain top-k over all experts: n_group/topk_group ignored (facts §5.3)
        return jax.lax.top_k(jax.nn.sigmoid(logits) + bias.astype(jnp.float32), m.top_k)[1].astype(jnp.int32)

    return {(moe, "select_experts"): select}


def _p_router_bf16():
    import jax.numpy as jnp

    from parity.jax_ling3.ops import dot_f32

    *_, moe = _mods()

    def logits(x, w):  # router GEMM in bf16 (weights cast to the model dtype), bf16 logits upcast afterwards
        bf = jnp.bfloat16
        return dot_f32("...d,de->...e", x.astype(bf), w.astype(bf)).astype(bf).astype(jnp.float32)

    return {(moe, "router_logits"): logits}


def _p_shared_scaled():
    _, layer, _, moe = _mods()
    orig = moe.moe_block

    def block(p, x, spec, forced_idx=None):  # routed_scaling_factor applied to the shared expert as well
        y, pts = orig(p, x, spec, forced_idx)
        if "mlp.shared_experts" in pts:
            sh = (pts["mlp.shared_experts"].astype("float32") * spec.model.routed_scaling).astype(x.dtype)
            pts = dict(pts, **{"mlp.shared_experts": sh})
            y = pts["mlp.routed"] + sh
        return y, pts

    return {(layer, "moe_block"): block}  # layer.py imported the name: patch where it is looked up


def _p_clamp_missing():
    *_, moe = _mods()
    orig = moe.swiglu
    return {(moe, "swiglu"): lambda g, u, limit: orig(g, u, None)}  # swiglu_limit config fields not read (§5.7)


# Precision placement (issue 15). Each models a port that *hard-codes* bf16 where the reference computes in fp32 (a
# `dtype=jnp.bfloat16` in a kernel, a Llama norm reused for a norm that runs in fp32): the bug then exists in fp32 runs
# too. A bug that only follows the activation dtype ("computed in x.dtype") is a no-op in an fp32 run and can be seen
# on bf16 dumps alone.
def _rms_norm_bf16_stats(x, w, eps):
    """Llama RMSNorm with the statistics (mean of squares, rsqrt) computed in bf16 instead of fp32 (facts §6)."""
    import jax
    import jax.numpy as jnp

    xb = x.astype(jnp.bfloat16)
    y = xb * jax.lax.rsqrt(jnp.mean(xb * xb, axis=-1, keepdims=True) + jnp.asarray(eps, jnp.bfloat16))
    return w.astype(x.dtype) * y.astype(x.dtype)


def _p_norm_stats_bf16():
    _, layer, _, _ = _mods()
    return {(layer, "rms_norm"): _rms_norm_bf16_stats}  # the decoder layer's own norms (input / post-attention)


def _i_norm_stats_bf16():
    def f(src, w):
        def fn(p, x, st, spec):
            return _rms_norm_bf16_stats(x[src], p[w], spec.model.eps)
        return fn

    def post(p, x, st, spec):
        return _rms_norm_bf16_stats(x["input"] + x["attention"], p["post_attention_layernorm"], spec.model.eps)

    return {("*", "input_layernorm"): f("input", "input_layernorm"), ("*", "post_attention_layernorm"): post}


def _gated_norm_weight_bf16(o, gate, w, eps):
    """KDA output norm as a Llama norm: normalised value cast to bf16, the weight multiply and the gate in bf16
    (facts §3.7: all in fp32, cast once)."""
    import jax
    import jax.numpy as jnp

    bf = jnp.bfloat16
    of = o.astype(jnp.float32)
    y = (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)).astype(bf)
    return ((y * w.astype(bf)) * jax.nn.sigmoid(gate.astype(bf))).astype(o.dtype)


def _p_o_norm_weight_bf16():
    kda, *_ = _mods()
    return {(kda, "gated_rms_norm"): _gated_norm_weight_bf16}


def _i_o_norm_weight_bf16():
    def fn(p, x, st, spec):
        core = x["attention.core"]
        gp = x["attention.g_proj"].reshape(core.shape)
        return _gated_norm_weight_bf16(core, gp, p["attention"]["o_norm"], spec.model.eps)

    return {("kda", "attention.o_norm"): fn}


def _p_gate_bf16():
    import jax
    import jax.numpy as jnp

    kda, *_ = _mods()

    def bf(v):
        # each step rounded to bf16 (round-to-nearest-even, as a bf16 op's result) by reduce_precision, an op XLA
        # keeps under any flags: written as bf16 dtype casts, XLA's default excess precision
        # (xla_allow_excess_precision=true) elided the f32->bf16->f32 round trips and the compiled mutant was the
        # fp32 gate at the tiny-bf16 golden's layer 0 (docs/numerics.md, three-way verdict)
        return jax.lax.reduce_precision(v.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)

    def gate(a, A_log, dt_bias, lower_bound):  # facts §3.5: fp32; here every step in bf16, upcast at the end
        H, d = a.shape[-2], a.shape[-1]
        x = bf(bf(a) + bf(dt_bias).reshape(H, d))
        rate = bf(jnp.exp(bf(A_log))).reshape(H, 1)
        if lower_bound is None:
            return bf(-rate * bf(jax.nn.softplus(x)))
        return bf(bf(jnp.asarray(lower_bound, jnp.float32)) * bf(jax.nn.sigmoid(bf(rate * x))))

    return {(kda, "kda_gate"): gate}


def _beta_bf16(b):
    import jax
    import jax.numpy as jnp

    return jax.nn.sigmoid(b.astype(jnp.bfloat16)).astype(jnp.float32)  # facts §3.4: sigmoid in fp32


def _p_beta_bf16():
    kda, layer, _, _ = _mods()
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, jax=_JaxProxy(sigmoid=_beta_bf16))}


def _i_beta_bf16():
    return {("kda", "attention.beta"): lambda p, x, st, spec: _beta_bf16(x["attention.b_proj"])}


# Sub-tolerance numerics (issue 15): changes whose effect sits at or below the loose tiers' resolution.
# A precision loss in the activation dtype (issue 31): unlike the hard-coded bf16 above, it computes in the dtype the
# tensor arrives in, so an fp32 run is the reference's own (nothing to find on an fp32 dump) and a bf16 run loses
# precision HF keeps — triage across tiers calls it `precision`, the three-way verdict refuses it (less precise than
# the dump against the fp32 shadow).
def _l2_normalize_before_upcast(x, eps: float = 1e-6):
    """fla's l2norm (facts §3.3) — sum of squares, sqrt, division — in the input's dtype (bf16 in a bf16 run), then
    the fp32 upcast the reference (and fla's kernel) does first."""
    import jax.numpy as jnp

    return (x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + jnp.asarray(eps, x.dtype))).astype(jnp.float32)


def _p_l2norm_before_upcast():
    kda, *_ = _mods()
    return {(kda, "l2_normalize"): _l2_normalize_before_upcast}


def _i_l2norm_before_upcast():
    from parity.jax_ling3 import norms
    from parity.targets import reference

    def core(p, x, st, spec):  # the isolated KDA kernel imports l2_normalize from norms at trace time
        with patched({(norms, "l2_normalize"): _l2_normalize_before_upcast}):
            return reference._kda_kernel(p, x, st, spec)[0]

    return {("kda", "attention.core"): core}


def _p_mla_lora_norm_eps():
    _, _, mla, _ = _mods()
    return {(mla, "MLA_NORM_EPS"): 1e-5}  # q_a / kv_a layernorm with 1e-5 instead of the class default 1e-6 (§4.2)


def _p_moe_combine_bf16():
    import jax.numpy as jnp

    from parity.jax_ling3.ops import dot_f32

    *_, moe = _mods()

    def routed(p, x, idx, w, limit):  # Σ_i w_i·Expert_i(x) accumulated slot by slot in bf16 (facts §5.5: fp32, one cast)
        dt, bf = x.dtype, jnp.bfloat16
        g = dot_f32("nd,edi->nei", x, p["experts_gate"].astype(dt)).astype(dt)
        u = dot_f32("nd,edi->nei", x, p["experts_up"].astype(dt)).astype(dt)
        y = dot_f32("nei,eid->ned", moe.swiglu(g, u, limit), p["experts_down"].astype(dt)).astype(dt)  # [N,E,D]
        acc = jnp.zeros((x.shape[0], y.shape[-1]), bf)
        for j in range(idx.shape[-1]):
            yj = jnp.take_along_axis(y, idx[:, j, None, None].astype(jnp.int32), axis=1)[:, 0]  # [N,D]
            acc = (acc + (yj.astype(jnp.float32) * w[:, j, None].astype(jnp.float32)).astype(bf)).astype(bf)
        return acc.astype(dt)

    return {(moe, "routed_experts"): routed}


def _load_square_not_transposed(t: "MutantTarget", i: int, hf: dict) -> None:
    # A converter that forgets `.T` on a [out, in] weight passes every shape check when out == in (KDA q_proj with
    # num_heads·head_dim == hidden_size).
    att = t.params[i]["attention"]
    if t.cfg.layer_kind(i) == "kda" and att["q_proj"].shape[0] == att["q_proj"].shape[1]:
        att["q_proj"] = att["q_proj"].T


def _load_mtp_as_last(t: "MutantTarget", i: int, hf: dict) -> None:
    # A converter that takes the highest `model.layers.N` index as the last decoder layer loads the MTP block
    # (model.layers.{num_hidden_layers}) there; same module kinds, so no shape error.
    last = t.cfg.num_hidden_layers - 1
    if i != last:
        return
    from parity.jax_ling3.weights import CheckpointReader

    if t.ckpt_dir is None:
        raise ValueError("mutation mtp_as_last_layer needs MutantTarget(..., ckpt_dir=...)")
    mtp = f"model.layers.{t.cfg.num_hidden_layers}."
    reader = CheckpointReader(Path(t.ckpt_dir))
    src = {k: v for k, v in reader.key_files.items() if k.startswith(mtp)}
    from safetensors import safe_open

    moved = {}
    for k in hf:
        mk = mtp + k[len(f"model.layers.{last}."):]
        if mk in src:
            with safe_open(str(src[mk]), framework="numpy") as f:
                moved[k] = f.get_tensor(mk)
        else:
            moved[k] = hf[k]
    ReferenceTarget.load_layer(t, i, moved)


def _clamp_expected(cfg) -> Expected:
    i = _first(cfg, lambda j: cfg.is_moe(j) and (cfg.expert_swiglu_limit(j) or cfg.shared_swiglu_limit(j)))
    sites = (("mlp.routed",) if cfg.expert_swiglu_limit(i) else ()) + \
            (("mlp.shared_experts",) if cfg.shared_swiglu_limit(i) else ())
    return Expected("prefill", 0, i, sites)


def _pre(site, where):
    return lambda cfg: Expected("prefill", 0, where(cfg), (site,))


def _dec(site, where):
    return lambda cfg: Expected("decode", 1, where(cfg), (site,))


MUTATIONS: dict[str, Mutation] = {m.name: m for m in [
    Mutation("rope_not_interleaved", "MLA RoPE applied rotate-half on the raw layout, without the de-interleave of "
             "rope_interleave=true; q/k after RoPE are not compared, scores are → attention.core of the first MLA "
             "layer", "tiny", _pre("attention.core", first_mla), _p_rope_not_interleaved),
    Mutation("kda_gate_softplus_in_decode", "KDA decode path uses fla's default softplus gate, prefill the lower-bound "
             "gate → attention.gate of the first KDA layer at decode step 1", "tiny",
             _dec("attention.gate", first_kda), _p_gate_softplus_in_decode, needs_decode=True),
    Mutation("kda_a_log_not_exp", "A_log used as the decay rate instead of exp(A_log) → attention.gate of the first "
             "KDA layer", "tiny", _pre("attention.gate", first_kda), _p_a_log_not_exp),
    Mutation("kda_beta_not_sigmoided", "b_proj output fed to the delta rule as β without the sigmoid → "
             "attention.beta of the first KDA layer", "tiny", _pre("attention.beta", first_kda),
             _p_beta_not_sigmoided),
    Mutation("kda_conv_without_silu", "short conv without the fused SiLU → attention.q_conv1d of the first KDA layer",
             "tiny", _pre("attention.q_conv1d", first_kda), _p_conv_without_silu),
    Mutation("kda_conv_cache_dropped", "decode step run with zero conv history (cache not threaded) → "
             "attention.q_conv1d of the first KDA layer at decode step 1", "tiny",
             _dec("attention.q_conv1d", first_kda), _p_conv_cache_dropped, needs_decode=True),
    Mutation("kda_l2norm_missing", "q/k L2 norm (use_qk_l2norm_in_kernel) dropped; q/k norms are not dumped, the "
             "recurrence output is → attention.core of the first KDA layer", "tiny",
             _pre("attention.core", first_kda), _p_l2norm_missing),
    Mutation("kda_scale_missing", "q not scaled by head_dim^-1/2 in the recurrence → attention.core of the first KDA "
             "layer", "tiny", _pre("attention.core", first_kda), _p_kda_scale_missing),
    Mutation("kda_o_norm_eps", "RMSNorm eps ×10: the gated output norm uses FusedRMSNormGated's default 1e-5 instead "
             "of rms_norm_eps 1e-6 (visible because the KDA core output is small, RMS ~1e-2) → attention.o_norm of the "
             "first KDA layer", "tiny", _pre("attention.o_norm", first_kda), _p_o_norm_eps),
    Mutation("kda_q_proj_not_transposed", "square [out,in] weight (KDA q_proj, H·d == D) loaded without the "
             "transpose → attention.q_proj of the first KDA layer", "tiny", _pre("attention.q_proj", first_kda),
             load=_load_square_not_transposed),
    Mutation("mla_gate_missing", "MLA head gate dropped (core goes straight to dense) → attention.dense:in of the "
             "first MLA layer", "tiny", _pre("attention.dense:in", first_mla), _p_mla_gate_missing),
    Mutation("mla_gate_after_dense", "MLA head gate applied after the output projection (to head-sized slices of the "
             "hidden state) → attention.dense:in of the first MLA layer", "tiny",
             _pre("attention.dense:in", first_mla), _p_mla_gate_after_dense),
    Mutation("mla_gate_no_sigmoid", "raw g_proj used as the head gate, sigmoid forgotten → attention.gate of the first "
             "MLA layer", "tiny", _pre("attention.gate", first_mla), _p_mla_gate_no_sigmoid),
    Mutation("mla_decode_rope_position_zero", "decode without explicit positions: the new token's RoPE at position 0 "
             "→ attention.core of the first MLA layer at decode step 1", "tiny",
             _dec("attention.core", first_mla), _p_mla_decode_position_zero, needs_decode=True),
    Mutation("moe_expert_bias_in_weights", "combine weights from the bias-corrected scores instead of the unbiased "
             "sigmoid → mlp.gate.topk_weight of the first MoE layer", "tiny",
             _pre("mlp.gate.topk_weight", first_moe), _p_expert_bias_in_weights),
    Mutation("moe_routed_scaling_twice", "routed_scaling_factor applied in the router and again in the combine → "
             "mlp.gate.topk_weight of the first MoE layer", "tiny", _pre("mlp.gate.topk_weight", first_moe),
             _p_routed_scaling_twice),
    Mutation("moe_no_topk_renorm", "top-k weights not renormalised → mlp.gate.topk_weight of the first MoE layer",
             "tiny", _pre("mlp.gate.topk_weight", first_moe), _p_no_topk_renorm),
    Mutation("moe_no_group_limit", "group-limited routing ignored (plain top-k over all experts) → "
             "mlp.gate.topk_idx of the first MoE layer", "tiny", _pre("mlp.gate.topk_idx", first_moe),
             _p_no_group_limit),
    Mutation("moe_router_bf16", "router GEMM run in bf16 instead of fp32 → mlp.gate.logits of the first MoE layer",
             "tiny", _pre("mlp.gate.logits", first_moe), _p_router_bf16, cls="precision"),
    Mutation("moe_shared_expert_scaled", "routed_scaling_factor also applied to the shared expert → "
             "mlp.shared_experts of the first MoE layer", "tiny", _pre("mlp.shared_experts", first_moe),
             _p_shared_scaled),
    Mutation("swiglu_clamp_missing", "SwiGLU clamp limits (swiglu_limit lists) not applied → mlp.routed / "
             "mlp.shared_experts of the first clamped layer", "tiny-flash", _clamp_expected, _p_clamp_missing),
    Mutation("norm_stats_bf16", "RMSNorm statistics (mean of squares, rsqrt) computed in bf16 instead of fp32 → "
             "input_layernorm of layer 0", "tiny", _pre("input_layernorm", lambda cfg: 0), _p_norm_stats_bf16,
             isolated=_i_norm_stats_bf16, cls="precision"),
    Mutation("kda_o_norm_weight_bf16", "KDA gated output norm run as a Llama norm: normalised value cast to bf16, the "
             "weight multiply and the sigmoid gate in bf16 (fla: all fp32, one cast) → attention.o_norm of the first "
             "KDA layer", "tiny", _pre("attention.o_norm", first_kda), _p_o_norm_weight_bf16,
             isolated=_i_o_norm_weight_bf16, cls="precision"),
    Mutation("kda_gate_bf16", "KDA decay gate computed in bf16 instead of fp32 → attention.gate of the first KDA layer",
             "tiny", _pre("attention.gate", first_kda), _p_gate_bf16, cls="precision"),
    Mutation("kda_beta_bf16", "KDA beta sigmoid computed in bf16 instead of fp32 → attention.beta of the first KDA "
             "layer", "tiny", _pre("attention.beta", first_kda), _p_beta_bf16, isolated=_i_beta_bf16, cls="precision"),
    Mutation("kda_l2norm_before_upcast", "KDA q/k L2 norm taken in the activation dtype before the fp32 upcast (fla: "
             "upcast first); q/k norms are not dumped, the recurrence output is → attention.core of the first KDA "
             "layer (bf16 runs only)", "tiny", _pre("attention.core", first_kda), _p_l2norm_before_upcast,
             isolated=_i_l2norm_before_upcast, cls="precision"),
    Mutation("mla_lora_norm_eps", "MLA q_a / kv_a LoRA norms with eps 1e-5 instead of their class default 1e-6 → "
             "attention.q_a_layernorm (or kv_a_layernorm) of the first MLA layer", "tiny",
             lambda cfg: Expected("prefill", 0, first_mla(cfg), ("attention.q_a_layernorm", "attention.kv_a_layernorm")),
             _p_mla_lora_norm_eps, cls="sub-tolerance"),
    Mutation("moe_combine_bf16", "routed experts' weighted sum accumulated slot by slot in bf16 (each partial sum "
             "rounded) instead of in fp32 with one cast → mlp.routed of the first MoE layer", "tiny",
             _pre("mlp.routed", first_moe), _p_moe_combine_bf16, cls="sub-tolerance"),
    Mutation("mtp_as_last_layer", "the MTP block (model.layers.{num_hidden_layers}) loaded as the last decoder layer "
             "→ input_layernorm of the last layer (its first weight)", "tiny",
             lambda cfg: Expected("prefill", 0, cfg.num_hidden_layers - 1, ("input_layernorm",)),
             load=_load_mtp_as_last),
]}


# Planted *variants* (issue 25): legitimate implementation choices, not bugs. A replay must report them as status
# `variant` with the variant's name (parity.numerics.variants), passing, and fail them only under
# `--parity-strict-variants`. Kept apart from MUTATIONS (whose every entry must fail).
def _rms_norm_fused_scale(x, w, eps):
    """sglang-jax's RMSNorm (srt/layers/layernorm.py `_normalize`): statistics in fp32 as the reference, but the
    weight folded into the fp32 row scale and one rounding, bf16(x·(r·w)), where facts §6 rounds x·r first."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (r * w.astype(jnp.float32))).astype(x.dtype)


def _rms_norm_single_rounding(x, w, eps):
    """A fused RMSNorm kernel that keeps x·r in fp32 and rounds once after the weight: bf16((x·r)·w)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((xf * r) * w.astype(jnp.float32)).astype(x.dtype)


def _plant_norm(fn):
    """Patches putting `fn` in place of every plain RMSNorm of a decoder layer: the input / post-attention norms
    (layer.py) and the MLA q_a / kv_a LoRA norms (mla.py), as a port with one RMSNorm class has it."""
    def patches():
        _, layer, mla, _ = _mods()
        return {(layer, "rms_norm"): fn, (mla, "rms_norm"): fn}
    return patches


def _i_plant_norm(fn):
    """Isolated mode: the same norm at the layer-norm sites (the MLA norms share mla.rms_norm's patch)."""
    def sites():
        def inp(p, x, st, spec):
            return fn(x["input"], p["input_layernorm"], spec.model.eps)

        def post(p, x, st, spec):
            return fn(x["input"] + x["attention"], p["post_attention_layernorm"], spec.model.eps)

        return {("*", "input_layernorm"): inp, ("*", "post_attention_layernorm"): post}
    return sites


VARIANT_PLANTS: dict[str, Mutation] = {m.name: m for m in [
    Mutation("rmsnorm_fused_scale", "the decoder layers' RMSNorms round once, bf16(x·(r·w)) (sglang-jax's form) → "
             "named variant rmsnorm-single-rounding at input_layernorm (every RMSNorm site fed a dumped input)",
             "tiny", _pre("input_layernorm", lambda cfg: 0), _plant_norm(_rms_norm_fused_scale),
             isolated=_i_plant_norm(_rms_norm_fused_scale), cls="variant"),
    Mutation("rmsnorm_single_rounding", "the decoder layers' RMSNorms round once after the weight, bf16(x·r·w) → "
             "named variant rmsnorm-single-rounding at input_layernorm", "tiny", _pre("input_layernorm", lambda cfg: 0),
             _plant_norm(_rms_norm_single_rounding), isolated=_i_plant_norm(_rms_norm_single_rounding),
             cls="variant"),
]}
# parity.numerics.variants name -> the plant computing it (the replay's variant shadow: a difference downstream of a
# variant point is the variant's own when the reference computing the variant matches the target there)
PLANT_OF_VARIANT = {"rmsnorm-single-rounding": "rmsnorm_fused_scale"}


# ------------------------------------------------------------------------------------------------ dot precision (issue 31)
# TPU runs an fp32 dot written without `precision=` at JAX's default matmul precision: one bf16 pass (each fp32
# operand rounded to bf16, products accumulated in fp32). XLA:CPU ignores the setting (measured: jax 0.10.2, an fp32
# einsum under `jax.default_matmul_precision('bfloat16')` gives the same bits as under 'highest'), so on CPU the pass
# is emulated by rounding the operands. `effective_matmul_precision` is what a port's dots get: the context
# `jax.default_matmul_precision(...)` in force at trace time (the replay sets it per dump, `--parity-matmul-precision`).
ONE_BF16_PASS = (None, "default", "bfloat16", "fastest")  # precisions a TPU runs as one bf16 pass


def effective_matmul_precision() -> str | None:
    """JAX's `jax_default_matmul_precision` in force now (thread-local context or process config), lower-case."""
    import jax

    p = jax.config.jax_default_matmul_precision
    return None if p is None else str(p).lower()


class _BF16PassJnp:
    """Stands in for `jax.numpy` in the reference's modules that hold dots (kda, moe, ops): `einsum` / `matmul`
    round every fp32 operand to bf16 before an fp32-accumulating dot when `rounds()` says so at trace time, and
    ignore the `precision=` the reference passes (they model a port written without one, which the config then
    governs); everything else is jax.numpy's."""

    def __init__(self, rounds: Callable[[], bool]) -> None:
        import jax.numpy as jnp

        self._jnp = jnp
        self._rounds = rounds

    def _operands(self, ops):
        jnp = self._jnp
        if not self._rounds():
            return ops
        return tuple(o.astype(jnp.bfloat16).astype(jnp.float32) if getattr(o, "dtype", None) == jnp.float32 else o
                     for o in ops)

    def einsum(self, subscripts, *operands, precision=None, **kw):
        import jax

        return self._jnp.einsum(subscripts, *self._operands(operands), precision=jax.lax.Precision.HIGHEST, **kw)

    def matmul(self, a, b, *, precision=None, **kw):
        import jax

        a, b = self._operands((a, b))
        return self._jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, **kw)

    def __getattr__(self, name):
        return getattr(self._jnp, name)


def bf16_pass_dot_patches(rounds: Callable[[], bool]) -> dict:
    """{(module, "jnp"): _BF16PassJnp(rounds)} for every reference module whose functions hold a dot (`ops.dot_f32`
    / `matmul_f32` serve mla, the linears and the LM head; kda and moe call einsum / matmul themselves)."""
    from parity.jax_ling3 import kda, moe, ops

    proxy = _BF16PassJnp(rounds)
    return {(kda, "jnp"): proxy, (moe, "jnp"): proxy, (ops, "jnp"): proxy}


def _tpu_default_rounds() -> bool:
    return effective_matmul_precision() in ONE_BF16_PASS


DOT_PRECISION_PLANTS: dict[str, Mutation] = {m.name: m for m in [
    Mutation("tpu_default_dot_precision", "a correct port on TPU at JAX's default matmul precision: every fp32 dot "
             "written without precision= runs one bf16 pass (operands rounded to bf16, fp32 accumulation) unless "
             "jax.default_matmul_precision('high'/'highest') is in force (then exact here) → the first dot with an "
             "fp32 operand: attention.q_proj of layer 0 on an fp32 dump", "tiny",
             _pre("attention.q_proj", lambda cfg: 0), lambda: bf16_pass_dot_patches(_tpu_default_rounds),
             cls="precision"),
    # the dot-precision shadow's configuration (parity.replay.dot_precision): one bf16 pass whatever the policy
    Mutation("dots_one_bf16_pass", "the reference with every fp32 dot operand rounded to bf16 (one bf16 pass), "
             "whatever precision is in force: the dot-precision shadow", "tiny",
             _pre("attention.q_proj", lambda cfg: 0), lambda: bf16_pass_dot_patches(lambda: True), cls="precision"),
]}


# ------------------------------------------------------------------------------------------------ backward-only bugs
# Issue 26: bugs that move no forward bit and train wrong. Each is forward bit-identical *by construction*: the
# replacement is `jax.lax.stop_gradient` (identity in the forward) or a `custom_vjp` identity whose forward returns
# its input unchanged; only the VJP differs. Expected: the backward point where the error starts, in backward
# execution order (parity.reporting.report._backward_rank) — the first failing point whose backward inputs pass.
def _sg(fn):
    import jax

    return lambda *a, **k: jax.lax.stop_gradient(fn(*a, **k))


def _p_bw_kda_beta_detached():
    import jax

    kda, layer, _, _ = _mods()
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, jax=_JaxProxy(sigmoid=_sg(jax.nn.sigmoid)))}


def _p_bw_kda_gate_detached():
    kda, layer, _, _ = _mods()
    # kda_attention looks `kda_gate` up in its module's globals at trace time
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, kda_gate=_sg(kda.kda_gate))}


def _i_bw_kda_gate_detached():
    """Isolated mode: the gate site's own function with the same stop_gradient (the layer's patch rebinds
    `kda_gate` inside `kda_attention`, which the isolated site function does not call)."""
    from parity.targets import reference

    return {("kda", "attention.gate"): _sg(reference.ISOLATED_SITES[("kda", "attention.gate")])}


def _p_bw_router_weight_detached():
    *_, moe = _mods()
    return {(moe, "routing_weights"): _sg(moe.routing_weights)}


def _p_bw_mla_gate_detached():
    import jax

    _, layer, mla, _ = _mods()
    return {(layer, "mla_attention"): _rebind(mla.mla_attention, jax=_JaxProxy(sigmoid=_sg(jax.nn.sigmoid)))}


def _grad_scaled(factor: float):
    """An identity whose VJP multiplies the cotangent by `factor` (jax.custom_vjp): forward returns x itself."""
    import jax

    @jax.custom_vjp
    def ident(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (g * jax.numpy.asarray(factor, g.dtype),)

    ident.defvjp(fwd, bwd)
    return ident


def _p_bw_shared_grad_twice():
    _, layer, _, moe = _mods()
    orig = moe.moe_block
    twice = _grad_scaled(2.0)

    def block(p, x, spec, forced_idx=None):  # shared expert's gradient scaled twice (e.g. a loss-scale applied twice)
        y, pts = orig(p, x, spec, forced_idx)
        if "mlp.shared_experts" not in pts:
            return y, pts
        return pts["mlp.routed"] + twice(pts["mlp.shared_experts"]), pts  # the same add as moe_block's: same bits

    return {(layer, "moe_block"): block}


def _p_bw_attn_residual_detached():
    """`h = stop_gradient(x) + attention(norm(x))`: the attention residual's cotangent dropped, the layer input's
    gradient flows only through input_layernorm. Built without touching the reference: `_decoder_layer` is called
    with the detached input and its own body is cloned with an `rms_norm` that gives the *first* norm (the one
    whose argument is that detached input, identified by object identity at trace time) the live input instead.
    Forward: stop_gradient is the identity and every op sees the same values, so the same bits."""
    import jax

    _, layer, _, _ = _mods()
    orig, norm = layer._decoder_layer, layer.rms_norm

    def mutated(p, h, positions, spec, state, forced_idx):
        hs = jax.lax.stop_gradient(h)

        def rms(x, w, eps):
            return norm(h if x is hs else x, w, eps)

        return _rebind(orig, rms_norm=rms)(p, hs, positions, spec, state, forced_idx)

    return {(layer, "_decoder_layer"): mutated}


def _kda_chunk_with_wrong_vjp(kernel):
    """The chunked KDA kernel behind a hand-written VJP with one wrong term: `jax.custom_vjp` whose forward is the
    kernel itself (same bits) and whose backward is the kernel's true VJP (jax.vjp, recomputed from the saved
    inputs) with the decay gate's cotangent dg negated — models a chunk backward that differentiates the
    log-space decay with the wrong sign (e.g. a kernel storing the decay as the positive rate -g and not flipping
    the sign back in dg); dq, dk, dv, dβ exact."""
    import jax

    def wrapped(q, k, v, g, beta, scale, s0=None, **kw):
        if s0 is not None:  # a continuation (decode) is never differentiated here
            return kernel(q, k, v, g, beta, scale, s0, **kw)

        def f(q_, k_, v_, g_, b_):
            return kernel(q_, k_, v_, g_, b_, scale, None, **kw)

        @jax.custom_vjp
        def chunk(q_, k_, v_, g_, b_):
            return f(q_, k_, v_, g_, b_)

        def fwd(*args):
            return f(*args), args

        def bwd(args, ct):
            dq, dk, dv, dg, db = jax.vjp(f, *args)[1](ct)
            return dq, dk, dv, -dg, db

        chunk.defvjp(fwd, bwd)
        return chunk(q, k, v, g, beta)

    return wrapped


def _p_bw_kda_chunk_vjp_dg_sign():
    kda, layer, _, _ = _mods()
    kernels = {**kda.KERNELS, "chunked": _kda_chunk_with_wrong_vjp(kda.KERNELS["chunked"])}
    return {(layer, "kda_attention"): _rebind(kda.kda_attention, KERNELS=kernels)}


def _embed_backward_set(emb, ids, d_embed, pad_id=None):
    """The embedding's gradient written with a scatter-*set* (`zeros.at[ids].set(d)`) instead of a scatter-add: a
    token id that occurs more than once keeps one occurrence's cotangent instead of their sum (the padding row
    zero as the reference's). Not jitted: called once per replay."""
    import jax.numpy as jnp

    d = jnp.asarray(d_embed).astype(emb.dtype).reshape(-1, emb.shape[-1])
    flat = jnp.asarray(ids).reshape(-1)
    if pad_id is not None:
        d = jnp.where((flat == pad_id)[:, None], jnp.zeros((), d.dtype), d)
    return jnp.zeros_like(emb).at[flat].set(d)


def _bw(site_fn, where):
    return lambda cfg: Expected("backward", 0, where(cfg), site_fn(cfg) if callable(site_fn) else site_fn)


BACKWARD_MUTATIONS: dict[str, Mutation] = {m.name: m for m in [
    Mutation("bw_kda_beta_detached", "stop_gradient on the KDA beta (sigmoid(b_proj) detached): forward bit-identical, "
             "b_proj gets no gradient → backward attention.b_proj of the first KDA layer", "tiny",
             _bw(("attention.b_proj", "grad.attention.b_proj.weight"), first_kda), _p_bw_kda_beta_detached),
    Mutation("bw_kda_gate_detached", "stop_gradient on the KDA decay gate: f_proj, A_log and dt_bias get no gradient "
             "→ backward grad.attention.A_log / dt_bias / attention.f_proj of the first KDA layer", "tiny",
             _bw(("grad.attention.A_log", "grad.attention.dt_bias", "attention.f_proj"), first_kda),
             _p_bw_kda_gate_detached, isolated=_i_bw_kda_gate_detached),
    Mutation("bw_router_weight_detached", "router top-k weights detached (no gradient to the router) → backward "
             "mlp.gate.logits / grad.mlp.gate.weight of the first MoE layer", "tiny",
             _bw(("mlp.gate.logits", "grad.mlp.gate.weight"), first_moe), _p_bw_router_weight_detached),
    Mutation("bw_mla_gate_detached", "MLA head gate's gradient dropped (sigmoid(g_proj) detached) → backward "
             "attention.g_proj / grad.attention.g_proj.weight of the first MLA layer", "tiny",
             _bw(("attention.g_proj", "grad.attention.g_proj.weight"), first_mla), _p_bw_mla_gate_detached),
    Mutation("bw_shared_expert_grad_twice", "shared expert's gradient scaled twice (custom_vjp identity ×2 on its "
             "output) → backward mlp.shared_experts of the first MoE layer", "tiny",
             _bw(("mlp.shared_experts",), first_moe), _p_bw_shared_grad_twice),
    Mutation("bw_attn_residual_detached", "attention residual's cotangent dropped (h = stop_gradient(x) + "
             "attention(norm(x))): the layer input's gradient flows only through input_layernorm → backward input "
             "of layer 0 (every layer's input; a one-layer replay pins the replayed one)", "tiny",
             _bw(("input",), lambda cfg: 0), _p_bw_attn_residual_detached),
    Mutation("bw_kda_chunk_vjp_dg_sign", "custom VJP of the chunked KDA with one wrong term: the decay gate's "
             "cotangent negated (dq, dk, dv, dβ exact) → backward attention.gate of the first KDA layer (prompts > "
             "64 tokens: the chunked kernel)", "tiny", _bw(("attention.gate",), first_kda),
             _p_bw_kda_chunk_vjp_dg_sign),
    Mutation("bw_embed_grad_not_accumulated", "embedding gradient scattered with set instead of add: repeated "
             "token ids keep one occurrence's cotangent → backward model grad.model.word_embeddings.weight", "tiny",
             lambda cfg: Expected("backward", 0, None, ("grad.model.word_embeddings.weight",)),
             embed_backward=_embed_backward_set),
]}


class MutantTarget(ReferenceTarget):
    """The reference target with one catalogue bug injected (see the module doc for how)."""

    def __init__(self, mutation: str, *, ckpt_dir: str | Path | None = None, **kw) -> None:
        super().__init__(**kw)
        known = {**MUTATIONS, **VARIANT_PLANTS, **BACKWARD_MUTATIONS, **DOT_PRECISION_PLANTS}
        if mutation not in known:
            raise ValueError(f"unknown mutation {mutation!r}: expected one of {sorted(known)}")
        self.mutation = known[mutation]
        self.name = f"reference+{mutation}"
        self.ckpt_dir = ckpt_dir
        self._jit = None
        self._iso_jit = None

    def load_layer(self, i: int, hf_tensors: dict[str, np.ndarray]) -> None:
        super().load_layer(i, hf_tensors)
        if self.mutation.load is not None:
            self.mutation.load(self, i, hf_tensors)

    def embed_backward(self, input_ids: np.ndarray, d_embed: np.ndarray) -> np.ndarray:
        if self.mutation.embed_backward is None:
            return super().embed_backward(input_ids, d_embed)
        pad = getattr(self.cfg, "pad_token_id", None)
        return np.asarray(self.mutation.embed_backward(self.globals["embed"], input_ids, d_embed,
                                                       None if pad is None else int(pad)))

    def _layer_fn(self):
        if self._jit is None:
            import jax

            from parity.jax_ling3 import layer

            patches = self.mutation.patches()
            if not patches:  # weight-layout bugs only: the reference's own compiled layer is exactly right
                self._jit = layer.decoder_layer_jit
                return self._jit

            from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

            self._jit = jax.jit(self._layer_pure_fn(), static_argnames=("spec",),
                                compiler_options=REFERENCE_COMPILER_OPTIONS)
        return self._jit

    def _layer_pure_fn(self):
        """The patched layer function, un-jitted: `_layer_fn` jits it, the backward differentiates it (so every
        mutant applies to the backward too, and a backward-only mutant's patches reach the VJP)."""
        if getattr(self, "_pure", None) is None:
            from parity.jax_ling3 import layer

            patches = self.mutation.patches()
            if not patches:
                self._pure = layer.decoder_layer
            else:
                def mutated_layer(p, h, positions, spec, state=None, forced_idx=None, probes=None):  # fresh object
                    with patched(patches):
                        return layer.decoder_layer(p, h, positions, spec, state, forced_idx, probes)

                # the reference's name, so the compiled module is named as the reference's: a layer the patches do
                # not reach lowers to exactly the reference's program and JAX's persistent cache (keyed on the module,
                # name included) serves it instead of compiling it again (issue 35: suite time)
                mutated_layer.__name__ = layer.decoder_layer.__name__
                self._pure = mutated_layer
        return self._pure

    def _isolated_patches(self) -> dict:
        """The patches isolated mode traces the reference's site functions with: the mutation's own, plus its
        replacements of site functions (`Mutation.isolated`)."""
        from parity.targets import reference

        patches = dict(self.mutation.patches())
        if self.mutation.isolated is not None:
            extra = self.mutation.isolated()
            if extra:
                patches[(reference, "ISOLATED_SITES")] = {**reference.ISOLATED_SITES, **extra}
        return patches

    def _isolated_fn(self):
        """Isolated mode: the reference's site functions traced with the same patches, plus the mutation's own
        replacements of site functions (`Mutation.isolated`); a fresh jit per instance, as `_layer_fn`."""
        if self._iso_jit is None:
            from parity.targets import reference

            self._iso_jit = self._patched_site_jit(reference._isolated, reference._isolated_jit)
        return self._iso_jit

    def _isolated_vjp_fn(self):
        """Isolated backward: the reference's site VJP traced with the same patches as `_isolated_fn` (so a
        backward-only bug in a site function reaches the isolated VJP); a fresh jit per instance."""
        if getattr(self, "_iso_vjp_jit", None) is None:
            from parity.targets import reference

            self._iso_vjp_jit = self._patched_site_jit(reference._isolated_vjp, reference._isolated_vjp_jit)
        return self._iso_vjp_jit

    def _patched_site_jit(self, site_fn, unpatched_jit):
        """`site_fn(p, x, st_or_ct, site, spec)` jitted with this mutant's isolated patches applied while it traces
        (a fresh function object per instance, so no other instance's trace is reused); `unpatched_jit` where the
        mutant patches no site function. The reference's own compiler options: without them XLA:CPU may keep a
        norm's fp32 intermediate across a bf16 rounding (excess precision) and the mutant differs from the reference
        at sites the bug never touches."""
        from parity.targets import reference

        patches = self._isolated_patches()
        if not patches:
            return unpatched_jit

        def mutated_site(p, x, st, site, spec):  # fresh object per instance
            with patched(patches):
                return site_fn(p, x, st, site, spec)

        mutated_site.__name__ = site_fn.__name__  # as `mutated_layer`: an unpatched site's program is the reference's
        return reference._make_isolated_jit(mutated_site)


class PlantedFusedScaleNorm(MutantTarget):
    """The reference with sglang-jax's single-rounding RMSNorm planted (`VARIANT_PLANTS`), constructible without
    arguments so that `--parity-target parity.targets.mutants:PlantedFusedScaleNorm` names it."""

    def __init__(self, **kw) -> None:
        super().__init__("rmsnorm_fused_scale", **kw)

class PlantedTpuDefaultPrecision(MutantTarget):
    """A correct port as TPU runs it at JAX's default matmul precision (`DOT_PRECISION_PLANTS`): its fp32 dots take
    one bf16 pass unless `jax.default_matmul_precision('high'|'highest')` is in force when it is traced. Constructible
    without arguments: `--parity-target parity.targets.mutants:PlantedTpuDefaultPrecision`. The layers and the LM
    head honour the policy; one jit per precision, because the compiled-executable cache
    (`reference.compiled_call`) is keyed on the jitted function."""

    def __init__(self, mutation: str = "tpu_default_dot_precision", **kw) -> None:
        super().__init__(mutation, **kw)
        self._jits: dict = {}

    def _layer_fn(self):
        import jax

        from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

        key = ("layer", effective_matmul_precision())
        if key not in self._jits:
            self._jits[key] = jax.jit(self._layer_pure_fn(), static_argnames=("spec",),
                                      compiler_options=REFERENCE_COMPILER_OPTIONS)
        return self._jits[key]

    def head(self, hidden: np.ndarray) -> dict[str, np.ndarray]:
        import jax
        import jax.numpy as jnp

        from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS, model
        from parity.jax_ling3.spec import dtype_of

        if "head" not in self._jits:
            patches = self.mutation.patches()

            def mutated_head(w, lm, h, eps):  # fresh object: no trace of the reference's head_jit is reused
                with patched(patches):
                    return model.head(w, lm, h, eps)

            self._jits["head"] = jax.jit(mutated_head, static_argnames=("eps",),
                                         compiler_options=REFERENCE_COMPILER_OPTIONS)
        out = self._jits["head"](self.globals["final_norm"], self.globals["lm_head"],
                                 jnp.asarray(hidden, dtype_of(self.dtype)), eps=float(self.cfg.rms_norm_eps))
        return {k: np.asarray(v) for k, v in out.items()}


__all__ = ["BACKWARD_MUTATIONS", "DOT_PRECISION_PLANTS", "Expected", "Mutation", "MUTATIONS", "MutantTarget", "PlantedFusedScaleNorm", "PlantedTpuDefaultPrecision",
           "VARIANT_PLANTS", "bf16_pass_dot_patches", "effective_matmul_precision", "patched"]
