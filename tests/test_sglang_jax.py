"""The sglang_jax adapter on the real port (runs where sglang-jax is installed; skips with how to install otherwise).

Measured in a separate venv (README "Testing your port"); here one KDA and one MLA layer of the bundled fp32 tiny
dump: every tapped site is produced, the MLA layer matches the reference, and the KDA layer departs first at the
decay gate — the port calls `chunk_kda` without `lower_bound`, so it computes the Kimi softplus gate, not Ling3's
lower-bound gate (facts §3.5); checked against a float64 numpy evaluation of both formulas.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity.targets.sglang_jax import INSTALL_HINT

try:
    import sgl_jax.srt.models.bailing_moe_v3  # noqa: F401
except ImportError:
    pytest.skip(INSTALL_HINT, allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fp32_replay():
    from parity.replay import run_replay
    from parity.targets.sglang_jax import SglangJaxTarget

    return run_replay(REPO / "dumps" / "tiny-fp32.h5", target=SglangJaxTarget(), layers=[1, 3])


def test_mla_layer_matches_and_kda_layer_departs_at_the_gate(fp32_replay):
    pts = [p for p in fp32_replay["points"] if p["layer"] in (1, 3) and p["phase"] == "prefill"]
    l3 = {p["site"]: p["status"] for p in pts if p["layer"] == 3}
    assert all(s == "pass" for site, s in l3.items() if site != "attention.gate"), l3
    assert l3["attention.gate"] == "skipped"  # computed inline by the port: said, not silently dropped
    fd = fp32_replay["first_divergence"]
    assert (fd["layer"], fd["site"], fd["source"]["site"]) == (1, "attention.gate", "attention.gate")
    compared = sum(p["status"] != "skipped" for p in pts)
    assert compared / len(pts) >= 0.8


def test_port_gate_is_the_softplus_form_by_numpy():
    from safetensors import safe_open

    from parity.dumpfile import DumpReader
    from parity.points import Point
    from parity.targets.sglang_jax import SglangJaxTarget

    d = DumpReader(REPO / "dumps" / "tiny-fp32.h5")
    ck = REPO / "dumps" / "ckpt" / "tiny"
    wm = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]

    def w(k):
        with safe_open(str(ck / wm[k]), "flax") as h:
            return np.asarray(h.get_tensor(k)).astype(np.float64)

    A, dtb = w("model.layers.1.attention.A_log"), w("model.layers.1.attention.dt_bias")
    t = SglangJaxTarget()
    t.build(d.config, "float32")
    t.use_checkpoint_dir(ck)
    x = d.read(Point("prefill", 0, 1, "input"))
    r = t.layer_forward(1, x, np.arange(x.shape[1]))
    a = r.points["attention.f_proj"].astype(np.float64)  # the port's own gate input
    B, T, P = a.shape
    H = A.shape[0]
    z = a.reshape(B, T, H, P // H) + dtb.reshape(H, -1)
    rate = np.exp(A).reshape(H, 1)
    kimi = -rate * np.log1p(np.exp(z))
    ling3 = -5.0 / (1 + np.exp(-rate * z))
    port = r.points["attention.gate"].astype(np.float64).reshape(kimi.shape)
    rel = lambda u, v: np.linalg.norm(u - v) / np.linalg.norm(v)  # noqa: E731
    assert rel(port, kimi) < 1e-4 < 0.5 < rel(port, ling3)
