"""Pure-JAX reference of Kimi Linear's decoder layers (transformers' built-in `kimi_linear`, issue 34, first step).

Kimi Linear shares Ling3's building blocks (KDA linear attention, MLA, a grouped sigmoid MoE) with different
wiring, so this package is thin: it reads a `KimiLinearConfig` into hashable statics (`spec`), maps the built-in's
state-dict names to JAX layout (`weights`), and composes `parity.jax_ling3`'s functions where the maths is the same
(KDA recurrence and chunked form, short conv, softplus gate, L2 norm, gated RMSNorm, RMSNorm, SwiGLU, the router's
group-limited top-k, the routed experts, MLA's causal softmax attention). What differs is written here:

- `kda`   : `KimiLinearDeltaAttention` — one short conv over [q|k|v], low-rank decay gate `f_b_proj(f_a_proj(x))`
            (`KimiLinearForgetGate`), low-rank output gate `g_b_proj(g_a_proj(x))`, chunked core for every prefill;
- `mla`   : `KimiLinearAttention` — DeepSeek-V2 MLA with *no* RoPE applied at all, no head gate, `o_proj`;
- `moe`   : `KimiLinearTopkRouter` (honours `norm_topk_prob`) and `KimiLinearMoE`'s per-expert accumulation;
- `layer` : `KimiLinearDecoderLayer` (pre-norm residual block).

Every function is pure: params in, arrays out (plus a dict of named intermediate points for diagnostics, keyed by
the built-in's module names relative to the layer, e.g. `self_attn.forget_gate`). docs/kimi_linear.md says what
is covered and what is not yet (the family-as-data description, dumps, goldens, replay through `pytest parity`).
"""
