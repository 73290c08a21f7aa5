"""One `pytest parity` run replays several modes (`--parity-mode layer,isolated`): ids and report directories carry
the mode; a bad mode is one usage error. CI replays every bundled dump in isolated mode here (`pytest parity` itself
defaults to layer mode)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"


def _pytest(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pytest", "parity", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("dump", sorted((ROOT / "dumps").glob("*.h5")), ids=lambda p: p.stem)
def test_bundled_dump_passes_in_isolated_mode(dump):
    from parity.replay import run_replay

    rep = run_replay(dump, mode="isolated")
    compared = [p for p in rep["points"] if p["status"] in ("pass", "fail", "benign")]
    assert rep["passed"], rep["first_divergence"]
    assert len(compared) > 100, f"{dump.name}: only {len(compared)} points compared in isolated mode"
    # bf16 dumps: the RMSNorm rounding check (parity.numerics.rounding) applies at every norm point — the dump lies
    # inside its brackets — so a check that quietly stopped applying (an input or eps mix-up) is seen here
    norms = [p for p in compared if p["site"] in ("input_layernorm", "post_attention_layernorm",
                                                   "attention.q_a_layernorm", "attention.kv_a_layernorm", "final_norm")
             and p["phase"] != "backward"]  # the rounding check is of forward norms; backward points are cotangents
    if "bf16" in dump.stem:
        not_applied = [(p["phase"], p["step"], p["layer"], p["site"], (p.get("rounding") or {}).get("why"))
                       for p in norms if not (p.get("rounding") or {}).get("applied")]
        assert norms and not not_applied, not_applied[:3]


@pytest.mark.parametrize("dump", sorted((ROOT / "dumps").glob("*bf16.h5")), ids=lambda p: p.stem)
def test_rounding_check_applies_under_teacher_forcing(dump):
    # layer mode (pytest parity's default) feeds input_layernorm, final_norm and an MTP layer's enorm / hnorm dumped
    # tensors: their rounding check must apply at every such point of each bundled bf16 dump, the dump inside its
    # brackets and the reference too
    from parity.replay import run_replay

    rep = run_replay(dump, backward=False)  # forward norms only: a --grads golden's VJPs would be compiled for nothing
    fed = ("input_layernorm", "final_norm", "MTP0/enorm", "MTP0/hnorm")
    norms = [p for p in rep["points"] if p["site"] in fed and p["status"] != "skipped"
             and p["phase"] != "backward"]  # forward norms: a backward point of the same site is a cotangent
    bad = [(p["phase"], p["step"], p["layer"], p["site"], p.get("rounding")) for p in norms
           if not (p.get("rounding") or {}).get("applied") or p["rounding"]["outside"]]
    assert rep["passed"] and norms and not bad, bad[:3]
    if "official" in dump.stem:  # the bundled dump with an MTP layer
        assert {p["site"] for p in norms} == set(fed), {p["site"] for p in norms}


def test_layer_and_isolated_in_one_run(tmp_path):
    r = _pytest("--parity-dump", str(DUMP), "--parity-mode", "layer,isolated", "-k", "layer_1", "-q", "-rA",
                "--parity-report", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "PASSED parity/test_points.py::test_point[tiny-bf16/layer/layer_1/attention.core]" in r.stdout
    assert "PASSED parity/test_points.py::test_point[tiny-bf16/isolated/layer_1/attention.core]" in r.stdout
    for mode in ("layer", "isolated"):
        rep = json.loads((tmp_path / "tiny-bf16" / mode / "report.json").read_text())
        assert rep["mode"] == mode and rep["passed"] and any(p["layer"] == 1 for p in rep["points"])


def test_single_mode_keeps_the_plain_ids_and_directory(tmp_path):
    r = _pytest("--parity-dump", str(DUMP), "--parity-mode", "layer", "-k", "layer_1 and attention.core", "-q", "-rA",
                "--parity-report", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:]
    assert "PASSED parity/test_points.py::test_point[tiny-bf16/layer_1/attention.core]" in r.stdout
    assert (tmp_path / "tiny-bf16" / "report.json").is_file()


def test_bad_mode_is_one_usage_error():
    r = _pytest("--parity-mode", "layer,bogus", "-q")
    assert r.returncode == 4 and "--parity-mode 'layer,bogus': expected one or more of layer" in r.stderr
    assert r.stderr.count("\n") < 5


def test_mtp_points_in_every_mode_of_one_run(tmp_path):
    """An MTP dump replayed in all four modes at once: MTP points compared in layer/forced, skipped with the reason in
    isolated/free — never left without a record (that would fail as `missing`)."""
    dump = ROOT / "dumps" / "tiny-flash-official-bf16.h5"
    r = _pytest("--parity-dump", str(dump), "--parity-mode", "layer,forced,isolated,free", "-k", "MTP0", "-q", "-rs",
                "--parity-report", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "free mode: MTP layers are replayed in layer/forced mode only" in r.stdout
    for mode, compared in (("layer", True), ("forced", True), ("isolated", False), ("free", False)):
        rep = json.loads((tmp_path / "tiny-flash-official-bf16" / mode / "report.json").read_text())
        mtp = [p for p in rep["points"] if str(p["site"]).startswith("MTP0/")]
        assert mtp and all(p["status"] != "missing" for p in mtp), mode
        assert any(p["status"] == "pass" for p in mtp) == compared, mode


def test_a_site_failing_at_several_steps_is_one_test_naming_each_point(tmp_path):
    # one test per (dump, layer, site) covers every step: with a zero-ULP rule, layer 2's fp32 KDA gate (inexact at
    # every step of this dump) fails once, listing the prefill and the 4 decode points; the report keeps 5 records
    rule = "attention.gate:layer:float32:max_ulps=0,hard_ulps=0,allowed_fraction=0,floor_ulps=0"
    # (--parity-strict-variants: the three-way verdict would otherwise accept the reference's own fp32 gate as no
    # farther from the fp32 shadow than the dump's, `variant` more-precise-than-reference, issue 31)
    r = _pytest("--parity-dump", str(DUMP), "--parity-layers", "2", "-k", "layer_2 and attention.gate", "-q",
                "--parity-tol", rule, "--parity-report", str(tmp_path), "--parity-strict-variants")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-3000:]
    for name in ("prefill/L02", "decode/S001/L02", "decode/S002/L02", "decode/S003/L02", "decode/S004/L02"):
        assert f"Tensor-likes are not close! [{name}/attention.gate]" in r.stdout, (name, r.stdout[-3000:])
    rep = json.loads((tmp_path / "tiny-bf16" / "report.json").read_text())
    gate = [p for p in rep["points"] if p["layer"] == 2 and p["site"] == "attention.gate"]
    assert len(gate) == 5 and all(p["status"] == "fail" for p in gate), [p["status"] for p in gate]
    # control: without the override the same test passes
    r = _pytest("--parity-dump", str(DUMP), "--parity-layers", "2", "-k", "layer_2 and attention.gate", "-q",
                "--parity-report", str(tmp_path))
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]
