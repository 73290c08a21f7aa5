"""The RMSNorm rounding check of isolated bf16 replays (parity.numerics.rounding, issue 15), against transformers'
built-in `BailingHybridRMSNorm` (an independent implementation of the facts-§6 formula): its bf16 outputs lie in the
bracket at the calibrated scale noise for every row length; an epsilon changed as `mla_lora_norm_eps` does, or a
fused kernel's single rounding, leave it; the monotonicity the two-end bracket rests on; the judge's use of it."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from parity.numerics import rounding
from parity.numerics.tolerances import default_rules

BF16 = ml_dtypes.bfloat16


def _rows(n: int, rows: int, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    x = (g.standard_normal((1, rows, n)) * scale * g.uniform(0.2, 3.0, (1, rows, 1))).astype(BF16)
    w = g.uniform(0.5, 1.5, n).astype(BF16)
    return x, w


def _builtin(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """transformers' BailingHybridRMSNorm in bf16 (weight bf16, as loaded from a bf16 checkpoint)."""
    import torch
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridRMSNorm

    m = BailingHybridRMSNorm(x.shape[-1], eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16))
        y = m(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16))
    return y.float().numpy().astype(BF16)


def _scale_noise() -> float:
    c = default_rules().rule_for("attention.q_a_layernorm", "isolated", "bfloat16", "bfloat16").norm_scale_noise
    assert c is not None, "the default table has no norm_scale_noise for attention.q_a_layernorm"
    return c


@pytest.mark.parametrize("n", [32, 64, 512, 2048])
def test_builtin_norm_lies_in_the_bracket(n):
    """Another implementation of the same formula (torch's summation and rsqrt) is inside the bracket everywhere."""
    x, w = _rows(n, 400, seed=n)
    y = _builtin(x, w, 1e-6)
    chk = rounding.RmsNormCheck(x, w, 1e-6)
    entry = chk.check(y, y, _scale_noise())
    assert entry["applied"] and entry["outside"] == 0, entry
    assert rounding.needed_scale_noise(x, w, 1e-6, y) <= _scale_noise()


def test_changed_epsilon_leaves_the_bracket():
    """eps 1e-6 -> 1e-5 (the mla_lora_norm_eps mutant) on LoRA-sized rows: the dump (eps 1e-6) is inside, the
    mutant's output has elements outside; the control — the same formula with the right eps — has none."""
    x, w = _rows(32, 200, seed=7)
    ref = _builtin(x, w, 1e-6)
    bad = _builtin(x, w, 1e-5)
    good = _builtin(x, w, 1e-6)
    chk = rounding.RmsNormCheck(x, w, 1e-6)
    assert chk.check(ref, good, _scale_noise())["outside"] == 0
    entry = chk.check(ref, bad, _scale_noise())
    flipped = int((ref.astype(np.float32) != bad.astype(np.float32)).sum())
    assert entry["applied"] and entry["outside"] >= 1 and entry["outside"] <= flipped, (entry, flipped)
    i = tuple(entry["index"])
    assert entry["test"] == float(bad.astype(np.float32)[i]) and entry["ref"] == float(ref.astype(np.float32)[i])
    lo, hi = entry["reachable"]
    assert not lo <= entry["test"] <= hi
    line = rounding.message("prefill/L03/attention.q_a_layernorm", entry)
    assert line.startswith("prefill/L03/attention.q_a_layernorm: ") and f"{entry['outside']} of 6400 elements" in line
    assert "eps 1e-06" in line and "reachable" in line


def test_fused_single_rounding_dump_is_not_judged():
    """A dump made by a fused kernel (weight multiplied in fp32, one rounding: facts §6 on VL/SG) is not what the
    formula gives: the check says so and does not apply, rather than failing a target that matches that dump."""
    x, w = _rows(512, 64, seed=3)
    xf = x.astype(np.float32)
    r = 1.0 / np.sqrt(np.mean(xf.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    fused = (xf * r.astype(np.float32) * w.astype(np.float32)).astype(BF16)
    entry = rounding.RmsNormCheck(x, w, 1e-6).check(fused, fused, _scale_noise())
    assert entry["applied"] is False and "the dump itself lies outside" in entry["why"]


def test_bracket_holds_every_scale_in_between():
    """The two-end bracket rests on y(r) being monotone per element: every r' sampled inside the interval gives a
    value inside [lo, hi], and both ends are attained."""
    x, w = _rows(64, 16, seed=11)
    rho = 1e-3  # wide, so many elements change along the interval
    lo, hi = rounding.rms_norm_bracket(x, w, 1e-6, rho)
    x32 = x.astype(np.float32)
    r = 1.0 / np.sqrt(np.mean(x32.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    seen_lo = np.zeros(lo.shape, bool)
    seen_hi = np.zeros(lo.shape, bool)
    for t in np.linspace(-rho, rho, 801):
        u = (x32 * (r * (1 + t)).astype(np.float32)).astype(BF16).astype(np.float32)
        y = (w.astype(np.float32) * u).astype(BF16).astype(np.float32)
        assert ((y >= lo) & (y <= hi)).all()
        seen_lo |= y == lo
        seen_hi |= y == hi
    assert seen_lo.all() and seen_hi.all()
    assert (lo < hi).mean() > 0.3  # the interval is wide enough for the test to mean something


def test_default_table_checks_rmsnorm_sites_only_where_fed_dumped_inputs_in_bf16():
    t = default_rules()
    fed_in_layer_mode = ("input_layernorm", "final_norm", "enorm", "hnorm")  # teacher forcing feeds them dumped tensors
    for site in ("input_layernorm", "post_attention_layernorm", "attention.q_a_layernorm", "attention.kv_a_layernorm",
                 "final_norm", "enorm", "hnorm"):
        assert t.rule_for(site, "isolated", "bfloat16", "bfloat16").norm_scale_noise is not None, site
        for mode in ("layer", "forced"):
            got = t.rule_for(site, mode, "bfloat16", "bfloat16").norm_scale_noise
            assert (got is not None) == (site in fed_in_layer_mode), (site, mode, got)
        assert t.rule_for(site, "isolated", "float32", "float32").norm_scale_noise is None, site
    assert t.rule_for("attention.o_proj", "isolated", "bfloat16", "bfloat16").norm_scale_noise is None


def test_judge_fails_a_point_outside_and_passes_it_inside(tmp_path):
    """The judge applies the check where the strategy supplied it: a point whose bits differ from the dump in fewer
    rows than the exactness test could see fails on the rounding check alone, with its line in the message."""
    from parity.model.points import Point
    from parity.replay.judge import _judge
    from parity.replay.records import Observation, Status

    x, w = _rows(32, 24, seed=5)
    ref, bad = _builtin(x, w, 1e-6), _builtin(x, w, 1e-5)
    rows_differ = int((ref.astype(np.float32) != bad.astype(np.float32)).any(-1).sum())
    assert 1 <= rows_differ <= 3  # so few that the row-count test passes: the rounding check decides

    class S:  # the few session attributes _judge reads
        rules, mode, dtype = default_rules(), "isolated", "bfloat16"

        class dump:
            @staticmethod
            def dtype(p):
                return "bfloat16"

    pt = Point("prefill", 0, 3, "attention.q_a_layernorm")
    chk = rounding.RmsNormCheck(x, w, 1e-6)
    rec_bad = _judge(S, Observation(pt, ref, bad, "isolated", rounding=chk))
    rec_ok = _judge(S, Observation(pt, ref, ref.copy(), "isolated", rounding=chk))
    rec_unchecked = _judge(S, Observation(pt, ref, bad, "isolated"))
    assert rec_bad.status == Status.FAIL and "outside what fp32 rounding" in rec_bad.message
    assert rec_bad.stats["rounding"]["outside"] >= 1
    assert rec_ok.status == Status.PASS and rec_ok.stats["rounding"]["outside"] == 0
    assert rec_unchecked.status == Status.PASS  # without the check the same point passes: the check is what fails it


def test_final_norm_is_checked_and_a_fused_single_rounding_there_is_a_named_variant():
    """The model's final RMSNorm (fed the dumped last-layer output) gets the check too: on a bundled bf16 dump in
    isolated mode it applies at every step with nothing outside; a head whose final norm rounds once, bf16(w·x·r)
    as a fused kernel would (the facts-§6 formula rounds x·r to bf16 first), falls outside at every step — and is
    reported as the named variant `rmsnorm-single-rounding` (passing), a failure under strict variants."""
    from parity.replay import run_replay
    from parity.targets.reference import ReferenceTarget

    class FusedFinalNorm(ReferenceTarget):
        name = "fused-final-norm"

        def head(self, hidden):
            out = super().head(hidden)
            x = np.asarray(hidden).astype(np.float32)
            ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
            r = 1.0 / np.sqrt(ms + np.float32(self.cfg.rms_norm_eps))
            w = np.asarray(self.globals["final_norm"]).astype(np.float32)
            out["final_norm"] = (w * (x * r)).astype(ml_dtypes.bfloat16)
            return out

    dump = Path(__file__).resolve().parents[1] / "dumps" / "tiny-flash-bf16.h5"

    def final(**kw):
        return [p for p in run_replay(dump, mode="isolated", layers=[], **kw)["points"]
                if p["site"] == "final_norm" and p["phase"] != "backward"]  # a backward point is a cotangent

    ok, var, strict = final(), final(target=FusedFinalNorm), final(target=FusedFinalNorm, strict_variants=True)
    assert len(ok) == len(var) == len(strict) == 5  # prefill + 4 decode steps
    assert all(p["status"] == "pass" and p["rounding"]["applied"] and p["rounding"]["outside"] == 0 for p in ok), ok
    for p in var + strict:
        assert p["rounding"]["outside"] > 0 and p["max_ulp_raw"] <= 1  # 1-ULP differences: the bracket pins them
        assert p["variant"]["name"] == "rmsnorm-single-rounding", p.get("variant")
    assert all(p["status"] == "variant" for p in var), [p["status"] for p in var]
    assert all(p["status"] == "fail" and "--parity-strict-variants" in p["message"] for p in strict), strict
