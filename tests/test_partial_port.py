"""Partial ports (issue 32 item 1): a target composed of a port's blocks (`parity.targets.partial.Part`) and the
reference for the rest, with per-point provenance in report.json, the terminal and the HTML report.

The worked example of docs/porting.md, portlike's KDA attention alone (`parity.targets.portlike:PortlikeKDAOnly`),
replays the bundled tiny-bf16 dump through `pytest parity` like any target; with portlike's softplus-gate bug in its
KDA part the first divergence is the KDA layer's attention block, marked `port` (so the part really runs), while the
same layer's MoE, computed by the reference, passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
BROKEN = '''
from parity.targets.portlike import PortlikeKDAOnly


class SoftplusKDA(PortlikeKDAOnly):
    def __init__(self, **kw):
        super().__init__("softplus_gate", **kw)
'''


def _layers():
    from parity.dumpfile import DumpReader

    with DumpReader(DUMP) as d:
        cfg = d.config
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    return kinds.index("kda"), kinds.index("mla")


def _run(tmp: Path, target: str, layers: str):
    out = tmp / "reports"
    env = {**os.environ, "PYTEST_ADDOPTS": "",
           "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0",
                        "--parity-dump", str(DUMP), "--parity-layers", layers, "--parity-target", target,
                        "--parity-report", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    return r, out / "tiny-bf16"


def _prov(rep: dict, layer, site: str) -> set:
    return {p.get("provenance") for p in rep["points"] if p["layer"] == layer and p["site"] == site
            and p["phase"] != "backward"}


def test_portlike_kda_only_replays_clean_with_provenance(tmp_path):
    kda, mla = _layers()
    r, rdir = _run(tmp_path, "parity.targets.portlike:PortlikeKDAOnly", f"{kda},{mla}")
    assert r.returncode == 0, r.stdout[-3000:]
    rep = json.loads((rdir / "report.json").read_text())
    assert rep["passed"] and rep["first_divergence"] is None
    assert _prov(rep, kda, "attention") == {"port"}
    assert _prov(rep, kda, "attention.core") == {"port"}  # the port part taps none: skipped, still the port's
    for site in ("input_layernorm", "post_attention_layernorm", "mlp", "output"):
        assert _prov(rep, kda, site) == {"reference"}, site
    assert _prov(rep, mla, "attention") == {"reference"}  # no part covers MLA layers
    assert _prov(rep, None, "logits") == {"reference"}
    compared_port = [p for p in rep["points"] if p.get("provenance") == "port" and p["status"] == "pass"]
    assert compared_port and {p["site"] for p in compared_port} == {"attention"}
    assert rep["provenance"]["port_sites"] == {f"L{kda:02d}": rep["provenance"]["port_sites"][f"L{kda:02d}"]}
    assert "provenance:" in r.stdout and f"port: L{kda:02d}: attention" in r.stdout
    assert "(port)" in (rdir / "report.html").read_text() or "port: L" in (rdir / "report.html").read_text()
    assert rep["target_info"]["parts"][0]["block"] == "attention"


def test_a_bug_in_the_port_part_is_placed_at_a_port_site(tmp_path):
    kda, _ = _layers()
    (tmp_path / "brokenkda.py").write_text(BROKEN)
    r, rdir = _run(tmp_path, "brokenkda:SoftplusKDA", str(kda))
    assert r.returncode == 1, r.stdout[-3000:]
    rep = json.loads((rdir / "report.json").read_text())
    fd = rep["first_divergence"]
    assert (fd["layer"], fd["site"], fd["provenance"]) == (kda, "attention", "port")
    # the reference's input norm, computed before the port's block, passes (later blocks inherit the error)
    assert {p["status"] for p in rep["points"] if p["layer"] == kda and p["site"] == "input_layernorm"} == {"pass"}


def test_the_pieces_give_the_whole_layers_bits():
    """PartialTarget with a part that is the reference's own attention block: every point bit-identical to the
    reference's whole-layer function (the composition adds no rounding), on a KDA and an MLA layer."""
    from parity.dumpfile import DumpReader
    from parity.jax_ling3.weights import CheckpointReader
    from parity.model.points import Point
    from parity.replay.session import find_checkpoint
    from parity.targets.partial import Part, PartialTarget, PartResult
    from parity.targets.reference import ReferenceTarget

    class RefAttention(Part):
        kinds = ("kda", "mla")

        def __init__(self):
            self.ref = ReferenceTarget()

        def build(self, config, dtype):
            super().build(config, dtype)
            self.ref.build(config, dtype)

        def load(self, i, hf):
            self.ref.load_layer(i, hf)

        def forward(self, i, x, positions, state=None, forced_topk=None):
            import jax.numpy as jnp

            from parity.jax_ling3 import blocks
            from parity.jax_ling3.mla import init_mla_cache

            spec = self.ref.spec(i)
            if state is None and spec.kind == "mla":
                state = init_mla_cache(x.shape[0], x.shape[1] + 128, spec)
            a, pts, st = blocks.attention(self.ref.params[i], jnp.asarray(x), jnp.asarray(positions), spec=spec,
                                          state=state)
            return PartResult(np.asarray(a), {k: np.asarray(v) for k, v in pts.items()}, st)

    with DumpReader(DUMP) as d:
        cfg, fp = d.config, d.fingerprint
        inputs = {i: d.read(Point("prefill", 0, i, "input")) for i in _layers()}
    ck = CheckpointReader(find_checkpoint(fp))
    ref, comp = ReferenceTarget(), PartialTarget(RefAttention())
    for t in (ref, comp):
        t.build(cfg, "bfloat16")
    for i, h in inputs.items():
        hf = ck.hf_tensors(i)
        ref.load_layer(i, hf)
        comp.load_layer(i, hf)
        pos = np.arange(h.shape[1])
        a, b = ref.layer_forward(i, h, pos), comp.layer_forward(i, h, pos)
        assert np.array_equal(np.asarray(a.output).view(np.uint16), np.asarray(b.output).view(np.uint16)), i
        for site, v in a.points.items():
            w = b.points.get(site)
            assert w is not None, (i, site)
            v, w = np.asarray(v), np.asarray(w)
            assert v.dtype == w.dtype and v.shape == w.shape and v.tobytes() == w.tobytes(), (i, site)
