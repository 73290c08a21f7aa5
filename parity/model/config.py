"""Ling3Config: the structure of a Ling3 model read from an HF `config.json`.

Field names are the official checkpoint's (facts sheet §1). Aliases used by ports (seed 000 §3.1, transformers'
built-in `bailing_hybrid` attribute_map) are accepted and folded into the official name; giving both an alias and
its official name with different values is an error.

Dispatch is on `architectures[0]`, not `model_type`: Ling 2.5/2.6 (`BailingMoeV2_5ForCausalLM`) share
`model_type: bailing_hybrid` (facts §1).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from parity.errors import ConfigError

LING3_ARCHITECTURE = "BailingMoeV3ForCausalLM"
# Other architectures that share model_type bailing_hybrid and must be rejected by name.
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the HF class-default eps, not rms_norm_eps (facts §4.2)
KNOWN_OTHER_ARCHITECTURES = {
    "BailingMoeV2_5ForCausalLM": "Ling 2.5/2.6 (lightning/GLA attention), not Ling3",
    "BailingMoeV2ForCausalLM": "Ling 2.0 (BailingMoeV2), not Ling3",
    "BailingMoeForCausalLM": "Ling 1.x (BailingMoe), not Ling3",
}

LayerKind = Literal["kda", "mla"]

# alias -> official field name (seed 000 §3.1; transformers bailing_hybrid attribute_map; facts §1)
ALIASES: dict[str, str] = {
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "scoring_func": "score_function",
    "moe_router_activation_func": "score_function",
    "mla_use_nope": "use_mla_nope",
    "num_local_experts": "num_experts",
    "n_shared_experts": "num_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
}

# Keys a Ling3 config.json may carry that the model code does not read (facts §1 "dead keys", generic HF
# PretrainedConfig keys, E0's pregate_* fields). Anything outside KNOWN is rejected in strict mode so that a
# field with semantics this suite does not model never passes silently.
IGNORED_KEYS = frozenset(
    """
    architectures model_type auto_map transformers_version torch_dtype dtype _name_or_path
    use_cache bos_token_id initializer_range pretraining_tp output_hidden_states output_attentions
    return_dict attention_bias attention_dropout embedding_dropout output_dropout hidden_dropout
    use_qk_norm group_norm_size linear_silu max_window_layers num_kv_heads_for_linear_attn use_kda_lora
    value_norm up_proj_norm use_nGPT scale_router_input seq_aux output_router_logits
    mtp_loss_scaling_factor mtp_use_kda rotary_dim partial_rotary_factor topk_method router_dtype
    moe_router_enable_expert_bias quantization_config pregate_inference pregate_hidden_size
    pregate_num_layers pregate_type router_aux_loss_coef aux_loss_alpha generation_config
    layer_types mlp_layer_types rope_parameters id2label label2id tokenizer_class
    """.split()
)


@dataclass(frozen=True)
class Ling3Config:
    """A validated Ling3 config. Construct with `from_dict` / `from_json` / `from_pretrained_dir`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # KDA head size (128); NOT the MLA q/k head dim (seed 000 §3.2)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    layer_group_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    q_lora_rank: int | None = None
    num_key_value_heads: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    num_shared_experts: int | None = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    rope_theta: float = 6_000_000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float | None = -5.0
    gated_attention_proj_granularity_type: str = "head_wise"
    expert_swiglu_limit_list: tuple[float, ...] | None = None
    share_expert_swiglu_limit_list: tuple[float, ...] | None = None
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = False
    use_mla_nope: bool = False
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    qk_head_dim_field: int | None = None  # config.json's own `qk_head_dim`, if given (checked, §1)
    architecture: str = LING3_ARCHITECTURE
    unknown_fields: tuple[str, ...] = field(default=())
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json", strict: bool = True) -> "Ling3Config":
        """Validate and build. `strict` rejects keys this suite does not know (DESIGN §10)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ConfigError(
                f"{source}: field 'architectures' is missing or not a list; expected ['{LING3_ARCHITECTURE}'] "
                "(dispatch is on architectures[0] because Ling 2.5 shares model_type bailing_hybrid)"
            )
        arch = archs[0]
        if arch != LING3_ARCHITECTURE:
            what = KNOWN_OTHER_ARCHITECTURES.get(arch, "not a Ling3 model")
            raise ConfigError(
                f"{source}: architectures[0] is '{arch}' ({what}); this suite handles '{LING3_ARCHITECTURE}' only"
            )
        mt = d.get("model_type")
        if mt not in (None, "bailing_hybrid", ""):
            raise ConfigError(f"{source}: model_type is '{mt}', expected 'bailing_hybrid' for {LING3_ARCHITECTURE}")

        own = {f.name for f in fields(cls)} - {"qk_head_dim_field", "architecture", "unknown_fields", "raw"}
        vals: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in d.items():
            name = ALIASES.get(key, key)
            if key == "qk_head_dim":
                vals["qk_head_dim_field"] = value
                continue
            if name in own:
                if name in vals and vals[name] != value:
                    raise ConfigError(
                        f"{source}: field '{key}' (alias of '{name}') = {value!r} contradicts '{name}' = {vals[name]!r}"
                    )
                vals[name] = value
            elif key not in IGNORED_KEYS:
                unknown.append(key)
        if unknown and strict:
            raise ConfigError(
                f"{source}: unknown field(s) {sorted(unknown)} — not a Ling3 config field this suite models; "
                "pass strict=False to load anyway (they are then listed in Ling3Config.unknown_fields)"
            )
        missing = [f.name for f in fields(cls) if f.name not in vals and _is_required(f)]
        if missing:
            raise ConfigError(f"{source}: missing required Ling3 field(s) {missing}")
        for lst in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if vals.get(lst) is not None:
                if not isinstance(vals[lst], (list, tuple)):
                    raise ConfigError(f"{source}: field '{lst}' must be a list of numbers or null, got {vals[lst]!r}")
                vals[lst] = tuple(float(x or 0.0) for x in vals[lst])
        cfg = cls(**vals, architecture=arch, unknown_fields=tuple(sorted(unknown)), raw=dict(d))
        cfg._validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path, *, strict: bool = True) -> "Ling3Config":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror or e})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        return cls.from_dict(d, source=str(path), strict=strict)

    @classmethod
    def from_pretrained_dir(cls, ckpt_dir: str | Path, *, strict: bool = True) -> "Ling3Config":
        p = Path(ckpt_dir)
        if not p.is_dir():
            raise ConfigError(f"{p}: not a checkpoint directory")
        return cls.from_json(p / "config.json", strict=strict)

    # ------------------------------------------------------------------ validation
    def _validate(self, source: str) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "layer_group_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                     "topk_group", "short_conv_kernel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(f"field '{name}' = {v!r}, expected a positive integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise bad(f"field 'q_lora_rank' = {self.q_lora_rank!r}, expected a positive integer or null")
        if not (0 <= self.first_k_dense_replace <= self.num_hidden_layers):
            raise bad(f"field 'first_k_dense_replace' = {self.first_k_dense_replace}, expected 0..num_hidden_layers")
        if self.qk_head_dim_field is not None and self.qk_head_dim_field != self.qk_head_dim:
            raise bad(
                f"field 'qk_head_dim' = {self.qk_head_dim_field} but qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim} + {self.qk_rope_head_dim} = {self.qk_head_dim}"
            )
        if self.qk_rope_head_dim % 2:
            raise bad(f"field 'qk_rope_head_dim' = {self.qk_rope_head_dim}, expected an even number (RoPE pairs)")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise bad(
                f"field 'num_key_value_heads' = {self.num_key_value_heads}, expected num_attention_heads = "
                f"{self.num_attention_heads} (Ling3 KDA and MLA use full heads, facts §1)"
            )
        if not self.rope_interleave:
            raise bad("field 'rope_interleave' = false: the official code crashes on that branch (facts §1); expected true")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise bad(f"field 'rope_scaling' = {self.rope_scaling!r}, expected null or an object")
            rt = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rt not in (None, "default"):
                raise bad(f"field 'rope_scaling' has rope_type '{rt}': only unscaled RoPE is modelled (facts §4.4)")
        if self.num_experts % self.n_group:
            raise bad(f"num_experts = {self.num_experts} is not divisible by n_group = {self.n_group}")
        if self.topk_group > self.n_group:
            raise bad(f"topk_group = {self.topk_group} > n_group = {self.n_group}")
        if self.num_experts // self.n_group < 2:
            raise bad(f"each of n_group = {self.n_group} groups must hold >= 2 experts (group score = top-2 sum, facts §5.3)")
        if self.num_experts_per_tok > (self.num_experts // self.n_group) * self.topk_group:
            raise bad(
                f"num_experts_per_tok = {self.num_experts_per_tok} > experts in the kept groups "
                f"({self.num_experts // self.n_group} × topk_group {self.topk_group})"
            )
        if self.score_function not in ("sigmoid",):
            raise bad(f"field 'score_function' = '{self.score_function}', expected 'sigmoid' (facts §5)")
        if self.hidden_act != "silu":
            raise bad(f"field 'hidden_act' = '{self.hidden_act}', expected 'silu' (facts §5.6)")
        if self.gated_attention_proj_granularity_type != "head_wise":
            raise bad(
                f"field 'gated_attention_proj_granularity_type' = '{self.gated_attention_proj_granularity_type}', "
                "expected 'head_wise' (facts §4.6)"
            )
        if not self.no_kda_lora:
            raise bad("field 'no_kda_lora' = false (f/g LoRA pairs) is not a Ling3 layout (facts §3.1); expected true")
        if self.kda_lower_bound is not None and not (-5.0 <= self.kda_lower_bound < 0):
            raise bad(f"field 'kda_lower_bound' = {self.kda_lower_bound}, expected -5 <= lb < 0 or null (facts §3.5)")
        if self.num_shared_experts is not None and self.num_shared_experts < 0:
            raise bad(f"field 'num_shared_experts' = {self.num_shared_experts}, expected >= 0 or null")
        if self.num_nextn_predict_layers < 0:
            raise bad(f"field 'num_nextn_predict_layers' = {self.num_nextn_predict_layers}, expected >= 0")
        self._validate_layer_types(bad)
        for lst in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            v = getattr(self, lst)
            if v is not None:
                if len(v) != self.num_hidden_layers:
                    raise bad(f"field '{lst}' has {len(v)} entries, expected num_hidden_layers = {self.num_hidden_layers}")
                if any(x < 0 or not math.isfinite(x) for x in v):
                    raise bad(f"field '{lst}' holds a negative or non-finite limit: {list(v)}")

    def _validate_layer_types(self, bad) -> None:
        """`layer_types` is read by no Ling3 code (the layout comes from layer_group_size, facts §2; transformers'
        built-in writes it): where present it must name that same layout, in the built-in's words."""
        lt = self.raw.get("layer_types")
        if lt is None:
            return
        names = {"kda": "linear_attention", "mla": "full_attention"}
        if not isinstance(lt, list) or len(lt) != self.num_hidden_layers:
            raise bad(f"field 'layer_types' = {str(lt)[:80]}, expected a list of num_hidden_layers = "
                      f"{self.num_hidden_layers} entries 'linear_attention' | 'full_attention' (or no such field)")
        for i, v in enumerate(lt):
            if v not in names.values():
                raise bad(f"field 'layer_types'[{i}] = {v!r}, expected 'linear_attention' (KDA) or "
                          "'full_attention' (MLA)")
        for i, v in enumerate(lt):
            want = names[self.layer_kind(i)]
            if v != want:
                raise bad(f"field 'layer_types'[{i}] = {v!r}, but layer {i} is {self.layer_kind(i).upper()} by the "
                          f"Ling3 layout rule (layer_group_size {self.layer_group_size}, facts §2): expected {want!r}")

    # ------------------------------------------------------------------ derived structure
    @property
    def qk_head_dim(self) -> int:
        """MLA q/k head dim (nope + rope = 192); the softmax scale is its -1/2 power (facts §4.4)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_head_dim(self) -> int:
        """KDA head size (128) — the config's `head_dim` (seed 000 §3.2)."""
        return self.head_dim

    @property
    def kda_proj_size(self) -> int:
        """P = H·d, width of KDA q/k/v/f/g projections (facts §3)."""
        return self.num_attention_heads * self.head_dim

    @property
    def q_lora(self) -> bool:
        return self.q_lora_rank is not None

    @property
    def shared_intermediate_size(self) -> int:
        """Shared expert width = moe_shared_expert_intermediate_size × num_shared_experts (facts §5.5)."""
        base = self.moe_shared_expert_intermediate_size or self.moe_intermediate_size
        return base * (self.num_shared_experts or 0)

    @property
    def has_shared_expert(self) -> bool:
        return bool(self.num_shared_experts)

    def layer_kind(self, i: int) -> LayerKind:
        """MLA iff (i+1) % g == 0 or i >= floor(n/g)*g (ragged tail is MLA), else KDA (facts §2).

        MTP layers (i = num_hidden_layers + j, j < max(1, num_nextn_predict_layers)) are always MLA (facts §2).
        """
        n, g = self.num_hidden_layers, self.layer_group_size
        if n <= i < n + max(1, self.num_nextn_predict_layers):
            return "mla"
        if not 0 <= i < n:
            raise ConfigError(f"layer index {i} out of range 0..{n - 1} (MTP layers are "
                              f"{n}..{n + max(1, self.num_nextn_predict_layers) - 1})")
        if (i + 1) % g == 0 or i >= (n // g) * g:
            return "mla"
        return "kda"

    @property
    def layer_kinds(self) -> list[LayerKind]:
        return [self.layer_kind(i) for i in range(self.num_hidden_layers)]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.layer_kind(i) == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.layer_kind(i) == "kda"]

    def is_moe(self, i: int) -> bool:
        """Dense SwiGLU MLP iff i < first_k_dense_replace, else MoE; the MTP layer is MoE (facts §2)."""
        return i >= self.first_k_dense_replace

    @property
    def dense_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_moe(i)]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe(i)]

    @property
    def mtp_layer_index(self) -> int:
        """Index of the MTP layer in the checkpoint (`model.layers.{N}`), N = num_hidden_layers (facts §2).

        Present in Flash (num_nextn_predict_layers=1) and, per SJ, in the Tiny checkpoint too despite 0 (facts §10.10):
        loaders treat its keys as skippable either way.
        """
        return self.num_hidden_layers

    @property
    def mtp_key_prefix(self) -> str:
        return f"model.layers.{self.mtp_layer_index}."

    def mtp_key_prefixes(self) -> list[str]:
        """Prefixes of every MTP layer a checkpoint may hold (at least one, see mtp_layer_index)."""
        count = max(1, self.num_nextn_predict_layers)
        return [f"model.layers.{self.num_hidden_layers + k}." for k in range(count)]

    def expert_swiglu_limit(self, i: int) -> float | None:
        """Routed-expert SwiGLU clamp limit of layer i, None when off (0/null/out of list: MTP) (facts §5.7)."""
        return _limit(self.expert_swiglu_limit_list, i)

    def shared_swiglu_limit(self, i: int) -> float | None:
        """Shared-expert SwiGLU clamp limit of layer i, None when off (facts §5.7)."""
        return _limit(self.share_expert_swiglu_limit_list, i)

    @property
    def has_swiglu_clamp(self) -> bool:
        return any(
            self.expert_swiglu_limit(i) or self.shared_swiglu_limit(i) for i in range(self.num_hidden_layers)
        )

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def attention_scale(self) -> float:
        """MLA softmax scale 192^-1/2 (qk_head_dim, not v_head_dim) (facts §4.4)."""
        return self.qk_head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict this config was read from (official names; aliases as given)."""
        return dict(self.raw)

    def summary(self) -> str:
        kinds = "".join("M" if k == "mla" else "K" for k in self.layer_kinds)
        return (
            f"Ling3 {self.num_hidden_layers} layers [{kinds}] D={self.hidden_size} H={self.num_attention_heads} "
            f"q_lora={self.q_lora_rank} E={self.num_experts} top{self.num_experts_per_tok} "
            f"dense={self.dense_layers} mtp={self.mtp_layer_index} clamp={self.has_swiglu_clamp}"
        )


# What each settable field's value must be (`field_value_error`, `tools/make_ckpt.py --set`): (check, expected).
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


_VALUE_KINDS: dict[str, tuple] = {
    "int": (_is_int, "an integer"),
    "float": (_is_num, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "tuple[float, ...]": (lambda v: isinstance(v, (list, tuple)) and all(_is_num(x) for x in v), "a list of numbers"),
    "list[int]": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
}


def settable_fields() -> list[str]:
    """The config.json fields Ling3Config models (official names), the ones `--set key=value` accepts."""
    return sorted(f.name for f in fields(Ling3Config)
                  if f.name not in ("qk_head_dim_field", "architecture", "unknown_fields", "raw"))


def field_value_error(key: str, value: Any) -> str | None:
    """None when `value` has the type field `key` (official name or alias) takes, else one line naming the key and
    what was expected. Range rules are the config's own (`Ling3Config.from_dict` checks them afterwards)."""
    name = ALIASES.get(key, key)
    if name not in settable_fields():
        return (f"'{key}' is not a Ling3 config field this suite models; expected one of "
                + ", ".join(settable_fields()))
    ann = {f.name: f.type for f in fields(Ling3Config)}[name]
    kinds = [k.strip() for k in str(ann).split("|")]
    if value is None:
        return None if "None" in kinds else f"'{key}' = null, expected {_expected(kinds)}"
    if any(_VALUE_KINDS[k][0](value) for k in kinds if k in _VALUE_KINDS):
        return None
    return f"'{key}' = {json.dumps(value)}, expected {_expected(kinds)}"


def _expected(kinds: list[str]) -> str:
    return " or ".join(_VALUE_KINDS[k][1] if k in _VALUE_KINDS else "null" for k in kinds)


def _is_required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _limit(lst: tuple[float, ...] | None, i: int) -> float | None:
    if lst is None or not 0 <= i < len(lst):
        return None
    v = lst[i]
    return float(v) if v else None


# --------------------------------------------------------------------------------------------- presets
# Real config.json field values (facts sheet §1). Used by tests and by tools/make_ckpt.py for real shapes.
LING3_TINY_CONFIG: dict[str, Any] = {
    "architectures": [LING3_ARCHITECTURE],
    "model_type": "bailing_hybrid",
    "vocab_size": 157184,
    "hidden_size": 1536,
    "intermediate_size": 4608,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_head_dim": 192,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    # facts §1 gives 6e6 (AU/E0/CE); seed 000 §1.1 says 10000 — the facts sheet is multi-sourced, we follow it.
    "rope_theta": 6000000,
    "rope_scaling": None,
    "rope_interleave": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "layer_group_size": 4,
    "first_k_dense_replace": 1,
    "short_conv_kernel_size": 4,
    "no_kda_lora": True,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 512,
    "moe_shared_expert_intermediate_size": 512,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "router_dtype": "fp32",
    "gated_attention_proj_granularity_type": "head_wise",
    "expert_swiglu_limit_list": None,
    "share_expert_swiglu_limit_list": None,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "eos_token_id": 156895,
    "pad_token_id": 156892,
    "use_qkv_bias": False,
    "use_bias": False,
}

LING3_FLASH_CONFIG: dict[str, Any] = {
    **LING3_TINY_CONFIG,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "max_position_embeddings": 262144,
    "layer_group_size": 6,
    "first_k_dense_replace": 2,
    "num_experts": 512,
    "moe_intermediate_size": 768,
    "moe_shared_expert_intermediate_size": 768,
    # facts §1 [RS]: routed clamp 4.0 at layers 35–41; shared 5.0 at 34–39, 7.0 at 40–41; else 0.
    "expert_swiglu_limit_list": [0.0] * 35 + [4.0] * 7,
    "share_expert_swiglu_limit_list": [0.0] * 34 + [5.0] * 6 + [7.0] * 2,
    "num_nextn_predict_layers": 1,
}

# Small presets for the bundled random checkpoints (tools/make_ckpt.py). They keep every structural feature of the
# real models while staying a few MB: `tiny` is Tiny-shaped (q-LoRA, group 4, 1 dense layer, MTP layer present in
# the checkpoint); `tiny-flash` is Flash-shaped (no q-LoRA, group 6 with a ragged MLA tail 6-7, 2 dense layers,
# SwiGLU clamp on some layers — limits small enough to bite on order-1 activations, so a missing clamp shows).
TINY_PRESET_CONFIG: dict[str, Any] = {
    **LING3_TINY_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "rotary_dim": 8,
    "max_position_embeddings": 4096,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_nextn_predict_layers": 0,  # as shipped Tiny: 0, yet the checkpoint holds model.layers.8.* (facts §10.10)
    "eos_token_id": 1,
    "pad_token_id": 0,
}

TINY_FLASH_PRESET_CONFIG: dict[str, Any] = {
    **TINY_PRESET_CONFIG,
    "q_lora_rank": None,
    "layer_group_size": 6,  # 8 layers: KKKKKM + ragged tail MM
    "first_k_dense_replace": 2,
    "expert_swiglu_limit_list": [0.0] * 6 + [1.0] * 2,
    "share_expert_swiglu_limit_list": [0.0] * 5 + [1.5] * 3,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY_PRESET_CONFIG,
    "tiny-flash": TINY_FLASH_PRESET_CONFIG,
    "ling3-tiny": LING3_TINY_CONFIG,
    "ling3-flash": LING3_FLASH_CONFIG,
}


def checkpoint_config(ckpt_dir: str | Path) -> Ling3Config:
    """A Ling3 checkpoint directory's config, validated as a dump needs it (`Ling3Config.from_pretrained_dir`, lenient
    on fields the suite does not read): the family's config check (`parity.model.families.LING3`, `tools/dump_hf.py`)."""
    return Ling3Config.from_pretrained_dir(ckpt_dir, strict=False)
