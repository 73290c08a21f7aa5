"""Dot precision (issue 31 item 2): the matmul-precision policy target calls run under, the planted port as TPU runs
it at JAX's default precision (`mutants.PlantedTpuDefaultPrecision`), and the dot-precision shadow whose match names
the diagnosis "dot precision" (with the fix) instead of "semantic".

Independent reference for the planted emulation: numpy, float64 products of the operands rounded to bf16 (what one
bf16 MXU pass with fp32 accumulation computes, up to the accumulation order)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from bounds import DOT_FP32_VS_FP64_REL
from parity.errors import ParityError
from parity.replay.matmul_policy import FIX, resolve_policy, under_policy

ROOT = Path(__file__).resolve().parents[1]
FP32, BF16 = ROOT / "dumps" / "tiny-fp32.h5", ROOT / "dumps" / "tiny-bf16.h5"


def test_policy_default_is_highest_and_an_unknown_one_is_refused():
    assert resolve_policy(None)["policy"] == "highest"
    assert resolve_policy("default") == {"policy": "default", "source": "--parity-matmul-precision"}
    with pytest.raises(ParityError, match="--parity-matmul-precision 'fastest': expected one of default, high, hi"):
        resolve_policy("fastest")


def test_policy_is_in_force_in_the_thread_that_runs_the_call():
    """The watchdog runs target calls on its own thread; JAX's precision context is thread-local."""
    import jax

    seen = {}

    def read(key):
        seen[key] = jax.config.jax_default_matmul_precision

    for policy in ("highest", "high", "default"):
        t = threading.Thread(target=under_policy(policy, read), args=(policy,))
        t.start()
        t.join()
    assert seen == {"highest": "highest", "high": "high", "default": jax.config.jax_default_matmul_precision}


def test_cpu_ignores_the_matmul_precision_config():
    """Why the planted port rounds explicitly: XLA:CPU gives the same fp32 dot bits under 'bfloat16' as under
    'highest' (should a jax version honour it on CPU, this fails and the policy becomes observable here too)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((32, 48), np.float32), rng.standard_normal((48, 16), np.float32)
    out = {}
    for p in ("bfloat16", "highest"):
        with jax.default_matmul_precision(p):
            out[p] = np.asarray(jax.jit(lambda x, y: jnp.einsum("ij,jk->ik", x, y))(a, b))
    assert np.array_equal(out["bfloat16"], out["highest"])


def _layer0(target, precision):
    """Layer 0 (KDA) of tiny-fp32, prefill, under `jax.default_matmul_precision(precision)`."""
    import jax

    from parity.dumpfile import DumpReader
    from parity.jax_ling3.weights import CheckpointReader
    from parity.model.points import Point

    with DumpReader(FP32) as d:
        x = d.read(Point("prefill", 0, 0, "input"))
        target.build(d.config, "float32")
    hf = CheckpointReader(ROOT / "dumps" / "ckpt" / "tiny").hf_tensors(0)
    target.load_layer(0, hf)
    with jax.default_matmul_precision(precision):
        r = target.layer_forward(0, x, np.arange(x.shape[1]))
    return r.points, hf


def test_planted_port_rounds_dot_operands_only_at_default_precision():
    from parity.targets.mutants import PlantedTpuDefaultPrecision
    from parity.targets.reference import ReferenceTarget

    ref, hf = _layer0(ReferenceTarget(), "highest")
    hi, _ = _layer0(PlantedTpuDefaultPrecision(), "highest")
    lo, _ = _layer0(PlantedTpuDefaultPrecision(), "default")
    assert np.array_equal(hi["attention.q_proj"], ref["attention.q_proj"])  # the policy in force: the same bits
    # at DEFAULT: one bf16 pass — numpy on the bf16-rounded operands, float64 products (independent of jax)
    import ml_dtypes

    x = lo["input_layernorm"].astype(ml_dtypes.bfloat16).astype(np.float64)
    w = hf["model.layers.0.attention.q_proj.weight"].astype(ml_dtypes.bfloat16).astype(np.float64)
    want = x @ w.T
    scale = np.sqrt(np.mean(want ** 2))
    assert float(np.abs(lo["attention.q_proj"] - want).max() / scale) <= DOT_FP32_VS_FP64_REL  # accumulation order only
    assert np.abs(ref["attention.q_proj"] - want).max() > 1e-4 * scale  # not-a-bound: IEEE fp32 dots are visibly not this (10x the bound above)


# ------------------------------------------------------------------------------------------------ the diagnosis
@pytest.fixture(scope="module")
def planted_reports():
    """The planted port replayed at JAX's default precision (`--parity-matmul-precision default`) on layer 0 and
    the model points of tiny-fp32 and tiny-bf16."""
    from parity.replay import run_replay
    from parity.targets.mutants import PlantedTpuDefaultPrecision

    return {d.name: run_replay(d, target=PlantedTpuDefaultPrecision, layers=[0], matmul_precision="default")
            for d in (FP32, BF16)}


def test_diagnosis_names_dot_precision_and_the_fix(planted_reports):
    from parity.reporting.report import markdown, summary_text
    from parity.reporting.triage import triage

    fp32, bf16 = planted_reports[FP32.name], planted_reports[BF16.name]
    assert fp32["replay_env"]["matmul_precision"]["policy"] == "default"
    assert not fp32["passed"] and fp32["counts"]["fail"] > 50
    dp = fp32["dot_precision"]
    assert dp["explained"] == dp["failing"] and dp["first"]["site"] == "attention.q_proj" and dp["fix"] == FIX
    t = triage(fp32, bf16)
    assert (t["first_dot_precision"]["layer"], t["first_dot_precision"]["site"]) == (0, "attention.q_proj")
    assert t["first_semantic"] is None and t["first_precision"] is None
    assert {s["diagnosis"] for s in t["sites"]} == {"dot precision"}
    text = summary_text(dict(fp32, triage=t))
    assert "DOT PRECISION" in text and "first dot precision" in text and "--parity-matmul-precision highest" in text
    assert "## Dot precision" in markdown(fp32)
    assert "--parity-matmul-precision default" in text  # the reproduce command replays it the same way


def test_diagnosis_is_semantic_when_the_shadow_is_broken(planted_reports, monkeypatch):
    """The recognition's failing case: a 'shadow' that is the plain reference explains nothing, and the triage
    falls back to semantic at the same site (what it said before issue 31)."""
    from parity.replay import dot_precision, run_replay
    from parity.reporting.triage import triage
    from parity.targets.mutants import PlantedTpuDefaultPrecision
    from parity.targets.reference import ReferenceTarget

    def plain_reference(s):
        return s.shadows.target("broken", lambda: ReferenceTarget(**s.fork_options("dump")))

    monkeypatch.setattr(dot_precision, "shadow_target", plain_reference)
    fp32 = run_replay(FP32, target=PlantedTpuDefaultPrecision, layers=[0], matmul_precision="default")
    assert fp32["dot_precision"]["explained"] == 0 and fp32["dot_precision"]["fix"] is None
    t = triage(fp32, planted_reports[BF16.name])
    assert t["first_dot_precision"] is None
    assert (t["first_semantic"]["layer"], t["first_semantic"]["site"]) == (0, "attention.q_proj")


def test_policy_in_force_passes_the_planted_port():
    """The default policy (highest): the planted port's dots are exact, 0 failed (layer 0 + model points)."""
    from parity.replay import run_replay
    from parity.targets.mutants import PlantedTpuDefaultPrecision

    rep = run_replay(FP32, target=PlantedTpuDefaultPrecision, layers=[0])
    assert rep["passed"] and rep["counts"].get("fail", 0) == 0
    assert rep["replay_env"]["matmul_precision"]["policy"] == "highest" and rep["dot_precision"] is None


def test_diagnosis_needs_the_first_failing_point_and_every_compared_one():
    """A precision bug's downstream points can match the shadow by chance (measured: `norm_stats_bf16` on tiny-bf16
    layers 0-1, 6 of 66): the diagnosis is named only when the shadow explains the first failing point and every
    failing point it was compared with, and the triage follows the report's gate."""
    from parity.replay.matmul_policy import summary
    from parity.reporting.triage import triage

    def pt(site, status="fail", matches=None):
        r = {"phase": "prefill", "step": 0, "layer": 0, "site": site, "status": status}
        if matches is not None:
            r["dot_precision"] = {"matches": matches}
        return r

    assert summary([pt("attention.q_proj", "pass")]) is None
    full = summary([pt("attention.q_proj", matches=True), pt("attention.k_proj", matches=True)])
    assert full["diagnosis"] and full["fix"] == FIX and full["explains_first"]
    late = summary([pt("input_layernorm", matches=False), pt("attention.q_proj", matches=True)])
    assert late["explained"] == 1 and not late["explains_first"] and late["diagnosis"] is None
    partial = summary([pt("attention.q_proj", matches=True), pt("attention.k_proj", matches=False)])
    assert partial["explains_first"] and partial["diagnosis"] is None

    def rep(dtype, pts):
        return {"dump": dtype, "dump_dtype": dtype, "checkpoint_fingerprint": "f", "target": "t", "mode": "layer",
                "points": pts, "dot_precision": summary(pts)}

    fp32 = rep("float32", [pt("input_layernorm", "pass"), pt("attention.q_proj", "pass")])
    chance = rep("bfloat16", [pt("input_layernorm", matches=False), pt("attention.q_proj", matches=True)])
    sites = {s["site"]: s["diagnosis"] for s in triage(fp32, chance)["sites"]}
    assert sites == {"input_layernorm": "precision", "attention.q_proj": "precision"}
