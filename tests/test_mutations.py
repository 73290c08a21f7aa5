"""Mutation self-test of the replay (issue "Replay and report"): every bug of `parity.targets.mutants.MUTATIONS`
must make the replay fail (detected) and `first_divergence.source` must name the (phase, step, layer, site) derived
from the bug's semantics in the catalogue (localised).

Dumps: made here, once per session and worker, from the bundled checkpoints `tiny` and `tiny-flash` (twin remote code,
fp32 — the fp32 tier of the default tolerance table, compute in fp32; 24-token prompt, recurrent KDA path, 2 decode
steps for the decode-only bugs). A dump is `LING3_MUT_DTYPE=bf16` selectable.

Localisation is judged on the report of layers 0..expected layer (execution order is phase, step, layer, site:
layers after the expected one cannot hold an earlier failing point for a prefill bug; for the decode-only bugs the
test also asserts that no prefill point of those layers fails). `LING3_MUT_FULL=1` replays all layers.

Two localisation checks:
- `differential`: the points the *correct* target already fails on the same dump (tolerance false alarms of the
  current table) are set aside; the source must then be the expected point. Always asserted.
- `strict`: the report as is. Asserted whenever the correct target's own report has no failing point before the
  expected one; otherwise xfail naming that false alarm (a tolerance-table matter, not a localisation one).

Measured (fp32, `python -m pytest tests/test_mutations.py -q -n 2`): with the provisional table (before 7c79a66) 22/22
detected and differentially localised, strict localisation right for the 9 layer-0 bugs, 13 xfail behind the correct
target's own false alarm at prefill/L01/attention.core; with the calibrated table of 7c79a66: 22/22 detected, 22/22
strictly localised, 26 passed in 90 s wall on 2 cores.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from parity.model.points import Point
from parity.reporting.report import first_divergence, order_key
from parity.targets.mutants import MUTATIONS, Mutation, MutantTarget, patched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE = {"bf16": "bfloat16", "bfloat16": "bfloat16"}.get(os.environ.get("LING3_MUT_DTYPE", "fp32"), "float32")
FULL = os.environ.get("LING3_MUT_FULL") == "1"
PROMPT_LEN, DECODE_STEPS = 24, 2


def _ckpt(preset: str) -> str:
    return os.path.join(ROOT, "dumps", "ckpt", preset)


@pytest.fixture(scope="session")
def mut_dumps(tmp_path_factory):
    """preset -> dump path, made lazily (only the presets the selected tests need)."""
    from parity.model.config import Ling3Config
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    from filelock import FileLock

    # shared by the xdist workers of this session (the base temp's parent is common to them), made once under a lock
    out = tmp_path_factory.getbasetemp()
    out = out.parent if os.environ.get("PYTEST_XDIST_WORKER") else out
    made: dict[str, str] = {}

    def get(preset: str, dtype: str = DTYPE) -> str:
        if (preset, dtype) not in made:
            path = out / f"mut-{preset}-{dtype}.h5"
            with FileLock(str(path) + ".lock"):
                if not path.exists():
                    cfg = Ling3Config.from_pretrained_dir(_ckpt(preset), strict=False)
                    dump_checkpoint(_ckpt(preset), path, builtin_ids(cfg.vocab_size, PROMPT_LEN, 0),
                                    DumpOptions(dtype=dtype, decode_steps=DECODE_STEPS, progress=False))
            made[(preset, dtype)] = str(path)
        return made[(preset, dtype)]

    return get


@pytest.fixture(scope="session")
def baselines(mut_dumps):
    """(preset, layers) -> report of the *correct* reference target on the same dump and layers."""
    from parity.replay import run_replay

    cache: dict = {}

    def get(preset: str, layers):
        key = (preset, None if layers is None else tuple(layers))
        if key not in cache:
            cache[key] = run_replay(mut_dumps(preset), _ckpt(preset), layers=layers)
        return cache[key]

    return get


def _key(d: dict) -> tuple:
    return (d["phase"], d.get("step", 0), d.get("layer"), d["site"])


def _matches(src: dict, exp) -> bool:
    return (src["phase"], src["step"], src["layer"]) == (exp.phase, exp.step, exp.layer) and src["site"] in exp.sites


PORTING = sorted(n for n, m in MUTATIONS.items() if m.cls == "porting")
FINE = sorted(n for n, m in MUTATIONS.items() if m.cls != "porting")  # test_fine_mutation_detected_and_pinned


@pytest.mark.parametrize("name", PORTING)
def test_mutation_detected_and_localised(name, mut_dumps, baselines):
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay

    m: Mutation = MUTATIONS[name]
    dump = mut_dumps(m.preset)
    with DumpReader(dump) as r:
        cfg = r.config
    exp = m.expected(cfg)
    layers = None if FULL else list(range(exp.layer + 1))
    report = run_replay(dump, _ckpt(m.preset), target=MutantTarget(name, ckpt_dir=_ckpt(m.preset)), layers=layers)
    base = baselines(m.preset, layers)
    recs = {_key(p): p for p in report["points"]}

    # detected: the report fails, and at the expected point itself
    assert not report["passed"], f"{name}: replay passed with the bug injected ({report['counts']})"
    hits = [recs.get((exp.phase, exp.step, exp.layer, s)) for s in exp.sites]
    assert any(h is not None and h["status"] == "fail" for h in hits), (
        f"{name}: expected point {exp} does not fail: {[(h and (h['site'], h['status'], h.get('max_ulp'))) for h in hits]}")
    if m.needs_decode:  # a decode-only bug must leave every prefill point of the replayed layers as the reference's
        base_st = {_key(p): p["status"] for p in base["points"]}
        changed = [k for k, p in recs.items() if k[0] == "prefill" and p["status"] != base_st.get(k)]
        assert not changed, f"{name}: decode-only bug changed prefill points {changed[:5]}"

    # differential localisation: set aside the correct target's own failures on this dump
    base_fail = {_key(p) for p in base["points"] if p["status"] == "fail"}
    neutral = [dict(p, status="pass") if _key(p) in base_fail else p for p in report["points"]]
    fd = first_divergence(cfg, neutral)
    assert fd is not None and _matches(fd["source"], exp), (
        f"{name}: source {fd and fd['source']} (baseline false alarms set aside), expected {exp}")

    # strict localisation on the report as is
    src = report["first_divergence"]["source"]
    if _matches(src, exp):
        return
    exp_rec = {"phase": exp.phase, "step": exp.step, "layer": exp.layer, "site": exp.sites[0]}
    base_fd = base["first_divergence"]
    if base_fd is not None and order_key(cfg, base_fd) < order_key(cfg, exp_rec):
        pytest.xfail(f"{name}: the correct target itself fails first at {_key(base_fd)} "
                     f"({base_fd.get('max_ulp')} ULP) with the current tolerance table, masking {exp}")
    pytest.fail(f"{name}: first_divergence.source {src}, expected {exp}")


def test_catalogue_is_complete_and_documented():
    assert len(MUTATIONS) >= 15
    for m in MUTATIONS.values():
        assert m.doc and m.preset in ("tiny", "tiny-flash") and (m.patches() or m.load), m.name


def test_patches_are_restored_and_scoped():
    """Patching installs the mutant only inside the context; the reference modules are intact afterwards, also
    after an exception."""
    from parity.jax_ling3 import kda, layer, mla, moe

    before = {(mod, a): getattr(mod, a) for mod in (kda, layer, mla, moe) for a in dir(mod) if not a.startswith("_")}
    for m in MUTATIONS.values():
        p = m.patches()
        with pytest.raises(RuntimeError):
            with patched(p):
                for (mod, attr), v in p.items():
                    assert getattr(mod, attr) is v
                raise RuntimeError("boom")
    after = {(mod, a): getattr(mod, a) for mod in (kda, layer, mla, moe) for a in dir(mod) if not a.startswith("_")}
    assert all(after[k] is v for k, v in before.items())


def test_unknown_mutation_is_rejected():
    with pytest.raises(ValueError, match="unknown mutation"):
        MutantTarget("no_such_bug")


def test_mutant_layer_differs_and_reference_stays_clean():
    """A mutant's layer output differs from the reference's, and running the mutant first does not leak into the
    reference's jitted layer (same inputs, reference output identical before and after)."""
    from parity.model.config import Ling3Config
    from parity.jax_ling3.weights import CheckpointReader
    from parity.targets.reference import ReferenceTarget

    cfg = Ling3Config.from_pretrained_dir(_ckpt("tiny"), strict=False)
    ck = CheckpointReader(_ckpt("tiny"))
    h = np.random.default_rng(0).standard_normal((1, 8, cfg.hidden_size)).astype(np.float32)
    pos = np.arange(8)

    def run(t):
        t.build(cfg, "float32")
        t.load_layer(0, ck.hf_tensors(0))
        return t.layer_forward(0, h, pos).points

    ref1 = run(ReferenceTarget())
    mut = run(MutantTarget("kda_beta_not_sigmoided"))
    ref2 = run(ReferenceTarget())
    assert not np.allclose(mut["attention.beta"], ref1["attention.beta"])
    np.testing.assert_array_equal(mut["attention.b_proj"], ref1["attention.b_proj"])  # only β's sigmoid is gone
    np.testing.assert_allclose(mut["attention.beta"], ref1["attention.b_proj"], rtol=0, atol=0)
    for k in ref1:
        np.testing.assert_array_equal(ref1[k], ref2[k], err_msg=k)


# ------------------------------------------------------------------------------------------------ fine numerics
# Issue 15: the precision-placement and sub-tolerance bugs must be detected and pinned to their own site on fp32 AND
# bf16 dumps. Which (dtype, mode) does not do so yet with the default table — measured with `python -m pytest
# tests/test_mutations.py -k fine` (the matrix in the README) — is a strict xfail with the reason, so a mode that
# starts to pin the bug turns into a failure that asks for this table to be updated.
LAYER_BF16 = ("not pinned in layer mode on bf16: the bug moves 30-50 % of the site's elements by 1-3 ULP, below the "
              "layer-mode bf16 rules (floor 8-16 ULP of the row RMS, 2 ULP on ≤ 0.1 %); isolated mode pins it")
# A sub-ULP bug in a bf16 run changes only which way some elements round; isolated mode sees that through the
# exactness test (parity.numerics.exactness: rows not bit-identical vs a correct implementation's calibrated rate) —
# moe_combine_bf16 leaves every row of mlp.routed inexact — and, for RMSNorm sites, through the rounding check
# (parity.numerics.rounding): the eps bug flips only 3 + 1 elements of the 24-token dump, too few rows for the
# exactness test, but elements that fp32 rounding of the right formula cannot flip. Under teacher forcing a layer's
# input norm and the model's final norm are fed dumped tensors too, so layer mode has the rounding check there.
L2NORM_FP32 = ("no bug on fp32 by construction: the L2 norm in the activation dtype is the reference's own formula in an "
               "fp32 run (a precision loss only, issue 31: triage calls it `precision`)")
NOT_PINNED_TODAY = {  # (mutant, dtype, mode) -> why the default table does not pin it yet; everything else must pin
    ("kda_l2norm_before_upcast", "float32", "layer"): L2NORM_FP32,
    ("kda_l2norm_before_upcast", "float32", "isolated"): L2NORM_FP32,
    ("kda_l2norm_before_upcast", "bfloat16", "layer"): "not pinned in layer mode on bf16: the norm's error enters "
                                                        "attention.core below its layer-mode bf16 rule (floor 32 ULP "
                                                        "of the row RMS); isolated mode pins it",
    ("mla_lora_norm_eps", "float32", "layer"): "layer mode's fp32 tier is 1e-5·|ref| per element; the bug moves "
                                               "q_a/kv_a_layernorm by ~5e-6 (rel-L2); isolated fp32 pins it",
    ("mla_lora_norm_eps", "bfloat16", "layer"): LAYER_BF16,
    ("moe_combine_bf16", "bfloat16", "layer"): LAYER_BF16,
    ("kda_o_norm_weight_bf16", "bfloat16", "layer"): LAYER_BF16,
    ("moe_router_bf16", "bfloat16", "layer"): LAYER_BF16 + " (router logits: the input norm differs by 1 bf16 ULP "
                                                           "in layer mode, hiding the bf16 GEMM)",
}
# norm_stats_bf16 (layer 0's input norm statistics in bf16) is pinned in bf16 layer mode too: teacher forcing feeds
# input_layernorm its dumped input, so the rounding check holds there as in isolated mode (the exactness_rates section of calibration.toml)


def _fine_cases():
    for n in FINE:
        for dtype in ("float32", "bfloat16"):
            for mode in ("layer", "isolated"):
                why = NOT_PINNED_TODAY.get((n, dtype, mode))
                marks = () if why is None else (pytest.mark.xfail(strict=True, reason=why),)
                yield pytest.param(n, dtype, mode, marks=marks, id=f"{n}-{dtype}-{mode}")


@pytest.mark.parametrize("name, dtype, mode", list(_fine_cases()))
def test_fine_mutation_detected_and_pinned(name, dtype, mode, mut_dumps):
    """Detected (the replay fails, at the expected point) and pinned (first_divergence.source is that point) on a
    dump of `dtype` in `mode`; the correct target passes the same replay (so the pin is not a tolerance artefact)."""
    from parity.dumpfile import DumpReader
    from parity.replay import run_replay

    m: Mutation = MUTATIONS[name]
    dump = mut_dumps(m.preset, dtype)
    with DumpReader(dump) as r:
        cfg = r.config
    exp = m.expected(cfg)
    layers = list(range(exp.layer + 1))
    base = run_replay(dump, _ckpt(m.preset), mode=mode, layers=layers)
    assert base["passed"], f"correct target fails {dtype} {mode}: {base['first_divergence']}"
    report = run_replay(dump, _ckpt(m.preset), target=MutantTarget(name, ckpt_dir=_ckpt(m.preset)), mode=mode,
                        layers=layers)
    recs = {_key(p): p for p in report["points"]}
    hits = [recs.get((exp.phase, exp.step, exp.layer, s)) for s in exp.sites]
    assert not report["passed"], f"{name} ({dtype}, {mode}): replay passed with the bug injected"
    assert any(h is not None and h["status"] == "fail" for h in hits), f"{name}: expected point {exp} passes"
    src = report["first_divergence"]["source"]
    assert _matches(src, exp), f"{name} ({dtype}, {mode}): source {src}, expected {exp}"
