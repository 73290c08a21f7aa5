"""Random Kimi Linear checkpoints (`tools/make_ckpt.py --family kimi-linear`, parity.torch_ref.kimi_ckpt; issue 34
item 2's first part), used as a user would: the CLI writes a directory that transformers' own loader reads as the
built-in `KimiLinearForCausalLM` (no remote code) with every weight it saved, bit for bit (fp32) or as their bf16
rounding (bf16), and the same logits; the files hold the original checkpoint names
(`block_sparse_moe.experts.{e}.w1`), not the module names; the same arguments give the same bytes; the JAX reference's layer params read from the directory
equal those of the in-memory model; bad arguments get one line and leave nothing behind."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from parity.torch_ref.ckpt import directory_digest, main
from parity.torch_ref.kimi_ckpt import kimi_model, read_kimi_layers


def _make(out, *extra) -> int:
    return main(["--family", "kimi-linear", "--preset", "tiny", "--seed", "3", "--out", str(out), "--dtype", "fp32",
                 *extra])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi") / "tiny"
    assert _make(out) == 0
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_builtin_loads_every_saved_weight_and_gives_the_same_logits(ckpt, tmp_path, dtype):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, KimiLinearForCausalLM

    path = ckpt if dtype == "fp32" else tmp_path / "bf16"
    if dtype == "bf16":
        assert _make(path, "--dtype", "bf16") == 0
    loaded, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, attn_implementation="eager",
                                                        experts_implementation="eager")
    assert type(loaded) is KimiLinearForCausalLM
    assert not any(info.values()), f"{path}: loading info not clean: {info}"
    made = kimi_model("tiny", 3).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    want, got = made.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k}: the loaded weight differs from the written one"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:  # the original names on disk
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in keys
    assert not any(".mlp.experts.gate_up_proj" in k for k in keys)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, made(ids).logits, rtol=0, atol=0)


def test_same_arguments_same_bytes(ckpt, tmp_path):
    assert _make(tmp_path / "again") == 0
    assert directory_digest(tmp_path / "again") == directory_digest(ckpt)
    other = main(["--family", "kimi-linear", "--preset", "tiny", "--seed", "4", "--dtype", "fp32", "--out",
                  str(tmp_path / "s4")])
    assert other == 0 and directory_digest(tmp_path / "s4") != directory_digest(ckpt)


def test_layer_params_read_from_the_directory_equal_the_written_models(ckpt):
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    layers = read_kimi_layers(ckpt, "float32")
    model = kimi_model("tiny", 3)
    assert len(layers) == model.config.num_hidden_layers
    for i, (spec, p) in enumerate(layers):
        want = layer_params(model.state_dict(), i, layer_spec(model.config, i, "float32"))
        assert spec == layer_spec(model.config, i, "float32")
        flat_got, tree_got = jax.tree_util.tree_flatten(p)
        flat_want, tree_want = jax.tree_util.tree_flatten(want)
        assert tree_got == tree_want, f"layer {i}: another parameter tree"
        for a, b in zip(flat_got, flat_want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_arguments_get_one_line_and_leave_nothing(ckpt, tmp_path, capsys):
    before = directory_digest(ckpt)
    assert _make(ckpt) == 2  # exists, no --force
    assert "already exists" in capsys.readouterr().err
    assert directory_digest(ckpt) == before
    assert _make(tmp_path / "x", "--gate-form", "softplus") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gate-form is a Ling3 option" in err, err
    assert not (tmp_path / "x").exists()
    assert main(["--preset", "ling3-tiny", "--family", "kimi-linear", "--seed", "0", "--out", str(tmp_path / "y")]) == 2
    assert "not a Kimi Linear preset" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert _make(tmp_path / "z", "--keep-layers", "0,9") == 2  # the tiny preset has 4 layers
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--keep-layers 0,9" in err and "0..3" in err, err
    assert not (tmp_path / "z").exists()
    assert main(["--preset", "ling3-tiny", "--seed", "0", "--out", str(tmp_path / "w"), "--keep-layers", "0"]) == 2
    assert "--keep-layers is a Kimi Linear option" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------ the real-shape preset
def _meta_model(**kw):
    """The built-in of the 48b-a3b preset on torch's meta device: shapes and names, no memory."""
    from transformers import KimiLinearForCausalLM

    from parity.torch_ref.kimi_ckpt import kimi_config

    with torch.device("meta"):
        return KimiLinearForCausalLM(kimi_config("48b-a3b", **kw))


def test_48b_a3b_preset_is_the_published_model():
    """Independent of the code: the published checkpoint (moonshotai/Kimi-Linear-48B-A3B-Instruct) holds
    49,122,681,728 parameters in its safetensors (its index's total), full attention at the 1-based layers
    4, 8, ..., 24, 27 of its config.json and one dense layer (first_k_dense_replace = 1)."""
    model = _meta_model()
    assert sum(t.numel() for t in model.state_dict().values()) == 49_122_681_728
    cfg = model.config
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"] == [0]


def test_48b_a3b_kept_layers_have_the_published_shapes():
    """`--keep-layers 0,1,3`: the published layers 0 (KDA + dense), 1 (KDA + MoE) and 3 (MLA + MoE), renumbered, with
    the published checkpoint's weight shapes (its weight table, in the built-in's module layout: the three q/k/v
    convs [4096, 1, 4] stacked into `conv1d`, the 256 experts' w1/w3 [1024, 2304] into `gate_up_proj`, w2 into
    `down_proj`)."""
    sd = {k: tuple(v.shape) for k, v in _meta_model(keep_layers=[0, 1, 3]).state_dict().items()}
    want = {
        "model.layers.0.self_attn.q_proj.weight": (4096, 2304), "model.layers.0.self_attn.k_proj.weight": (4096, 2304),
        "model.layers.0.self_attn.v_proj.weight": (4096, 2304), "model.layers.0.self_attn.conv1d.weight": (12288, 1, 4),
        "model.layers.0.self_attn.forget_gate.f_a_proj.weight": (128, 2304),
        "model.layers.0.self_attn.forget_gate.A_log": (1, 1, 32, 1),
        "model.layers.0.self_attn.forget_gate.dt_bias": (4096,), "model.layers.0.self_attn.b_proj.weight": (32, 2304),
        "model.layers.0.self_attn.g_a_proj.weight": (128, 2304), "model.layers.0.mlp.gate_proj.weight": (9216, 2304),
        "model.layers.1.self_attn.q_proj.weight": (4096, 2304),
        "model.layers.1.mlp.experts.gate_up_proj": (256, 2048, 2304),
        "model.layers.1.mlp.experts.down_proj": (256, 2304, 1024),
        "model.layers.1.mlp.gate.e_score_correction_bias": (256,),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (1024, 2304),
        "model.layers.2.self_attn.q_proj.weight": (6144, 2304),
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": (576, 2304),
        "model.layers.2.self_attn.kv_b_proj.weight": (8192, 512),
        "model.layers.2.self_attn.o_proj.weight": (2304, 4096),
        "model.layers.2.mlp.experts.gate_up_proj": (256, 2048, 2304),
        "model.embed_tokens.weight": (163840, 2304), "lm_head.weight": (163840, 2304),
    }
    assert {k: sd.get(k) for k in want} == want
    assert not any(k.startswith("model.layers.3.") for k in sd)
