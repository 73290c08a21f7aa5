"""Checkpoint maker: determinism, CLI overwrite guard, official layout, offline remote-code load + generate, and the
scales of the bundled checkpoints (activations of order 1 in every layer, routing spread over experts).

Measured on the bundled checkpoints (`python -m pytest tests/test_make_ckpt.py -q -p no:cacheprovider -s`, the
RMS table is printed), fp32 forward of 64 tokens:
  tiny:       residual-stream RMS per layer output 1.29 … 3.06, logits std 1.01; every MoE layer uses 16/16 experts,
              max expert share 0.133 of the routing slots (uniform 1/16 = 0.0625; bound 3× uniform)
  tiny-flash: residual-stream RMS 1.29 … 2.73, logits std 1.01; 16/16 experts per MoE layer, max share 0.109
  no token of either routes exactly as expert_bias alone would (bound 0.1)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.model.config import PRESETS, Ling3Config
from parity.errors import CheckpointError
from parity.torch_ref.ckpt import checkpoint_tensors, directory_digest, main, make_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_same_arguments_give_byte_identical_directories(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", seed=7, max_shard_bytes=1 << 20)
    b = make_checkpoint(tmp_path / "b", "tiny", seed=7, max_shard_bytes=1 << 20)
    c = make_checkpoint(tmp_path / "c", "tiny", seed=8, max_shard_bytes=1 << 20)
    da, db, dc = directory_digest(a), directory_digest(b), directory_digest(c)
    assert len(da) == 10 and da == db
    changed = {f for f in da if da[f] != dc[f]}
    assert changed == {f for f in da if f.endswith(".safetensors")}, changed  # the seed changes the weights only


@pytest.mark.parametrize("name", ["tiny", "tiny-flash"])
def test_bundled_checkpoint_regenerates_bit_identically(tmp_path, name):
    """The commands in dumps/ckpt/README.md reproduce the committed directories exactly."""
    readme = (REPO / "dumps" / "ckpt" / "README.md").read_text()
    cmd = next(l for l in readme.splitlines() if l.startswith(f"python tools/make_ckpt.py --preset {name} "))
    args = cmd.split()[2:]
    out_i = args.index("--out") + 1
    args[out_i] = str(tmp_path / name)
    assert main(args) == 0
    assert directory_digest(tmp_path / name) == directory_digest(REPO / "dumps" / "ckpt" / name)


def test_cli_refuses_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "ck"
    args = ["--preset", "tiny", "--seed", "0", "--out", str(out)]
    assert main(args) == 0
    before = directory_digest(out)
    assert main(args + ["--seed", "1"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert directory_digest(out) == before
    assert main(args + ["--seed", "1", "--force"]) == 0
    assert directory_digest(out) != before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="no config.json"):
        make_checkpoint(tmp_path / "other", "tiny", seed=0, force=True)
    assert (tmp_path / "other" / "notes.txt").exists()


def test_cli_script_runs_as_a_file(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "make_ckpt.py"), "--preset", "tiny-flash", "--seed", "0",
                        "--out", str(tmp_path / "x"), "--layers", "7", "--dtype", "fp32"],
                       capture_output=True, text=True, timeout=900)  # a hang guard, not a speed limit
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 7 and len(cfg["expert_swiglu_limit_list"]) == 7
    assert cfg["torch_dtype"] == "float32"
    assert any(k.startswith("model.layers.7.eh_proj") for k in
               json.loads((tmp_path / "x" / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("name", ["tiny", "tiny-flash"])
def test_official_layout(name):
    d = REPO / "dumps" / "ckpt" / name
    conf = json.loads((d / "config.json").read_text())
    assert "layer_types" not in conf  # official_remote_code.md §1.6
    assert conf["auto_map"] == {
        "AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
        "AutoModel": "modeling_bailing_moe_v3.BailingMoeV3Model",
        "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM",
    }
    cfg = Ling3Config.from_dict(conf)
    assert {k: v for k, v in conf.items() if k in PRESETS[name]} == PRESETS[name]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) >= 2 and shards == sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert list(index) == sorted(s.name for s in checkpoint_tensors(cfg))
    assert f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in index  # MTP layer present (facts §10.10)
    from safetensors import safe_open

    with safe_open(str(d / shards[0]), framework="pt") as f:
        t = f.get_tensor(next(iter(f.keys())))
    assert t.dtype == torch.bfloat16


def _load(path, **kw):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                output_loading_info=True, **kw)


def test_offline_remote_load_and_generate(tiny_ckpt, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, info = _load(tiny_ckpt)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    assert type(model).__name__ == "BailingMoeV3ForCausalLM"
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = tok("Ling3 parity, offline.", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "Ling3 parity, offline."
    assert int(ids.max()) < model.config.vocab_size
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 6)
    # generate()'s cached decode == full forward's greedy continuation (positions handled by generate)
    with torch.no_grad():
        full = model(out[:, :-1]).logits
    assert torch.equal(full[0, ids.shape[1] - 1:].argmax(-1), out[0, ids.shape[1]:])


@pytest.mark.parametrize("name", ["tiny", "tiny-flash"])
def test_bundled_activations_are_order_one_and_routing_spreads(name, capsys):
    d = REPO / "dumps" / "ckpt" / name
    model, _ = _load(d, attn_implementation="eager")
    cfg = model.config
    rms, used, share, bias_driven, m_bias = {}, {}, {}, {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers[: cfg.num_hidden_layers]):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: rms.__setitem__(i, o[0].pow(2).mean().sqrt().item())))
        if hasattr(layer.mlp, "gate"):
            def rec(m, a, o, i=i):
                idx = o.reshape(-1, o.shape[-1])
                counts = torch.bincount(idx.flatten(), minlength=cfg.num_experts)
                used[i], share[i] = int((counts > 0).sum()), (counts.max() / idx.numel()).item()
                by_bias = m_bias[i].topk(cfg.num_experts_per_tok).indices.sort().values
                bias_driven[i] = (idx.sort(-1).values == by_bias).all(-1).float().mean().item()
            hooks.append(layer.mlp.gate.tap_topk_idx.register_forward_hook(rec))
            m_bias[i] = layer.mlp.gate.expert_bias.float()
    ids = torch.randint(2, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    with capsys.disabled():
        print(f"\n{name}: layer-output RMS {[round(rms[i], 2) for i in sorted(rms)]}, logits std {logits.std():.2f}")
        print(f"{name}: experts used {used}, max expert share {max(share.values()):.3f}, "
              f"tokens routed as by the bias alone {max(bias_driven.values()):.3f}")
    assert all(0.3 < r < 10 for r in rms.values()), rms
    assert 0.3 < logits.std().item() < 10
    assert all(u >= cfg.num_experts * 3 // 4 for u in used.values()), used  # routing is not degenerate
    uniform = 1 / cfg.num_experts  # share of all k·T routing slots one expert gets under uniform routing
    assert max(share.values()) < 3 * uniform, share  # no expert takes (nearly) every token
    assert max(bias_driven.values()) < 0.1, bias_driven  # not-a-bound: a property of the generated weights; selection follows the logits, not expert_bias alone
