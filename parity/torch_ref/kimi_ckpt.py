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
the configuration tests/test_jax_kimi.py measures the JAX reference on. `48b-a3b` — the published configuration of
moonshotai/Kimi-Linear-48B-A3B-Instruct (`PUBLISHED_48B_A3B`, its config.json), every layer's shapes as published;
`keep_layers` (the CLI's `--keep-layers 0,3`) keeps some of its 27 layers (each with its published kind), since one
MoE layer alone holds 1.8 G parameters. A real-shape model is built in the dtype it is written in (bf16: 2 bytes per
parameter; the tiny preset is built in fp32 and then cast, as before).
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
# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json as published (transformers_version 4.57.1; read from a verbatim
# copy with the checkpoint's weight table, 2026-11-29, docs/kimi_linear.md), less `architectures`, `auto_map`,
# `model_type`, `transformers_version` and `dtype` (not configuration fields of the built-in; the dtype is the CLI's).
# Its keys are the remote code's: transformers' KimiLinearConfig maps them (num_experts -> num_local_experts,
# num_experts_per_token -> num_experts_per_tok, num_shared_experts -> n_shared_experts, num_expert_group -> n_group,
# moe_renormalize -> norm_topk_prob) and reads the layer kinds from linear_attn_config's 1-based lists.
PUBLISHED_48B_A3B: dict[str, Any] = {
    "bos_token_id": 163584, "eos_token_id": 163586, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1, "use_cache": True,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}
KIMI_PRESETS["48b-a3b"] = PUBLISHED_48B_A3B
REAL_SHAPE = frozenset({"48b-a3b"})  # built in the written dtype (module doc)

# the CPU-runnable attention and expert implementations of the built-in (no flash-attention, no grouped GEMM kernels)
EAGER = dict(attn_implementation="eager", experts_implementation="eager")
NORM_NOISE = 0.1  # std of the noise added to the norm weights and the router biases (a size, not a tolerance)


def kimi_config(preset: str, keep_layers: list[int] | None = None, **over: Any):
    """The preset's `KimiLinearConfig` (eager attention and experts), fields overridden by `over`. `keep_layers`: the
    preset's layers to keep, in this order, each with its own attention and MLP kind (renumbered 0..n-1)."""
    from transformers import KimiLinearConfig

    if preset not in KIMI_PRESETS:
        raise ConfigError(f"--preset {preset!r}: not a Kimi Linear preset; expected one of {sorted(KIMI_PRESETS)}")
    fields = {**KIMI_PRESETS[preset], **EAGER, **over}
    if keep_layers is not None:
        full = KimiLinearConfig(**fields)
        n = full.num_hidden_layers
        bad = [i for i in keep_layers if not 0 <= i < n]
        if not keep_layers or bad or len(set(keep_layers)) != len(keep_layers):
            raise ConfigError(f"--keep-layers {','.join(map(str, keep_layers))}: expected distinct layer numbers "
                              f"0..{n - 1} of the {preset} preset's {n} layers")
        kinds = [full.layer_types[i] for i in keep_layers]
        lin = dict(fields.get("linear_attn_config") or {})
        lin["kda_layers"] = [j + 1 for j, t in enumerate(kinds) if t == "linear_attention"]  # 1-based, as published
        lin["full_attn_layers"] = [j + 1 for j, t in enumerate(kinds) if t == "full_attention"]
        fields.update(num_hidden_layers=len(keep_layers), linear_attn_config=lin,
                      mlp_layer_types=[full.mlp_layer_types[i] for i in keep_layers])
    return KimiLinearConfig(**fields)


def kimi_model(preset: str, seed: int, gen=None, keep_layers: list[int] | None = None, dtype=None):
    """The built-in `KimiLinearForCausalLM` of the preset, eval mode, with the seeded weights (module doc), built in
    `dtype` (a torch dtype; default fp32). `gen`: the torch.Generator of the perturbation (default: seeded with
    seed + 1); a caller that draws more from it afterwards (a prompt) gets a sequence that continues the weights'."""
    import torch
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    config = kimi_config(preset, keep_layers)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        model = KimiLinearForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)
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
                         force: bool = False, keep_layers: list[int] | None = None) -> Path:
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
    model = kimi_model(preset, seed, keep_layers=keep_layers, dtype=tdtype if preset in REAL_SHAPE else None).to(tdtype)
    with written_atomically(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    return out


def load_kimi_model(ckpt_dir: str | Path, dtype: str = "float32"):
    """The checkpoint directory's `KimiLinearForCausalLM` through transformers' own loader (which converts the files'
    original names: `read_kimi_layers`), eager attention and experts, in `dtype` ("float32" or "bfloat16"), eval
    mode. A directory that is not a Kimi Linear checkpoint is refused in one line (`CheckpointError`)."""
    import torch
    from transformers import KimiLinearForCausalLM
    from transformers.utils import logging

    root = Path(ckpt_dir)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json (expected a Kimi Linear checkpoint directory)")
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if tdtype is None:
        raise ConfigError(f"dtype {dtype!r}: expected float32 or bfloat16")
    logging.set_verbosity_error()  # the built-in's notices that its fla kernels are absent (expected on CPU)
    logging.disable_progress_bar()
    try:
        return KimiLinearForCausalLM.from_pretrained(root, dtype=tdtype, **EAGER).eval()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{root}: transformers could not load it as KimiLinearForCausalLM ({e})") from None


def read_kimi_layers(ckpt_dir: str | Path, dtype: str) -> list:
    """[(spec, JAX params)] of every decoder layer of a Kimi Linear checkpoint directory, through transformers' own
    loader (`load_kimi_model`). The files hold the original checkpoint names, those that transformers'
    `conversion_mapping["kimi_linear"]` converts on load, not the built-in's module layout: its `save_pretrained`
    writes `block_sparse_moe.experts.{e}.w1/w2/w3`, `self_attn.f_a_proj`, `self_attn.q_conv1d`, ... and its loader
    turns them into `mlp.experts.gate_up_proj`, `self_attn.forget_gate.f_a_proj`, `self_attn.conv1d`, ...
    (transformers 5.23, measured on the tiny preset). The conversion is transformers', not re-written here;
    `parity.jax_kimi.weights.layer_params` reads the converted names. The whole model is loaded (a layer-at-a-time
    reader of the original names is not written yet)."""
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    model = load_kimi_model(ckpt_dir)
    sd = model.state_dict()
    out = []
    for i in range(model.config.num_hidden_layers):
        spec = layer_spec(model.config, i, dtype)
        out.append((spec, layer_params(sd, i, spec)))
    return out
