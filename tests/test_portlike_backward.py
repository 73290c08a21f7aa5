"""The suite's VJP helper (`parity.targets.backward.layer_vjp`) serving a port that is not the reference (issue 26
item 2): the port-shaped flax-nnx target `portlike` gets capability `backward` with no hand-written backward.

- its gradient name map is the inverse of its loader: the port's parameter *values* mapped back through
  `port_grads_to_hf` give the checkpoint's HF tensors bit for bit (every trainable parameter, every layer kind);
- a --grads golden replays clean through `--parity-target portlike` (the pytest plugin, as a user runs it): dL/d layer
  input and every weight gradient compared and passing, the sub-module cotangents skipped with the port's reason;
- a planted backward-only bug (`beta_detached`: stop_gradient on the KDA b_proj output) keeps every forward point
  passing and is pinned at backward grad.attention.b_proj.weight of the replayed KDA layer, fp32 and bf16.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = {"float32": ("tiny-fp32.h5", "tiny"), "bfloat16": ("tiny-flash-bf16.h5", "tiny-flash")}


@pytest.mark.parametrize("preset", ["tiny", "tiny-flash"])
def test_port_grad_names_invert_the_loader(preset):
    from flax import nnx

    from parity.jax_ling3.weights import CheckpointReader
    from parity.model.config import Ling3Config
    from parity.model.points import backward_param_sites
    from parity.targets.portlike import PortlikeTarget, port_grads_to_hf

    ck = ROOT / "dumps/ckpt" / preset
    cfg = Ling3Config.from_pretrained_dir(ck, strict=False)
    reader = CheckpointReader(ck)
    t = PortlikeTarget()
    t.build(cfg, "float32")
    kinds = set()
    for i in range(cfg.num_hidden_layers):
        key = (cfg.layer_kind(i), cfg.is_moe(i))
        if key in kinds:
            continue
        kinds.add(key)
        hf = reader.hf_tensors(i)
        t.load_layer(i, hf)
        _, state = nnx.split(t.blocks[i])
        back = port_grads_to_hf(cfg, i, nnx.to_pure_dict(state))
        want = {s.removeprefix("grad.") for s in backward_param_sites(cfg, i)}
        assert set(back) == want, (i, sorted(set(back) ^ want)[:6])
        for k, v in back.items():
            ref = np.asarray(hf[f"model.layers.{i}.{k}"], np.float32)
            assert v.shape == ref.shape and np.array_equal(np.asarray(v, np.float32), ref), (i, k)
    assert len(kinds) >= 3


def test_port_grad_names_refuse_an_unknown_parameter():
    from parity.model.config import Ling3Config
    from parity.targets.portlike import port_grads_to_hf

    cfg = Ling3Config.from_pretrained_dir(ROOT / "dumps/ckpt/tiny", strict=False)
    with pytest.raises(KeyError, match="mixer.new_thing has no entry in PORT_TO_JAX"):
        port_grads_to_hf(cfg, 0, {"mixer": {"new_thing": np.zeros(2)}})


def test_golden_replays_clean_through_the_plugin_with_portlike():
    """`pytest parity --parity-dump dumps/tiny-fp32.h5 --parity-target portlike -k "backward and (layer_1 or
    model)"`: exit 0, every weight gradient and dL/d input compared and passing, nothing failing."""
    out = subprocess.run([sys.executable, "-m", "pytest", "parity", "--parity-dump", str(ROOT / "dumps/tiny-fp32.h5"),
                          "--parity-target", "portlike", "-k", "backward and (layer_1 or model)", "-q", "-rs",
                          "-p", "no:cacheprovider", "-n", "0"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    import re

    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= 60, tail  # layer 1 (MoE): 16 experts x 3 + the rest; model: 7 sites
    assert " failed" not in out.stdout and " error" not in out.stdout.lower().replace("errors=", ""), tail
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("no sub-module cotangents" in line for line in skips), skips[:3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planted_backward_bug_in_portlike_is_pinned(dtype):
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay
    from parity.targets.portlike import PortlikeTarget

    dump = ROOT / "dumps" / GOLDEN[dtype][0]
    with DumpReader(dump) as d:
        cfg = d.config
    i = next(j for j in range(cfg.num_hidden_layers) if cfg.layer_kind(j) == "kda")
    ok = run_replay(dump, target=PortlikeTarget(), layers=[i])
    bad = [(p["phase"], p["site"], p["status"]) for p in ok["points"] if p["status"] in ("fail", "missing")]
    assert not bad, bad[:5]
    rep = run_replay(dump, target=PortlikeTarget("beta_detached"), layers=[i])
    assert not [p for p in rep["points"] if p["phase"] != "backward" and p["status"] == "fail"]
    assert not rep["passed"]
    src = rep["first_divergence"]["source"]
    assert (src["phase"], src["layer"], src["site"]) == ("backward", i, "grad.attention.b_proj.weight"), src
