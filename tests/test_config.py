"""Ling3Config against the facts sheet (§1, §2) — expected values come from the facts sheet, not from the code."""

import copy
import json

import pytest

from parity.model.config import LING3_FLASH_CONFIG, LING3_TINY_CONFIG, PRESETS, Ling3Config
from parity.errors import ConfigError


def test_tiny_layout_facts_2():
    c = Ling3Config.from_dict(LING3_TINY_CONFIG)
    assert c.mla_layers == [3, 7, 11, 15, 19, 23]  # facts §2 [5x]
    assert len(c.kda_layers) == 18
    assert c.dense_layers == [0]
    assert c.mtp_layer_index == 24
    assert c.mtp_key_prefix == "model.layers.24."
    assert c.q_lora and c.q_lora_rank == 256
    assert c.kda_head_dim == 128 and c.qk_head_dim == 192  # seed 000 §3.2: two different head dims
    assert c.kda_proj_size == 2048
    assert c.attention_scale == pytest.approx(192 ** -0.5)
    assert not c.has_swiglu_clamp
    assert c.expert_swiglu_limit(5) is None


def test_flash_layout_and_clamp_facts_1_5():
    c = Ling3Config.from_dict(LING3_FLASH_CONFIG)
    assert c.mla_layers == [5, 11, 17, 23, 29, 35, 41]
    assert c.dense_layers == [0, 1]
    assert c.mtp_layer_index == 42
    assert not c.q_lora
    assert c.kda_proj_size == 4096
    # routed clamp 4.0 at 35..41, shared 5.0 at 34..39 and 7.0 at 40..41, else off; MTP (42) off (facts §1, §5.7)
    assert [c.expert_swiglu_limit(i) for i in (34, 35, 41, 42)] == [None, 4.0, 4.0, None]
    assert [c.shared_swiglu_limit(i) for i in (33, 34, 39, 40, 41, 42)] == [None, 5.0, 5.0, 7.0, 7.0, None]
    assert c.layer_kind(42) == "mla" and c.is_moe(42)


def test_ragged_tail_is_mla():
    d = dict(LING3_TINY_CONFIG, num_hidden_layers=10, layer_group_size=4)  # floor(10/4)*4 = 8 -> 8, 9 MLA
    c = Ling3Config.from_dict(d)
    assert c.mla_layers == [3, 7, 8, 9]
    assert Ling3Config.from_dict(PRESETS["tiny-flash"]).layer_kinds == ["kda"] * 5 + ["mla"] * 3


def test_aliases_are_folded_and_conflicts_rejected():
    d = dict(LING3_TINY_CONFIG)
    d.pop("n_group")
    d.pop("num_experts_per_tok")
    d["num_expert_group"] = 8
    d["num_experts_per_token"] = 8
    d["moe_renormalize"] = True
    c = Ling3Config.from_dict(d)
    assert c.n_group == 8 and c.num_experts_per_tok == 8
    bad = dict(LING3_TINY_CONFIG, num_expert_group=4)
    with pytest.raises(ConfigError, match="num_expert_group.*contradicts 'n_group'"):
        Ling3Config.from_dict(bad)


@pytest.mark.parametrize(
    "arch, what",
    [("BailingMoeV2_5ForCausalLM", "Ling 2.5"), ("LlamaForCausalLM", "not a Ling3 model")],
)
def test_dispatch_on_architectures(arch, what):
    d = dict(LING3_TINY_CONFIG, architectures=[arch])  # same model_type bailing_hybrid
    with pytest.raises(ConfigError, match=what):
        Ling3Config.from_dict(d)


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"qk_head_dim": 128}, "qk_head_dim"),
        ({"num_experts": 100}, "not divisible by n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts_per_tok": 80}, "num_experts_per_tok"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"expert_swiglu_limit_list": [4.0] * 3}, "expert_swiglu_limit_list"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"kda_lower_bound": -7.0}, "kda_lower_bound"),
        ({"some_new_field": 1}, "unknown field"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ],
)
def test_inconsistent_fields_fail_clearly(patch, needle):
    d = dict(LING3_TINY_CONFIG, **patch)
    with pytest.raises(ConfigError, match=needle) as e:
        Ling3Config.from_dict(d, source="ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json:")
    assert "\n" not in str(e.value)


def test_missing_field_and_lenient_unknowns():
    d = copy.deepcopy(LING3_TINY_CONFIG)
    del d["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        Ling3Config.from_dict(d)
    c = Ling3Config.from_dict(dict(LING3_TINY_CONFIG, some_new_field=1), strict=False)
    assert c.unknown_fields == ("some_new_field",)


def test_from_json_errors(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Ling3Config.from_json(p)
    with pytest.raises(ConfigError, match="cannot read"):
        Ling3Config.from_json(tmp_path / "missing.json")
    p.write_text(json.dumps(LING3_FLASH_CONFIG))
    assert Ling3Config.from_pretrained_dir(tmp_path).num_hidden_layers == 42


@pytest.mark.parametrize("layer_types, needle", [
    (None, None),  # absent (official checkpoints): fine
    (["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"], None),
    (["linear_attention"] * 3 + ["mla"] + ["linear_attention"] * 3 + ["full_attention"],
     "field 'layer_types'[3] = 'mla', expected 'linear_attention' (KDA) or 'full_attention' (MLA)"),
    (["full_attention"] + ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
     "field 'layer_types'[0] = 'full_attention', but layer 0 is KDA by the Ling3 layout rule (layer_group_size 4"),
    (["linear_attention"] * 4, "field 'layer_types' = ['linear_attention', 'linear_attention', 'linear_attention', "
                               "'linear_attention'], expected a list of num_hidden_layers = 8 entries"),
    ("linear_attention", "field 'layer_types' = linear_attention, expected a list"),
])
def test_layer_types_must_name_the_ling3_layout(layer_types, needle):
    """`layer_types` (written by transformers' built-in) is not read by any Ling3 code; an unknown value or another
    layout than the one every runtime builds is refused, in strict and lenient mode alike."""
    d = copy.deepcopy(LING3_TINY_CONFIG)
    d["num_hidden_layers"] = 8
    d.pop("expert_swiglu_limit_list", None), d.pop("share_expert_swiglu_limit_list", None)
    if layer_types is not None:
        d["layer_types"] = layer_types
    for strict in (True, False):
        if needle is None:
            assert Ling3Config.from_dict(d, strict=strict).layer_kinds[3] == "mla"
        else:
            with pytest.raises(ConfigError) as e:
                Ling3Config.from_dict(d, source="c.json", strict=strict)
            assert str(e.value).startswith("c.json: " + needle), str(e.value)
