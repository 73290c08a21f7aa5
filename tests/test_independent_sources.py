"""Every independent source in one run (issue 32 item 2): after a failing layer-mode replay, the failing sites of the
layer are re-run on their own dumped inputs; each site that fails there is listed as an independent source.

Planted here: two independent bugs in the first KDA layer's attention block — the recurrence without the
head_dim^-1/2 scale (`attention.core`, the catalogue's kda_scale_missing maths) and the gated output norm gated
with SiLU instead of sigmoid (`attention.o_norm`; facts §3.7: FusedRMSNormGated, activation sigmoid). Both are
patched into the shared jax_ling3 functions, so the layer and isolated runs see the same bugs. One `pytest parity`
run must name both; with the core bug alone it names one; the first divergence is the same in both runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
TARGETS = '''
from parity.targets.mutants import Expected, Mutation, MutantTarget


def _core_unscaled():
    from parity.jax_ling3 import kda
    kernels = {k: (lambda f: lambda q, k, v, g, beta, scale, s0=None, **kw: f(q, k, v, g, beta, 1.0, s0, **kw))(f)
               for k, f in kda.KERNELS.items()}
    return {(kda, "KERNELS"): kernels}


def _o_norm_silu():
    import jax
    import jax.numpy as jnp
    from parity.jax_ling3 import kda, norms

    def gnorm(o, gate, w, eps):
        of = o.astype(jnp.float32)
        y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(o.dtype)
    return {(kda, "gated_rms_norm"): gnorm, (norms, "gated_rms_norm"): gnorm}


def _target(name, patches):
    class T(MutantTarget):
        def __init__(self, **kw):
            super().__init__("kda_scale_missing", **kw)  # a catalogue name to construct; its bug replaced below
            self.mutation = Mutation(name, name, "tiny", lambda cfg: Expected("prefill", 0, 0, ()), patches)
            self.name = f"reference+{name}"
    return T


OneBug = _target("core_unscaled", _core_unscaled)
TwoBugs = _target("core_unscaled+o_norm_silu", lambda: {**_core_unscaled(), **_o_norm_silu()})
'''


def _first_kda() -> int:
    from parity.dumpfile import DumpReader

    with DumpReader(DUMP) as d:
        cfg = d.config
    return next(i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("indep")
    (tmp / "twobugs.py").write_text(TARGETS)
    env = {**os.environ, "PYTEST_ADDOPTS": "",
           "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    layer = _first_kda()
    out = {}
    for name in ("OneBug", "TwoBugs"):
        r = subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "-n", "0",
                            "--parity-dump", str(DUMP), "--parity-layers", str(layer), "--parity-target",
                            f"twobugs:{name}", "--parity-report", str(tmp / name)],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        assert r.returncode == 1, r.stdout[-3000:]
        out[name] = (r.stdout, json.loads((tmp / name / "tiny-bf16" / "report.json").read_text()))
    return layer, out


def _sources(rep: dict) -> list[tuple]:
    return [(e["layer"], e["site"]) for e in rep["independent_sources"] if "site" in e]


def test_two_planted_bugs_in_one_layer_are_both_named(runs):
    layer, out = runs
    stdout, rep = out["TwoBugs"]
    assert _sources(rep) == [(layer, "attention.core"), (layer, "attention.o_norm")]
    assert (f"independent sources L{layer:02d} (each fails on its own dumped inputs): attention.core, "
            "attention.o_norm") in stdout
    # the failures downstream of them (o_proj, the MoE, the output) inherit: marked so, not listed
    inherited = [p for p in rep["points"] if p.get("independent_source") is False]
    assert inherited and not any(p["site"] in ("attention.core", "attention.o_norm") for p in inherited)


def test_a_single_bug_names_one_and_the_first_divergence_is_unchanged(runs):
    layer, out = runs
    _, one = out["OneBug"]
    _, two = out["TwoBugs"]
    assert _sources(one) == [(layer, "attention.core")]
    key = lambda fd: (fd["phase"], fd["step"], fd["layer"], fd["site"], fd["source"]["site"])  # noqa: E731
    assert key(one["first_divergence"]) == key(two["first_divergence"])
    assert two["first_divergence"]["source"]["site"] == "attention.core"


def test_a_target_without_isolated_is_told_so():
    from types import SimpleNamespace

    from parity.replay.independent import annotate

    s = SimpleNamespace(mode="layer", target=SimpleNamespace(name="myport", capabilities=frozenset()))
    recs = [{"phase": "prefill", "step": 0, "layer": 2, "site": "attention.core", "status": "fail"},
            {"phase": "prefill", "step": 0, "layer": 2, "site": "mlp", "status": "pass"}]
    annotate(s, 2, recs)
    assert "lacks capability isolated" in recs[0]["independent_source_note"] and "myport" in recs[0][
        "independent_source_note"]
    assert "independent_source_note" not in recs[1]


def test_isolated_mode_summary_says_fails_on_its_own_inputs():
    from parity.reporting.report import summary_text

    fd = {"phase": "prefill", "step": 0, "layer": 0, "site": "attention.o_norm", "max_ulp": 9,
          "source": {"phase": "prefill", "step": 0, "layer": 0, "site": "attention.o_norm"}}
    rep = {"dump": "d.h5", "target": "t", "mode": "isolated", "passed": False, "counts": {}, "points": [],
           "first_divergence": fd}
    text = summary_text(rep)
    assert "fails on its own dumped inputs" in text and "inherit" not in text
    assert "later failures inherit it" in summary_text(dict(rep, mode="layer"))
