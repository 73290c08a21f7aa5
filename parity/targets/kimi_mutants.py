"""Kimi Linear's porting-bug catalogue (issue 34 §4): the mistakes a port of Kimi Linear makes where the family differs
from Ling3 (and from DeepSeek-V2/V3, the other model it is usually ported from), each a target.

Each `KimiMutation` names what it breaks in the suite's JAX Kimi Linear (`parity.jax_kimi`: a module attribute the
reference looks up when it is traced, replaced while the target's freshly jitted layer traces, `KimiReferenceTarget.
planted`) and — from the bug's semantics alone, never from the tool's output — where it must first fail: the first
layer of the kind it touches (`kind`, read from the checkpoint config's layer_types / mlp_layer_types) at `site`,
the site that computes what it breaks (`parity.model.kimi_family.SITES` order). Every mutation is a target class of
this module (`CLASSES`; `--parity-target parity.targets.kimi_mutants:GatedNormSiluNotSigmoid`), and
tests/test_kimi_goldens.py pins each at its site on the fp32 and the bf16 golden.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from parity.targets.kimi import KimiReferenceTarget


# ------------------------------------------------------------------------------------------ the replacements
def _gated_norm_silu(o, gate, w, eps):
    """`KimiLinearRMSNormGated` ported with SiLU on the gate (fla's FusedRMSNormGated default) instead of sigmoid."""
    import jax
    import jax.numpy as jnp

    of = o.astype(jnp.float32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(o.dtype)


def _per_channel_decay(a, A_log, dt_bias, lower_bound, softplus=None):
    """A_log [1,1,H,1] broadcast to [H·d] in the wrong order (tiled, not repeated): the decay rate varies along the
    channels of a head where the built-in has one rate per head."""
    import jax
    import jax.numpy as jnp

    H, d = a.shape[-2], a.shape[-1]
    rate = jnp.exp(jnp.tile(A_log.astype(jnp.float32), d)).reshape(H, d)
    return -rate * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, d))


def _lower_bound_gate(a, A_log, dt_bias, lower_bound, softplus=None):
    """Ling3's lower-bound gate (lb = -5, facts §3.5) where Kimi's is the softplus form: a Ling3 port reused as is."""
    import jax
    import jax.numpy as jnp

    H, d = a.shape[-2], a.shape[-1]
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, d)
    return -5.0 * jax.nn.sigmoid(jnp.exp(A_log.astype(jnp.float32)).reshape(H, 1) * x)  # not-a-bound: Ling3's lb


def _low_rank_with_silu(x, w_a, w_b):
    """An activation between the low-rank projections, b(silu(a(x))): the built-in has none (decay and output gate)."""
    from parity.jax_ling3.ops import linear, silu

    return linear(silu(linear(x, w_a)), w_b)


def _attention_with_rope(orig):
    """DeepSeek-V2 MLA as ported elsewhere: interleaved RoPE on the rope dims (Kimi's built-in MLA applies none)."""
    def attention(q_nope, q_rope, k_nope, v, k_rope, allowed, scale, dt):
        import jax.numpy as jnp

        from parity.jax_ling3.rope import apply_rope_interleaved, cos_sin

        cos, sin = cos_sin(jnp.arange(q_rope.shape[1]), q_rope.shape[-1], 10000.0, dt)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(k_rope[..., None, :], cos, sin)[..., 0, :]
        return orig(q_nope, q_rope, k_nope, v, k_rope, allowed, scale, dt)
    return attention


def _weights_ignoring_norm_topk_prob(logits, idx, m):
    """The top-k sigmoid scores scaled but never renormalised (norm_topk_prob true in the config)."""
    import jax
    import jax.numpy as jnp

    return jnp.take_along_axis(jax.nn.sigmoid(logits), idx, axis=-1) * m.routed_scaling


def _state_cached_in_activation_dtype(orig):
    """The KDA recurrent state kept in the activation dtype between steps (bf16 in a bf16 model) where the built-in
    caches it in fp32 (`update_recurrent_state(state.to(torch.float32))`): each decode step continues from a rounded
    state. The same code in an fp32 model is correct, so it is pinned in bf16 only."""
    def kda_attention(p, x, spec, state=None):
        out, pts, (S, conv) = orig(p, x, spec, state)
        return out, pts, (S.astype(x.dtype), conv)
    return kda_attention


# ------------------------------------------------------------------------------------------ the catalogue
@dataclass(frozen=True)
class KimiMutation:
    """name: the catalogue's name. doc: the porting mistake it models. module, attr: what it replaces in
    `parity.jax_kimi` (looked up at trace time). make: orig -> replacement (the original passed in: a wrapper).
    kind: the layers it touches ("kda", "mla", "moe"). site: where it must first fail (its first such layer).
    dtypes: where the code is wrong (a bug of precision placement is no bug in an fp32 model). phase: where it must
    first fail ("decode": only a decode step, continuing from the port's own cache, shows it)."""

    name: str
    doc: str
    module: str
    attr: str
    make: Callable[[Any], Callable]
    kind: str
    site: str
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # the compute dtypes in which the code is wrong
    phase: str = "prefill"  # "decode": the prefill passes, a decode step through the cache fails first

    def first_layer(self, cfg: Any) -> int:
        """The first decoder layer the bug touches, from the config's layer kinds alone."""
        kinds = {"kda": "linear_attention", "mla": "full_attention"}
        for i in range(cfg.num_hidden_layers):
            if (cfg.mlp_layer_types[i] == "sparse") if self.kind == "moe" else cfg.layer_types[i] == kinds[self.kind]:
                return i
        raise ValueError(f"{self.name}: the config has no {self.kind} layer")

    @contextlib.contextmanager
    def planted(self) -> Iterator[None]:
        mod = importlib.import_module(self.module)
        orig = getattr(mod, self.attr)
        setattr(mod, self.attr, self.make(orig))
        try:
            yield
        finally:
            setattr(mod, self.attr, orig)


def _const(fn: Callable) -> Callable[[Any], Callable]:
    return lambda orig: fn


CATALOGUE: tuple[KimiMutation, ...] = (
    KimiMutation("gated_norm_silu_not_sigmoid", _gated_norm_silu.__doc__, "parity.jax_kimi.kda", "gated_rms_norm",
                 _const(_gated_norm_silu), "kda", "attention.o_norm"),  # the gated norm's output
    KimiMutation("decay_per_channel_not_per_head", _per_channel_decay.__doc__, "parity.jax_kimi.kda", "kda_gate",
                 _const(_per_channel_decay), "kda", "attention.gate"),  # the decay itself
    KimiMutation("activation_between_low_rank_gate_projections", _low_rank_with_silu.__doc__, "parity.jax_kimi.kda",
                 "low_rank", _const(_low_rank_with_silu), "kda", "attention.gate"),  # the decay's low rank first
    KimiMutation("lower_bound_gate_not_softplus", _lower_bound_gate.__doc__, "parity.jax_kimi.kda", "kda_gate",
                 _const(_lower_bound_gate), "kda", "attention.gate"),
    # the MLA core has no site of its own: o_proj is the first site computed from it
    KimiMutation("rope_on_the_mla_rope_dims", _attention_with_rope.__doc__, "parity.jax_kimi.mla", "causal_attention",
                 _attention_with_rope, "mla", "attention.o_proj"),
    # the router's logits are untouched, its weights are not: the weighted expert sum is the first site
    KimiMutation("router_ignores_norm_topk_prob", _weights_ignoring_norm_topk_prob.__doc__, "parity.jax_kimi.moe",
                 "routing_weights", _const(_weights_ignoring_norm_topk_prob), "moe", "mlp.routed"),
    # one rounding of the fp32 state to bf16 is within the bf16 tier's floor for the state (the rule's floor is the
    # activations' precision): the prefill passes; the decode steps continue from rounded states and the state, the
    # only site holding it, fails first once the roundings add up
    KimiMutation("recurrent_state_cached_in_bf16", _state_cached_in_activation_dtype.__doc__, "parity.jax_kimi.kda",
                 "kda_attention", _state_cached_in_activation_dtype, "kda", "attention.state", ("bfloat16",),
                 phase="decode"),
)
BY_NAME = {m.name: m for m in CATALOGUE}


def _target_class(m: KimiMutation) -> type:
    cls_name = "".join(w.capitalize() for w in m.name.split("_"))

    @contextlib.contextmanager
    def planted(self) -> Iterator[None]:
        with m.planted():
            yield

    return type(cls_name, (KimiReferenceTarget,), {
        "name": f"kimi-mutant-{m.name}", "mutation": m, "planted": planted,
        "__doc__": f"A planted porting bug (issue 34 §4, `{m.name}`): {m.doc} First fails at the first {m.kind} "
                   f"layer's `{m.site}`.", "__module__": __name__})


CLASSES: dict[str, type] = {m.name: _target_class(m) for m in CATALOGUE}
globals().update({cls.__name__: cls for cls in CLASSES.values()})  # importable by name, as a target is resolved
