"""`portlike`: a small flax-nnx Ling3 written the way serving ports are, as a target that exercises taps, declared
transforms and protocol v2 in CI without any external port installed (DESIGN §7).

It is shaped like sglang-jax's `bailing_moe_v3.py`, not like the suite's own model: its own module tree and names
(`ln_in`, `mixer.wq`, `ffn.router`, …), projections that return `(y, bias)` tuples, a **packed** token batch with
`cu_seqlens`, a recurrent-state **pool** and a paged latent KV **pool** with slot / location 0 reserved, a router
that returns **sigmoid scores** (not logits), and a load path that reads the checkpoint directory itself. None of
its intermediate values is returned: the target reads them through a `TapSet` (`TAPS` below), exactly as an adapter
for a real port does. The maths is delegated to the pure functions of `parity.jax_ling3` (same formulas, same fp32
upcasts), so the bundled dumps pass through it; `variant=` breaks one sub-module on purpose, so the suite can be
shown to place a divergence at the right site:

- `softplus_gate`: the KDA decay uses the Kimi softplus form instead of Ling3's lower-bound form (facts §3.5) —
  must first fail at `attention.gate`;
- `unbiased_routing`: the router picks experts without `expert_bias` (facts §5.2) — must first fail at
  `mlp.gate.topk_idx`;
- `beta_detached` (a backward-only bug, issue 26): `stop_gradient` on the KDA beta projection's output — the forward
  is the same bits, `b_proj` gets no gradient — must first fail at backward `grad.attention.b_proj.weight`.

Backward (capability `backward`, issue 26): no hand-written backward. `layer_backward` hands the port's own block,
as a pure function of its nnx parameter state, to the suite's VJP helper (`parity.targets.backward.layer_vjp`), and
maps the parameter gradients back to HF names as the inverse of its loader (`PORT_TO_JAX`: port module path ->
`convert_layer` key, then `weights.to_hf_layout`). It taps no sub-module cotangents (the port has no probe points):
its backward points are dL/d layer input and the weight gradients; the others are skipped with the reason.
"""

from __future__ import annotations

import functools

from typing import Any

import numpy as np

from parity.targets.base import LayerResult, Target, describe_jax
from parity.targets.serving import PackedBatch, canonical_topk, to_canonical
from parity.targets.taps import ROUTER_SCORES, Tap, TapSet, Transform

VARIANTS = ("ok", "softplus_gate", "unbiased_routing", "beta_detached")
DECODE_ROOM = 128  # KV-pool room per sequence beyond the prompt (the dump's decode steps must fit)
# This port's production XLA options: it mirrors torch's bf16 roundings like the reference does (see
# parity.jax_ling3.REFERENCE_COMPILER_OPTIONS), and says so in describe().
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


# ------------------------------------------------------------------------------------------ module-level functions
# Plain functions a port calls (tapped by function path, like sglang-jax's kernels).
def packed_conv(x, w, caches, cu: tuple[int, ...]):
    """Causal depthwise conv + SiLU over packed tokens x [N,P], one history per sequence caches [B,P,W]."""
    import jax.numpy as jnp

    from parity.jax_ling3.kda import short_conv

    ys, new = [], []
    for b in range(len(cu) - 1):
        y, c = short_conv(x[None, cu[b]:cu[b + 1]], w, caches[b:b + 1])
        ys.append(y[0])
        new.append(c[0])
    return jnp.concatenate(ys), jnp.stack(new)


def decay_gate(a, A_log, dt_bias, lower_bound, variant: str = "ok"):
    """Log-space KDA decay [N,H,d] fp32 (facts §3.5)."""
    from parity.jax_ling3.kda import kda_gate

    return kda_gate(a, A_log, dt_bias, None if variant == "softplus_gate" else lower_bound)


def recurrence(q, k, v, g, beta, S0, cu: tuple[int, ...], scale: float):
    """Delta-rule recurrence per packed sequence (q/k already L2-normalised): (o [N,H,d], S [B,H,K,V] fp32)."""
    import jax.numpy as jnp

    from parity.jax_ling3.kda import CHUNK, KERNELS

    os_, Ss = [], []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        mode = "recurrent" if e - s <= CHUNK else "chunked"  # as the official code picks (facts §3.10)
        o, S = KERNELS[mode](q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], scale,
                             S0[b:b + 1])
        os_.append(o[0])
        Ss.append(S[0])
    return jnp.concatenate(os_), jnp.stack(Ss)


def latent_attention(q_nope, q_rope, kv_pool, rope_pool, w_kv, seq_loc, positions, prefix: int, extend: int,
                     scale: float, dtype):
    """Non-absorbed MLA over the paged latent pool: per sequence, gather its latents, expand K/V with kv_b_proj,
    attend causally (facts §4.4). q_* [N,H,·]; returns [N,H,v]."""
    import jax.numpy as jnp

    from parity.jax_ling3.mla import _naive
    from parity.jax_ling3.ops import linear

    B = seq_loc.shape[0]
    S = prefix + extend
    c = kv_pool.shape[-1]
    H, n = q_nope.shape[1], q_nope.shape[2]
    out = []
    for b in range(B):
        loc = seq_loc[b]
        c_kv = kv_pool[loc][None]  # [1,S,c]
        k_rope = rope_pool[loc][None]  # [1,S,r]
        kvh = linear(c_kv, w_kv).reshape(1, S, H, -1)
        allowed = jnp.arange(S)[None, :] <= (prefix + jnp.arange(extend))[:, None]
        sl = slice(b * extend, (b + 1) * extend)
        o = _naive(q_nope[None, sl], q_rope[None, sl], kvh[..., :n], kvh[..., n:], k_rope, allowed, scale, dtype)
        out.append(o[0])
    del c, positions
    return jnp.concatenate(out)


def head_gate(gp):
    """Head-wise MLA gate: sigmoid in fp32, cast to the model dtype (facts §4.6)."""
    import jax
    import jax.numpy as jnp

    return jax.nn.sigmoid(gp.astype(jnp.float32)).astype(gp.dtype)


def grouped_topk(scores, bias, top_k: int, n_group: int, topk_group: int, routed_scaling: float,
                 use_bias: bool = True):
    """Group-limited top-k on sigmoid scores + bias (facts §5.2–5.4); returns (weights fp32 [N,k], ids [N,k])."""
    import jax
    import jax.numpy as jnp

    E = scores.shape[-1]
    choice = scores + (bias.astype(jnp.float32) if use_bias else 0.0)
    grouped = choice.reshape(-1, n_group, E // n_group)
    gscore = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    keep = jax.lax.top_k(gscore, topk_group)[1]
    kept = jnp.any(jax.nn.one_hot(keep, n_group, dtype=bool), axis=-2)
    ids = jax.lax.top_k(jnp.where(kept[..., None], grouped, -jnp.inf).reshape(-1, E), top_k)[1].astype(jnp.int32)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * routed_scaling, ids


# ------------------------------------------------------------------------------------------ nnx modules
def _modules():
    """The nnx classes, built on first use (flax is imported only when the target runs)."""
    global _M
    if _M is not None:
        return _M
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from parity.jax_ling3.moe import routed_experts, router_logits, swiglu
    from parity.jax_ling3.norms import gated_rms_norm, l2_normalize, rms_norm
    from parity.jax_ling3.ops import linear
    from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin

    class Dense(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)

        def __call__(self, x):
            return linear(x, self.w[...]), None  # port style: (output, bias)

    class Norm(nnx.Module):
        def __init__(self, scale, eps):
            self.scale, self.eps = nnx.Param(scale), eps

        def __call__(self, x):
            return rms_norm(x, self.scale[...], self.eps)

    class GatedNorm(nnx.Module):
        def __init__(self, w, eps):
            self.w, self.eps = nnx.Param(w), eps

        def __call__(self, o, gate):
            return gated_rms_norm(o, gate, self.w[...], self.eps)

    class KDAMixer(nnx.Module):
        def __init__(self, p, m, variant):
            self.wq, self.wk, self.wv = Dense(p["q_proj"]), Dense(p["k_proj"]), Dense(p["v_proj"])
            self.w_forget, self.w_beta, self.w_outgate = Dense(p["f_proj"]), Dense(p["b_proj"]), Dense(p["g_proj"])
            self.conv_w = nnx.Param(jnp.stack([p["q_conv1d"], p["k_conv1d"], p["v_conv1d"]]))
            self.A_log, self.dt_bias = nnx.Param(p["A_log"]), nnx.Param(p["dt_bias"])
            self.out_norm = GatedNorm(p["o_norm"], m.eps)
            self.wo = Dense(p["o_proj"])
            self.H, self.d, self.lb, self.variant = m.num_heads, m.kda_head_dim, m.lower_bound, variant

        def __call__(self, x, meta, pool):
            N, H, d = x.shape[0], self.H, self.d
            slots, cu = meta["slots"], meta["cu"]
            conv0 = pool["conv"][slots]  # [B,3,P,W]
            qkv, convs = [], []
            for j, lin in enumerate((self.wq, self.wk, self.wv)):
                y, c = packed_conv(lin(x)[0], self.conv_w[...][j], conv0[:, j], cu)
                qkv.append(y.reshape(N, H, d))
                convs.append(c)
            g = decay_gate(self.w_forget(x)[0].reshape(N, H, d), self.A_log[...], self.dt_bias[...], self.lb,
                           self.variant)
            b = self.w_beta(x)[0]
            if self.variant == "beta_detached":  # backward-only bug: identity in the forward
                b = jax.lax.stop_gradient(b)
            beta = jax.nn.sigmoid(b.astype(jnp.float32))
            q, k, v = qkv
            o, S = recurrence(l2_normalize(q), l2_normalize(k), v, g, beta, pool["ssm"][slots], cu, d ** -0.5)
            o = o.astype(x.dtype)
            on = self.out_norm(o, self.w_outgate(x)[0].reshape(N, H, d))
            out = self.wo(on.reshape(N, H * d))[0]
            new_pool = {"ssm": pool["ssm"].at[slots].set(S),
                        "conv": pool["conv"].at[slots].set(jnp.stack(convs, axis=1).astype(pool["conv"].dtype))}
            return out, new_pool

    class MLAMixer(nnx.Module):
        def __init__(self, p, m):
            from parity.jax_ling3.mla import MLA_NORM_EPS

            self.q_lora = m.q_lora_rank is not None
            if self.q_lora:
                self.wq_a, self.q_norm, self.wq_b = (Dense(p["q_a_proj"]), Norm(p["q_a_layernorm"], MLA_NORM_EPS),
                                                     Dense(p["q_b_proj"]))
            else:
                self.wq = Dense(p["q_proj"])
            self.wkv_a, self.kv_norm = Dense(p["kv_a_proj_with_mqa"]), Norm(p["kv_a_layernorm"], MLA_NORM_EPS)
            self.wkv_b, self.w_gate, self.wo = Dense(p["kv_b_proj"]), Dense(p["g_proj"]), Dense(p["dense"])
            self.m = m

        def __call__(self, x, meta, pool):
            m = self.m
            N, H, n, r, vd, c = x.shape[0], m.num_heads, m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank
            q = self.wq_b(self.q_norm(self.wq_a(x)[0]))[0] if self.q_lora else self.wq(x)[0]
            q = q.reshape(N, H, n + r)
            kv_a = self.wkv_a(x)[0]
            c_kv = self.kv_norm(kv_a[:, :c])
            self.wkv_b(c_kv)  # the port expands the new tokens' K/V here too (tapped as kv_b_proj)
            cos, sin = cos_sin(meta["positions"], r, m.rope_theta, x.dtype)
            q_rope = apply_rope_interleaved(q[:, :, n:], cos, sin)  # cos/sin [N,r/2] broadcast over heads
            k_rope = apply_rope_interleaved(kv_a[:, None, c:], cos, sin)[:, 0]  # one shared head
            loc = meta["out_loc"]
            kv_pool = pool["c_kv"].at[loc].set(c_kv.astype(pool["c_kv"].dtype))
            rope_pool = pool["k_rope"].at[loc].set(k_rope.astype(pool["k_rope"].dtype))
            core = latent_attention(q[:, :, :n], q_rope, kv_pool, rope_pool, self.wkv_b.w[...], meta["seq_loc"],
                                    meta["positions"], meta["prefix"], meta["extend"], m.attn_scale, x.dtype)
            gate = head_gate(self.w_gate(x)[0])
            gated = (core * gate[:, :, None]).reshape(N, H * vd)
            return self.wo(gated)[0], {"c_kv": kv_pool, "k_rope": rope_pool}

    class Router(nnx.Module):
        def __init__(self, w, bias):
            self.kernel, self.bias = nnx.Param(w), nnx.Param(bias)

        def __call__(self, x):
            return jax.nn.sigmoid(router_logits(x, self.kernel[...]))  # scores, as the port returns

    class FFN(nnx.Module):
        """SwiGLU MLP with port-style projections (dense layers and the shared expert)."""

        def __init__(self, p, limit):
            self.w_gate, self.w_up, self.w_down = Dense(p["gate_proj"]), Dense(p["up_proj"]), Dense(p["down_proj"])
            self.limit = limit

        def __call__(self, x):
            return self.w_down(swiglu(self.w_gate(x)[0], self.w_up(x)[0], self.limit))[0]

    class Experts(nnx.Module):
        """Stacked expert weights [E, ·, ·]."""

        def __init__(self, p, limit):
            self.gate, self.up, self.down = (nnx.Param(p[f"experts_{k}"]) for k in ("gate", "up", "down"))
            self.limit = limit

        def __call__(self, x, weights, ids):
            p = {"experts_gate": self.gate[...], "experts_up": self.up[...], "experts_down": self.down[...]}
            return routed_experts(p, x, ids, weights, self.limit)

    class MoE(nnx.Module):
        def __init__(self, p, spec, variant):
            m = spec.model
            self.router = Router(p["router"], p["expert_bias"])
            self.experts = Experts(p, spec.routed_limit)
            self.shared = FFN({k: p[f"shared_{k}"] for k in ("gate_proj", "up_proj", "down_proj")},
                              spec.shared_limit) if m.has_shared else None
            self.cfg = (m.top_k, m.n_group, m.topk_group, m.routed_scaling, variant != "unbiased_routing")

        def __call__(self, x, forced_ids=None):
            scores = self.router(x)
            w, ids = grouped_topk(scores, self.router.bias[...], *self.cfg)
            if forced_ids is not None:  # forced routing: the port's weight maths on the given experts
                ids = forced_ids
                w = jnp.take_along_axis(scores, ids, axis=-1)
                w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * self.cfg[3]
            y = self.experts(x, w, ids)
            return y + self.shared(x) if self.shared is not None else y

    class Block(nnx.Module):
        def __init__(self, p, spec, variant):
            m = spec.model
            self.ln_in = Norm(p["input_layernorm"], m.eps)
            self.mixer = KDAMixer(p["attention"], m, variant) if spec.kind == "kda" else MLAMixer(p["attention"], m)
            self.ln_post = Norm(p["post_attention_layernorm"], m.eps)
            self.ffn = MoE(p["mlp"], spec, variant) if spec.moe else FFN(p["mlp"], None)
            self.moe = spec.moe

        def __call__(self, x, meta, pool, forced_ids=None):
            a, new_pool = self.mixer(self.ln_in(x), meta, pool)
            h = x + a  # residual stream in the model dtype (facts §8)
            y = self.ffn(self.ln_post(h), forced_ids) if self.moe else self.ffn(self.ln_post(h))
            return h + y, new_pool

    _M = {"Block": Block, "KDAMixer": KDAMixer}  # KDAMixer alone: the partial-port example (PortlikeKDA)
    return _M


_M = None


# ------------------------------------------------------------------------------------------ the tap map
_HERE = "parity.targets.portlike"


def _conv_state(v, ctx):
    """The KDA conv pool [slots,3,P,W] -> this batch's [3,B,P,W] (fla convention: last W inputs, facts §3.11)."""
    return np.moveaxis(np.asarray(v["conv"])[ctx["slots"]], 1, 0)


CONV_POOL = Transform("conv_pool_rows", "conv state read from the port's per-slot conv pool (rows of this batch's "
                      "slots; slot 0 reserved)", test=_conv_state)


def tap_map(kind: str, moe: bool, q_lora: bool) -> list[Tap]:
    """Canonical site <- this port's module path / function, per layer kind (DESIGN §3 names)."""
    t = [Tap("input_layernorm", module="ln_in"), Tap("attention", module="mixer", take="out[0]"),
         Tap("post_attention_layernorm", module="ln_post"), Tap("output", module="", take="out[0]")]
    if kind == "kda":
        t += [Tap(f"attention.{n}_proj", module=f"mixer.w{n}", take="out[0]") for n in "qkv"]
        t += [Tap(f"attention.{n}_conv1d", function=f"{_HERE}:packed_conv", take="out[0]", call=j)
              for j, n in enumerate("qkv")]
        t += [Tap("attention.f_proj", module="mixer.w_forget", take="out[0]"),
              Tap("attention.gate", function=f"{_HERE}:decay_gate"),
              Tap("attention.b_proj", module="mixer.w_beta", take="out[0]"),
              Tap("attention.beta", function=f"{_HERE}:recurrence", take="in[beta]"),
              Tap("attention.core", module="mixer.out_norm", take="in[0]"),
              Tap("attention.g_proj", module="mixer.w_outgate", take="out[0]"),
              Tap("attention.o_norm", module="mixer.out_norm"),
              Tap("attention.o_proj", module="mixer.wo", take="out[0]"),
              Tap("attention.state", function=f"{_HERE}:recurrence", take="out[1]"),
              Tap("attention.conv_state", module="mixer", take="out[1]", transform=CONV_POOL)]
    else:
        if q_lora:
            t += [Tap("attention.q_a_proj", module="mixer.wq_a", take="out[0]"),
                  Tap("attention.q_a_layernorm", module="mixer.q_norm"),
                  Tap("attention.q_b_proj", module="mixer.wq_b", take="out[0]")]
        else:
            t += [Tap("attention.q_proj", module="mixer.wq", take="out[0]")]
        t += [Tap("attention.kv_a_proj_with_mqa", module="mixer.wkv_a", take="out[0]"),
              Tap("attention.kv_a_layernorm", module="mixer.kv_norm"),
              Tap("attention.kv_b_proj", module="mixer.wkv_b", take="out[0]"),
              Tap("attention.core", function=f"{_HERE}:latent_attention"),
              Tap("attention.g_proj", module="mixer.w_gate", take="out[0]"),
              Tap("attention.gate", function=f"{_HERE}:head_gate"),
              Tap("attention.dense:in", module="mixer.wo", take="in[0]"),
              Tap("attention.dense", module="mixer.wo", take="out[0]")]
    if moe:
        t += [Tap("mlp.gate.logits", module="ffn.router", transform=ROUTER_SCORES),
              Tap("mlp.gate.topk_weight", module="ffn.experts", take="in[weights]"),
              Tap("mlp.gate.topk_idx", module="ffn.experts", take="in[ids]"),
              Tap("mlp.routed", module="ffn.experts"),
              Tap("mlp.shared_experts", module="ffn.shared"),
              Tap("mlp", module="ffn")]
    else:
        t += [Tap("mlp.gate_proj", module="ffn.w_gate", take="out[0]"),
              Tap("mlp.up_proj", module="ffn.w_up", take="out[0]"),
              Tap("mlp.down_proj", module="ffn.w_down", take="out[0]"), Tap("mlp", module="ffn")]
    return t


# ------------------------------------------------------------------------------------------ the target
class PortlikeTarget(Target):
    """The port-shaped model as a target: loads from the checkpoint directory, runs packed batches through pools,
    reports every site through taps. `variant` (see module doc) breaks one sub-module on purpose."""

    name = "portlike"
    capabilities = frozenset({"q_lora", "swiglu_clamp", "forced_routing", "kda_chunked", "kda_recurrent", "decode",
                              "backward"})
    needs_checkpoint_dir = True

    def __init__(self, variant: str = "ok") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"portlike variant {variant!r}: expected one of {VARIANTS}")
        self.variant = variant
        self.blocks: dict[int, Any] = {}
        self.ckpt_dir = None
        self._taps: dict[tuple, TapSet] = {}

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import flax  # noqa: F401
            import jax  # noqa: F401
        except ImportError as e:
            return False, f"flax/jax not installed ({e}); pip install 'flax==0.12.*'"
        return True, ""

    def build(self, config, dtype: str, mesh=None) -> None:
        from parity.jax_ling3.spec import dtype_name, dtype_of

        self.cfg, self.dtype = config, dtype_name(dtype_of(dtype))
        for i in range(self.cfg.num_hidden_layers):  # every function patch in place before the port's first trace
            self.taps(i)

    def use_checkpoint_dir(self, path, layers=None) -> None:
        from parity.jax_ling3.weights import CheckpointReader

        self.ckpt_dir = str(path)
        self._reader = CheckpointReader(path)

    def describe(self) -> dict:
        return describe_jax(self.name, variant=self.variant, compiler_options=COMPILER_OPTIONS,
                            kda_kernel="parity.jax_ling3 recurrent (T<=64) / chunked", mla="non-absorbed, paged latent",
                            batch="packed, slot 0 reserved", checkpoint_dir=self.ckpt_dir)

    def spec(self, i: int):
        from parity.jax_ling3.spec import layer_spec

        return layer_spec(self.cfg, i, self.dtype)

    def taps(self, i: int) -> TapSet:
        key = (self.cfg.layer_kind(i), self.cfg.is_moe(i), self.cfg.q_lora)
        if key not in self._taps:
            self._taps[key] = TapSet(tap_map(*key)).install()
        return self._taps[key]

    def load_globals(self, hf_tensors) -> None:
        from parity.jax_ling3.weights import convert_globals

        self.glob = convert_globals(self.cfg, hf_tensors, self.dtype)

    def load_layer(self, i: int, hf_tensors) -> None:
        from parity.jax_ling3.weights import convert_layer

        src = self._reader.hf_tensors(i) if self.ckpt_dir else hf_tensors  # the port reads its own checkpoint
        p = convert_layer(self.cfg, i, src, self.dtype)
        self.blocks[i] = _modules()["Block"](p, self.spec(i), self.variant)

    def unload_layer(self, i: int) -> None:
        self.blocks.pop(i, None)

    def embed(self, input_ids):
        return np.asarray(self.glob["embed"])[np.asarray(input_ids)]

    def head(self, hidden):
        import jax.numpy as jnp

        from parity.jax_ling3.model import head_jit
        from parity.jax_ling3.spec import dtype_of

        out = head_jit(self.glob["final_norm"], self.glob["lm_head"], jnp.asarray(hidden, dtype_of(self.dtype)),
                       float(self.cfg.rms_norm_eps))
        return {k: np.asarray(v) for k, v in out.items()}

    def _new_pool(self, i: int, B: int, capacity: int):
        import jax.numpy as jnp

        from parity.jax_ling3.spec import dtype_of

        dt, cfg = dtype_of(self.dtype), self.cfg
        if cfg.layer_kind(i) == "kda":
            H, d, P, W = cfg.num_attention_heads, cfg.head_dim, cfg.kda_proj_size, cfg.short_conv_kernel_size
            return {"ssm": jnp.zeros((1 + B, H, d, d), jnp.float32), "conv": jnp.zeros((1 + B, 3, P, W), dt)}
        n = 1 + B * capacity
        return {"c_kv": jnp.zeros((n, cfg.kv_lora_rank), dt), "k_rope": jnp.zeros((n, cfg.qk_rope_head_dim), dt)}

    def layer_forward(self, i: int, hidden, positions, state=None, forced_topk=None) -> LayerResult:
        import jax.numpy as jnp

        from parity.jax_ling3.spec import dtype_of

        hidden = np.asarray(hidden)
        B, T, D = hidden.shape
        if state is None:
            cap = T + DECODE_ROOM
            pool, prefix = self._new_pool(i, B, cap), 0
        else:
            pool, prefix, cap = state
        pb = PackedBatch.of(B, T, prefix=prefix, capacity=cap)
        meta = {"slots": jnp.asarray(pb.slots), "positions": jnp.asarray(pb.positions),
                "out_loc": jnp.asarray(pb.out_loc), "seq_loc": jnp.asarray(pb.seq_loc)}
        # only the MLA block reads `prefix` (its pool gather has prefix + T rows): a KDA layer's program is the same at
        # every decode step, so it is compiled once, not once per step (issue 35: suite time)
        statics = (tuple(int(c) for c in pb.cu_seqlens), prefix if self.cfg.layer_kind(i) == "mla" else 0, T)
        forced = None if forced_topk is None else jnp.asarray(pb.pack(forced_topk), jnp.int32)
        taps = self.taps(i)
        from flax import nnx

        graphdef, params = nnx.split(self.blocks[i])
        phase = "prefill" if state is None else "decode"
        with taps.record(phase, {"slots": pb.slots}) as cap_:
            out, new_pool = _run_jit()(graphdef, params, jnp.asarray(pb.pack(hidden), dtype_of(self.dtype)), meta,
                                       pool, forced, statics, taps)
        pts = {}
        for site, v in cap_.points.items():
            v = np.asarray(v) if not isinstance(v, dict) else v
            pts[site] = pb.unpack(v) if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == pb.tokens else v
        if "mlp.gate.topk_idx" in pts:
            pts["mlp.gate.topk_idx"], pts["mlp.gate.topk_weight"] = canonical_topk(pts["mlp.gate.topk_idx"],
                                                                                     pts.get("mlp.gate.topk_weight"))
        pts["input"] = hidden
        pts = to_canonical(self.cfg, i, pts, B, T)
        return LayerResult(pb.unpack(np.asarray(out)), pts, (new_pool, prefix + T, cap), transforms=cap_.transforms,
                           missing=cap_.missing)

    # ---------------------------------------------------------------- backward (issue 26): the suite's VJP helper
    def layer_backward(self, i: int, hidden, positions, cotangent, forced_topk=None):
        """VJP of this port's block at prefill (fresh pools), routing forced to `forced_topk`, through
        `parity.targets.backward.layer_vjp`; weight gradients under HF names (`port_grads_to_hf`)."""
        import jax.numpy as jnp
        from flax import nnx

        from parity.jax_ling3.spec import dtype_of
        from parity.targets.base import BackwardResult

        hidden = np.asarray(hidden)
        B, T, D = hidden.shape
        cap = T + DECODE_ROOM
        pb = PackedBatch.of(B, T, prefix=0, capacity=cap)
        meta = {"slots": jnp.asarray(pb.slots), "positions": jnp.asarray(pb.positions),
                "out_loc": jnp.asarray(pb.out_loc), "seq_loc": jnp.asarray(pb.seq_loc)}
        statics = (tuple(int(c) for c in pb.cu_seqlens), 0, T)
        forced = None if forced_topk is None else jnp.asarray(pb.pack(forced_topk), jnp.int32)
        dt = dtype_of(self.dtype)
        graphdef, params = nnx.split(self.blocks[i])
        dh, dp = _bwd_jit()(graphdef, params, jnp.asarray(pb.pack(hidden), dt), jnp.asarray(pb.pack(cotangent), dt),
                            meta, self._new_pool(i, B, cap), forced, statics)
        grads = port_grads_to_hf(self.cfg, i, nnx.to_pure_dict(dp))
        why = "portlike's backward is the suite's layer_vjp of its block without probes: no sub-module cotangents"
        from parity.model.points import backward_sites

        missing = {s: why for s in backward_sites(self.cfg, i) if not s.startswith("grad.") and s != "input"}
        return BackwardResult(pb.unpack(np.asarray(dh)), grads, {}, missing)

    # The model-level VJPs: this port's head and embedding are the reference's functions (`head` above calls
    # `model.head_jit`, `embed` gathers rows), so their VJPs are the reference's `jax.vjp`s, with this port's weights.
    def head_backward(self, hidden, d_logits) -> dict[str, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import head_backward
        from parity.jax_ling3.spec import dtype_of

        g = self.glob
        out = head_backward(g["final_norm"], g["lm_head"], jnp.asarray(hidden, dtype_of(self.dtype)),
                            jnp.asarray(d_logits, jnp.float32), eps=float(self.cfg.rms_norm_eps))
        return {"final_norm": np.asarray(out["final_norm"]), "input": np.asarray(out["input"]),
                "grad.model.norm.weight": np.asarray(out["final_norm_w"]),
                "grad.lm_head.weight": np.ascontiguousarray(np.asarray(out["lm_head"]).T)}  # [D,V] -> HF [V,D]

    def embed_backward(self, input_ids, d_embed) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import embed_backward

        pad = getattr(self.cfg, "pad_token_id", None)
        return np.asarray(embed_backward(self.glob["embed"], jnp.asarray(input_ids, jnp.int32), jnp.asarray(d_embed),
                                         pad_id=None if pad is None else int(pad)))

    def loss_backward(self, logits, input_ids) -> tuple[float, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.backward import loss_backward

        loss, d = loss_backward(jnp.asarray(logits, jnp.float32), jnp.asarray(input_ids, jnp.int32))
        return float(loss), np.asarray(d)


# Inverse of the loader's second step (module construction in `_modules`): this port's parameter path ->
# the `convert_layer` (JAX layout) key it was built from. `conv_w` stacks q, k, v ([3,P,W]).
PORT_TO_JAX = {
    ("ln_in", "scale"): ("input_layernorm",), ("ln_post", "scale"): ("post_attention_layernorm",),
    # KDA
    ("mixer", "wq", "w"): ("attention", "q_proj"), ("mixer", "wk", "w"): ("attention", "k_proj"),
    ("mixer", "wv", "w"): ("attention", "v_proj"), ("mixer", "w_forget", "w"): ("attention", "f_proj"),
    ("mixer", "w_beta", "w"): ("attention", "b_proj"), ("mixer", "w_outgate", "w"): ("attention", "g_proj"),
    ("mixer", "A_log"): ("attention", "A_log"), ("mixer", "dt_bias"): ("attention", "dt_bias"),
    ("mixer", "out_norm", "w"): ("attention", "o_norm"), ("mixer", "wo", "w"): ("attention", "o_proj"),
    # MLA (`wo` is KDA's o_proj or MLA's dense: told apart by the layer kind)
    ("mixer", "wq_a", "w"): ("attention", "q_a_proj"), ("mixer", "q_norm", "scale"): ("attention", "q_a_layernorm"),
    ("mixer", "wq_b", "w"): ("attention", "q_b_proj"), ("mixer", "wkv_a", "w"): ("attention", "kv_a_proj_with_mqa"),
    ("mixer", "kv_norm", "scale"): ("attention", "kv_a_layernorm"), ("mixer", "wkv_b", "w"): ("attention", "kv_b_proj"),
    ("mixer", "w_gate", "w"): ("attention", "g_proj"),
    # MLP: dense FFN, MoE
    ("ffn", "w_gate", "w"): ("mlp", "gate_proj"), ("ffn", "w_up", "w"): ("mlp", "up_proj"),
    ("ffn", "w_down", "w"): ("mlp", "down_proj"),
    ("ffn", "router", "kernel"): ("mlp", "router"), ("ffn", "router", "bias"): ("mlp", "expert_bias"),
    ("ffn", "experts", "gate"): ("mlp", "experts_gate"), ("ffn", "experts", "up"): ("mlp", "experts_up"),
    ("ffn", "experts", "down"): ("mlp", "experts_down"),
    ("ffn", "shared", "w_gate", "w"): ("mlp", "shared_gate_proj"), ("ffn", "shared", "w_up", "w"): ("mlp", "shared_up_proj"),
    ("ffn", "shared", "w_down", "w"): ("mlp", "shared_down_proj"),
}
NOT_TRAINABLE = ("mlp.gate.expert_bias",)  # selection only (facts §5.4): a buffer, no gradient


def _flatten(tree: dict, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def port_grads_to_hf(cfg, i: int, grads: dict) -> dict[str, np.ndarray]:
    """This port's parameter gradients (nested by module path) -> {HF name relative to `model.layers.{i}.`: array
    in the HF shape}: `PORT_TO_JAX`, then `weights.to_hf_layout` (the inverse of `convert_layer`). An unknown
    parameter path is an error (a loader change this map missed)."""
    from parity.jax_ling3.weights import to_hf_layout

    p: dict = {"attention": {}, "mlp": {}}
    for path, v in _flatten(grads):
        if path == ("mixer", "conv_w"):
            for j, n in enumerate("qkv"):
                p["attention"][f"{n}_conv1d"] = np.asarray(v)[j]
            continue
        if path == ("mixer", "wo", "w") and cfg.layer_kind(i) == "mla":
            p["attention"]["dense"] = np.asarray(v)
            continue
        if path not in PORT_TO_JAX:
            raise KeyError(f"portlike layer {i}: parameter {'.'.join(map(str, path))} has no entry in PORT_TO_JAX")
        key = PORT_TO_JAX[path]
        if len(key) == 1:
            p[key[0]] = np.asarray(v)
        else:
            p[key[0]][key[1]] = np.asarray(v)
    return {k: v for k, v in to_hf_layout(cfg, i, p).items() if k not in NOT_TRAINABLE}


def _bwd(graphdef, params, x, cot, meta, pool, forced, statics):
    """(dL/dx, dL/dparams) of the block at x for the output cotangent `cot`, via the suite's `layer_vjp`."""
    from flax import nnx

    from parity.jax_ling3.probes import probing
    from parity.targets.backward import layer_vjp

    cu, prefix, extend = statics

    def fn(p, h, probes):
        block = nnx.merge(graphdef, p)
        out, _ = block(h, {**meta, "cu": cu, "prefix": prefix, "extend": extend}, pool, forced)
        return out, {}

    # an empty probe dict: no probes (the shared MoE code's blocked loop has its own VJP, moe._routed_blocked_bwd;
    # parity.jax_ling3.probes.differentiating stays for code that needs another form while differentiating)
    with probing({}):
        dh, dp, _, _ = layer_vjp(fn, params, x, cot)
    return dh, dp


@functools.cache
def _bwd_jit():
    import jax

    return jax.jit(_bwd, static_argnames=("graphdef", "statics"), compiler_options=COMPILER_OPTIONS)


def _run(graphdef, params, x, meta, pool, forced, statics, taps):
    from flax import nnx

    cu, prefix, extend = statics
    block = nnx.merge(graphdef, params)
    with taps.bind(block):
        return block(x, {**meta, "cu": cu, "prefix": prefix, "extend": extend}, pool, forced)


@functools.cache
def _run_jit():
    import jax

    return jax.jit(_run, static_argnames=("graphdef", "statics", "taps"), compiler_options=COMPILER_OPTIONS)


# ------------------------------------------------------------------------------------------ a partial port (issue 32)
# The worked example of docs/porting.md "Partial ports": this port's KDA attention alone (its `KDAMixer`, packed
# tokens, recurrent-state pool) as a `Part`; norms, MLA layers, MoE, embedding and head come from the reference.
from parity.targets.partial import Part, PartialTarget, PartResult  # noqa: E402


class PortlikeKDA(Part):
    """portlike's KDA mixer as the attention block of KDA layers. It taps nothing inside the block (the report then
    compares the block's output, `attention`, and says the port does not produce its sub-sites); `variant` as
    PortlikeTarget's (`softplus_gate` breaks the decay gate)."""

    block, kinds = "attention", ("kda",)

    def __init__(self, variant: str = "ok") -> None:
        self.variant = variant
        self.mixers: dict[int, Any] = {}

    def load(self, i: int, hf_tensors) -> None:
        from parity.jax_ling3.spec import layer_spec
        from parity.jax_ling3.weights import convert_layer

        p = convert_layer(self.cfg, i, hf_tensors, self.dtype)
        self.mixers[i] = _modules()["KDAMixer"](p["attention"], layer_spec(self.cfg, i, self.dtype).model,
                                                self.variant)

    def unload(self, i: int) -> None:
        self.mixers.pop(i, None)

    def forward(self, i: int, x, positions, state=None, forced_topk=None) -> PartResult:
        import jax.numpy as jnp
        from flax import nnx

        x = np.asarray(x)
        B, T, _ = x.shape
        pool = state if state is not None else self._new_pool(B, x.dtype)
        pb = PackedBatch.of(B, T)
        graphdef, params = nnx.split(self.mixers[i])
        out, new_pool = _mixer_jit()(graphdef, params, jnp.asarray(pb.pack(x)), jnp.asarray(pb.slots), pool,
                                     tuple(int(c) for c in pb.cu_seqlens))
        return PartResult(pb.unpack(np.asarray(out)), state=new_pool)

    def _new_pool(self, B: int, dtype):
        import jax.numpy as jnp

        cfg = self.cfg
        H, d, P, W = cfg.num_attention_heads, cfg.head_dim, cfg.kda_proj_size, cfg.short_conv_kernel_size
        return {"ssm": jnp.zeros((1 + B, H, d, d), jnp.float32), "conv": jnp.zeros((1 + B, 3, P, W), dtype)}

    def describe(self) -> dict:
        return {"part": "portlike KDAMixer", "variant": self.variant}


class PortlikeKDAOnly(PartialTarget):
    """portlike's KDA attention, everything else the reference (`--parity-target
    parity.targets.portlike:PortlikeKDAOnly`)."""

    def __init__(self, variant: str = "ok", **reference_options) -> None:
        super().__init__(PortlikeKDA(variant), name=f"portlike-kda-only{'' if variant == 'ok' else '+' + variant}",
                         **reference_options)


def _mixer_run(graphdef, params, x, slots, pool, cu):
    from flax import nnx

    return nnx.merge(graphdef, params)(x, {"slots": slots, "cu": cu}, pool)


@functools.cache
def _mixer_jit():
    import jax

    return jax.jit(_mixer_run, static_argnames=("graphdef", "cu"), compiler_options=COMPILER_OPTIONS)
