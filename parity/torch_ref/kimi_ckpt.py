"""Random Kimi Linear checkpoints (issue 34 item 2, its first part): transformers' built-in `KimiLinearForCausalLM`
(`model_type: kimi_linear`, transformers >= 5.23) with seeded random weights, written by the built-in's own
`save_pretrained` (config.json, generation_config.json, model.safetensors), so `AutoModelForCausalLM.from_pretrained`
loads it with no remote code. `tools/make_ckpt.py --family kimi-linear --preset tiny --seed N --out DIR` is the CLI.

The weights are the built-in's own initialisation under `torch.manual_seed(seed)`, then the RMSNorm weights (every
`*norm*` parameter: the decoder norms, `o_norm`, MLA's `kv_a_layernorm`) and each router's `e_score_correction_bias`
moved off their init (ones / zeros) by seeded noise: a norm weight read from the wrong key, or a bias not applied,
then changes the output instead of multiplying by one or adding zero (the same perturbation as
tests/test_jax_kimi.py's fixture).

Presets: `tiny` — 4 layers (KDA + dense, MLA + MoE, KDA + MoE, MLA + dense), hidden 64, 8 experts in 2 groups,
the configuration tests/test_jax_kimi.py measures the JAX reference on. A real-shape preset after the published
Kimi-Linear-48B-A3B configuration is not here yet (docs/kimi_linear.md, "Not done yet").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parity.errors import CheckpointError, ConfigError
from parity.torch_ref.atomic_dir import refuse_existing, written_atomically

# tests/test_jax_kimi.py's configuration (its `tiny_config`): every layer kind, a grouped router, a shared expert.
KIMI_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
                 num_local_experts=8, n_shared_experts=1, routed_scaling_factor=2.446, initializer_range=0.1,
                 linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 3], "full_attn_layers": [2, 4]},  # 1-based, as checkpoints
                 mlp_layer_types=["dense", "sparse", "sparse", "dense"], pad_token_id=0, bos_token_id=1,
                 eos_token_id=2),
}
# the CPU-runnable attention and expert implementations of the built-in (no flash-attention, no grouped GEMM kernels)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
NORM_NOISE = 0.1  # std of the noise added to the norm weights and the router biases (a size, not a tolerance)


def kimi_config(preset: str, **over: Any):
    """The preset's `KimiLinearConfig` (eager attention and experts), fields overridden by `over`."""
    from transformers import KimiLinearConfig

    if preset not in KIMI_PRESETS:
        raise ConfigError(f"--preset {preset!r}: not a Kimi Linear preset; expected one of {sorted(KIMI_PRESETS)}")
    return KimiLinearConfig(**{**KIMI_PRESETS[preset], **EAGER, **over})


def kimi_model(preset: str, seed: int, gen=None):
    """The built-in `KimiLinearForCausalLM` of the preset in fp32, eval mode, with the seeded weights (module doc).
    `gen`: the torch.Generator of the perturbation (default: seeded with seed + 1); a caller that draws more from it
    afterwards (a prompt) gets a sequence that continues the weights'."""
    import torch
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(kimi_config(preset)).eval()
    gen = torch.Generator().manual_seed(seed + 1) if gen is None else gen
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(NORM_NOISE * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                b = gate.e_score_correction_bias
                b.copy_(NORM_NOISE * torch.randn(b.shape, generator=gen))
    return model


def make_kimi_checkpoint(out_dir: str | Path, preset: str, *, seed: int, dtype: str = "fp32",
                         force: bool = False) -> Path:
    """Write the preset's random Kimi Linear checkpoint to `out_dir` and return its path. Refuses an existing
    non-empty `out_dir` unless `force` (and then only one holding a config.json); written into a temporary sibling
    and renamed, so a crash leaves no half-written checkpoint (as `parity.torch_ref.ckpt.make_checkpoint`)."""
    import torch
    from transformers.utils import logging

    tdtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
              "float32": torch.float32}.get(dtype)
    if tdtype is None:
        raise ConfigError(f"--dtype {dtype!r}: expected bf16 or fp32")
    out = Path(out_dir)
    refuse_existing(out, force)
    logging.set_verbosity_error()  # the built-in's notices that its fla kernels are absent (expected on CPU)
    logging.disable_progress_bar()  # save_pretrained's shard bar: a one-file write needs none
    model = kimi_model(preset, seed).to(tdtype)
    with written_atomically(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    return out


def read_kimi_layers(ckpt_dir: str | Path, dtype: str) -> list:
    """[(spec, JAX params)] of every decoder layer of a Kimi Linear checkpoint directory, through transformers' own
    loader (`KimiLinearForCausalLM.from_pretrained`). The files hold the original checkpoint names, those that
    transformers' `conversion_mapping["kimi_linear"]` converts on load, not the built-in's module layout: its
    `save_pretrained` writes `block_sparse_moe.experts.{e}.w1/w2/w3`, `self_attn.f_a_proj`, `self_attn.q_conv1d`, ...
    and its loader turns them into `mlp.experts.gate_up_proj`, `self_attn.forget_gate.f_a_proj`, `self_attn.conv1d`,
    ... (transformers 5.23, measured on the tiny preset). The conversion is transformers', not re-written here;
    `parity.jax_kimi.weights.layer_params` reads the converted names. The whole model is loaded (a layer-at-a-time
    reader of the original names is not written yet)."""
    from transformers import KimiLinearForCausalLM
    from transformers.utils import logging

    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    root = Path(ckpt_dir)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json (expected a Kimi Linear checkpoint directory)")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        model = KimiLinearForCausalLM.from_pretrained(root, **EAGER)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{root}: transformers could not load it as KimiLinearForCausalLM ({e})") from None
    sd = model.state_dict()
    out = []
    for i in range(model.config.num_hidden_layers):
        spec = layer_spec(model.config, i, dtype)
        out.append((spec, layer_params(sd, i, spec)))
    return out
