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
