"""BailingMoeV3Config for the ling3-parity *twin* remote code (Ling3 = HF `bailing_hybrid`, `BailingMoeV3ForCausalLM`).

Self-contained (imports only transformers): this file is copied into checkpoint directories and loaded through
`auto_map` with `trust_remote_code=True` — by the twin, and by the official `modeling_bailing_moe_v3.py` when
`parity.torch_ref.official.install` puts that file into a checkpoint: it defines every attribute the official file
reads (tests/test_official.py lists them from the file's syntax tree). Field names and defaults follow the official `config.json` (facts sheet §1,
Ling-3.0-tiny values). Deliberately NO `layer_types` attribute: with one, `DynamicCache(config=...)` builds
linear-attention cache layers and the official cache layout breaks in `generate()` (official_remote_code.md §1.6).

Twin-only switches (all read with getattr defaults by the modeling file, so a config without them works):
- `twin_apply_swiglu_clamp` (default True): apply the SwiGLU clamp lists as the serving stacks do (facts §5.7, §10.1);
  False reproduces the official remote code, which ignores them.
- `twin_quirk_noncausal_sdpa`, `twin_quirk_uninit_inv_freq`, `twin_quirk_cache_len_from_layer0` (default False):
  reproduce the official file's measured traps on transformers 5.23 (official_remote_code.md §1.4, §2, §3).
"""

from transformers import PretrainedConfig


class BailingMoeV3Config(PretrainedConfig):
    model_type = "bailing_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=157184,
        hidden_size=1536,
        intermediate_size=4608,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=6_000_000.0,
        rope_scaling=None,
        rope_interleave=True,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        layer_group_size=4,
        first_k_dense_replace=1,
        short_conv_kernel_size=4,
        no_kda_lora=True,
        kda_safe_gate=True,
        kda_lower_bound=-5.0,
        num_experts=128,
        num_experts_per_tok=8,
        num_shared_experts=1,
        moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        score_function="sigmoid",
        gated_attention_proj_granularity_type="head_wise",
        expert_swiglu_limit_list=None,
        share_expert_swiglu_limit_list=None,
        num_nextn_predict_layers=0,
        hidden_act="silu",
        use_qkv_bias=False,
        use_bias=False,
        initializer_range=0.006,
        use_cache=True,
        attention_dropout=0.0,
        mtp_loss_scaling_factor=0.0,
        output_router_logits=False,
        tie_word_embeddings=False,
        pad_token_id=156892,
        eos_token_id=156895,
        bos_token_id=None,
        twin_apply_swiglu_clamp=True,
        twin_quirk_noncausal_sdpa=False,
        twin_quirk_uninit_inv_freq=False,
        twin_quirk_cache_len_from_layer0=False,
        **kwargs,
    ):
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type")) if isinstance(rope_scaling, dict) else None
            if rtype not in (None, "default"):
                raise ValueError(
                    f"BailingMoeV3Config: rope_scaling={rope_scaling!r}; the twin models unscaled RoPE only "
                    "(shipped Ling3 configs have rope_scaling null, facts §1/§4.4)"
                )
        if not rope_interleave:
            raise ValueError("BailingMoeV3Config: rope_interleave=false is a deliberate crash in the official file (facts §1)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_theta = rope_theta
        # `rope_scaling` is validated above and not stored: on transformers 5.x it is a property aliasing
        # `rope_parameters` that rewrites null into {rope_type: default} (official_remote_code.md §1.5), and only
        # null/default (no scaling) is accepted, so it carries no information.
        self.rope_interleave = rope_interleave
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.layer_group_size = layer_group_size
        self.first_k_dense_replace = first_k_dense_replace
        self.short_conv_kernel_size = short_conv_kernel_size
        self.no_kda_lora = no_kda_lora
        self.kda_safe_gate = kda_safe_gate
        self.kda_lower_bound = kda_lower_bound
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.score_function = score_function
        self.gated_attention_proj_granularity_type = gated_attention_proj_granularity_type
        self.expert_swiglu_limit_list = expert_swiglu_limit_list
        self.share_expert_swiglu_limit_list = share_expert_swiglu_limit_list
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # Read by the official modeling file (MLA dropout in training, the MTP loss weight, the MoE router-logit
        # outputs): every attribute it reads must exist (tests/test_official.py derives the list from its source).
        self.attention_dropout = attention_dropout
        self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
        self.output_router_logits = output_router_logits
        self.twin_apply_swiglu_clamp = twin_apply_swiglu_clamp
        self.twin_quirk_noncausal_sdpa = twin_quirk_noncausal_sdpa
        self.twin_quirk_uninit_inv_freq = twin_quirk_uninit_inv_freq
        self.twin_quirk_cache_len_from_layer0 = twin_quirk_cache_len_from_layer0
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        # `rope_scaling` stays a plain None (official_remote_code.md §1.5): 5.x's PretrainedConfig turns it into
        # {rope_type: default, rope_theta} (then the official MLA reads ["factor"]: KeyError), and without any value
        # `config.rope_scaling` raises AttributeError (5.x aliases it to `rope_parameters`). Set under its 5.x name,
        # after the base class (whose `rope_scaling` setter warns).
        self.rope_parameters = None
        # Guard against a `layer_types` sneaking in through kwargs (see module docstring).
        if "layer_types" in self.__dict__:
            del self.__dict__["layer_types"]


__all__ = ["BailingMoeV3Config"]
