"""The built-in `KimiLinearForCausalLM`'s state-dict names and shapes -> JAX-layout params of one decoder layer.

Linear weights are stored [out, in] and transposed to [in, out] (`parity.jax_ling3.ops.linear`); the depthwise conv
[3P, 1, W] becomes [3P, W]; `A_log` [1, 1, H, 1] (per head, `KimiLinearForgetGate`) becomes [H]; the fused expert
stack `experts.gate_up_proj` [E, 2I, D] (gate rows first, `KimiLinearExperts.forward`'s `chunk(2)`) is split into
Ling3's `experts_gate` / `experts_up` [E, D, I] and `experts.down_proj` [E, D, I] becomes `experts_down` [E, I, D], so
`parity.jax_ling3.moe`'s routed-expert functions take them unchanged. Every key of the layer must be used and every
expected key present, with the expected shape: `CheckpointError` names the key otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from parity.errors import CheckpointError
from parity.jax_kimi.spec import KimiLayerSpec


def _array(t: Any) -> jnp.ndarray:
    """A torch tensor or array-like as a jnp array of the same dtype (bf16 kept bf16: its fp32 upcast is exact)."""
    if hasattr(t, "detach"):  # torch, without importing it
        t = t.detach().cpu()
        # its 16 bits as numpy's bfloat16 (ml_dtypes) without a host copy (`capture.to_numpy` copies; a real-shape
        # expert stack is 3.6 GB), nor an fp32 one
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return jnp.asarray(t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        t = t.numpy()
    return jnp.asarray(np.asarray(t))


class _Reader:
    """Takes the layer's tensors by relative name, checking shapes; `leftover()` lists what nobody took."""

    def __init__(self, tensors: Mapping[str, Any], prefix: str):
        self.prefix = prefix
        self.items = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> jnp.ndarray:
        if name not in self.items:
            raise CheckpointError(f"{self.prefix}{name}: missing (expected shape {list(shape)}, parity.jax_kimi)")
        got = tuple(self.items[name].shape)
        if got != tuple(shape):
            raise CheckpointError(f"{self.prefix}{name}: shape {list(got)}, expected {list(shape)} (parity.jax_kimi)")
        self.used.add(name)
        return _array(self.items[name])

    def linear(self, name: str, out: int, inp: int) -> jnp.ndarray:
        return self.take(f"{name}.weight", (out, inp)).T

    def leftover(self) -> None:
        rest = sorted(set(self.items) - self.used)
        if rest:
            raise CheckpointError(f"{self.prefix}{rest[0]}: not a parameter of this layer kind"
                                  f"{f' (and {len(rest) - 1} more)' if len(rest) > 1 else ''} (parity.jax_kimi)")


def layer_params(tensors: Mapping[str, Any], i: int, spec: KimiLayerSpec) -> dict:
    """JAX params of decoder layer i from the built-in's names (`model.layers.{i}.…`) in `tensors` (a state dict or
    any name -> array mapping; other layers' keys are ignored)."""
    m = spec.model
    r = _Reader(tensors, f"model.layers.{i}.")
    D, H, d, W = m.hidden_size, m.num_heads, m.kda_head_dim, m.conv_size
    P = H * d
    p: dict = {"input_layernorm": r.take("input_layernorm.weight", (D,)),
               "post_attention_layernorm": r.take("post_attention_layernorm.weight", (D,))}
    if spec.kind == "kda":
        a = {n: r.linear(f"self_attn.{n}", P, D) for n in ("q_proj", "k_proj", "v_proj")}
        a["conv1d"] = r.take("self_attn.conv1d.weight", (3 * P, 1, W))[:, 0, :]
        fg = "self_attn.forget_gate"
        a["f_a_proj"] = r.linear(f"{fg}.f_a_proj", d, D)
        a["f_b_proj"] = r.linear(f"{fg}.f_b_proj", P, d)
        a["dt_bias"] = r.take(f"{fg}.dt_bias", (P,))
        a["A_log"] = r.take(f"{fg}.A_log", (1, 1, H, 1)).reshape(H)
        a["b_proj"] = r.linear("self_attn.b_proj", H, D)
        a["g_a_proj"] = r.linear("self_attn.g_a_proj", d, D)
        a["g_b_proj"] = r.linear("self_attn.g_b_proj", P, d)
        a["o_norm"] = r.take("self_attn.o_norm.weight", (d,))
        a["o_proj"] = r.linear("self_attn.o_proj", D, P)
    else:
        Hm, c = m.mla_heads, m.kv_lora_rank
        a = {}
        if m.q_lora_rank is None:
            a["q_proj"] = r.linear("self_attn.q_proj", Hm * m.qk_head_dim, D)
        else:
            a["q_a_proj"] = r.linear("self_attn.q_a_proj", m.q_lora_rank, D)
            a["q_a_layernorm"] = r.take("self_attn.q_a_layernorm.weight", (m.q_lora_rank,))
            a["q_b_proj"] = r.linear("self_attn.q_b_proj", Hm * m.qk_head_dim, m.q_lora_rank)
        a["kv_a_proj_with_mqa"] = r.linear("self_attn.kv_a_proj_with_mqa", c + m.qk_rope, D)
        a["kv_a_layernorm"] = r.take("self_attn.kv_a_layernorm.weight", (c,))
        a["kv_b_proj"] = r.linear("self_attn.kv_b_proj", Hm * (m.qk_nope + m.v_head_dim), c)
        a["o_proj"] = r.linear("self_attn.o_proj", D, Hm * m.v_head_dim)
    p["self_attn"] = a
    if spec.moe:
        E, I = m.num_experts, m.moe_intermediate
        Is = I * m.n_shared_experts
        gate_up = r.take("mlp.experts.gate_up_proj", (E, 2 * I, D))
        p["mlp"] = {
            "router": r.take("mlp.gate.weight", (E, D)).T,
            "expert_bias": r.take("mlp.gate.e_score_correction_bias", (E,)),
            "experts_gate": jnp.swapaxes(gate_up[:, :I], 1, 2),
            "experts_up": jnp.swapaxes(gate_up[:, I:], 1, 2),
            "experts_down": jnp.swapaxes(r.take("mlp.experts.down_proj", (E, D, I)), 1, 2),
            **{f"shared_{n}": r.linear(f"mlp.shared_experts.{n}", *shape)
               for n, shape in (("gate_proj", (Is, D)), ("up_proj", (Is, D)), ("down_proj", (D, Is)))},
        }
    else:
        Id = m.intermediate_size
        p["mlp"] = {n: r.linear(f"mlp.{n}", *shape)
                    for n, shape in (("gate_proj", (Id, D)), ("up_proj", (Id, D)), ("down_proj", (D, Id)))}
    r.leftover()
    return p
