"""Isolated replay (DESIGN §6, `parity.replay.observe_isolated`) on the golden bf16 Tiny dump: one KDA layer (0, dense MLP) and one
MLA + MoE layer (3), prefill (40 tokens, recurrent KDA path) and 4 decode steps.

The reference's own noise in isolated mode was measured on all four golden dumps with
`python -m parity.replay.isolated --measure dumps/*.h5` (numbers in the report of the commit that added this file). The
bounds asserted here are what that measurement shows for this dump under the default XLA flags, not tuned:
projections ≤ 1 ULP *before* any floor, short conv / KDA gate / β / o_norm / MLA gate / router logits bit-exact.
The bug tests are the point of the mode: a bug in one sub-module fails exactly that site, while every other site
(fed the reference's dumped tensors, not the buggy ones) gives the very same verdict as the clean run.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity.dumpfile import DumpReader
from parity.model.points import Point
from parity.replay.isolated import noise_table
from parity.jax_ling3.weights import CheckpointReader
from parity.numerics.tolerances import default_rules
from parity.model.points import layer_graph, site_class, sites_for_config
from parity.replay import Session, judge, observe_isolated
from parity.targets.reference import ReferenceTarget

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"
CKPT = ROOT / "dumps" / "ckpt" / "tiny"
KDA, MLA = 0, 3  # Tiny layout KKKM: layer 0 KDA + dense MLP, layer 3 MLA + MoE (facts §2)
STEPS = [("prefill", 0)] + [("decode", k) for k in (1, 2, 3, 4)]


def isolated_rules():
    """The default table: since issue 15 it holds `isolated` rules calibrated per site class (tools/calibrate.py),
    tighter than the proposal above for bf16 tensors (max 1 ULP on ≤ 0.1 %, hard 4), with fp32 tensors of the bf16
    run compared in fp32."""
    return default_rules()


def _replay(target: ReferenceTarget, layer: int) -> list[dict]:
    dump = DumpReader(DUMP)
    try:
        dtype = dump.meta.get("compute_dtype", "bfloat16")
        target.build(dump.config, dtype)
        s = Session(dump=dump, ckpt=CheckpointReader(CKPT), target=target, rules=isolated_rules(), mode="isolated",
                    dtype=dtype)
        return [r.to_json() for r in judge(s, observe_isolated(s, layer))]
    finally:
        dump.close()


def _by_key(records):
    return {(r["phase"], r["step"], r["site"]): r for r in records}


@pytest.fixture(scope="module")
def cfg():
    with DumpReader(DUMP) as d:
        return d.config


@pytest.fixture(scope="module")
def clean():
    return {i: _replay(ReferenceTarget(), i) for i in (KDA, MLA)}


# ------------------------------------------------------------------------------------------------ clean run
@pytest.mark.parametrize("layer", [KDA, MLA])
def test_every_site_compared_and_passes(clean, cfg, layer):
    recs = _by_key(clean[layer])
    table = noise_table(clean[layer])
    print(f"\nlayer {layer} isolated noise per class:")
    for cls, t in sorted(table.items()):
        print(f"  {cls:16s} points {t['points']:3d} raw max {t['max_ulp_raw']:5d} ULP, not exact "
              f"{t['frac_not_exact']:.4f}, > 1 ULP {t['frac_gt1_ulp']:.4f}")
    sites = sites_for_config(cfg, layer, recorded_inputs=True)
    aliases = {s.name for s in layer_graph(cfg.layer_kind(layer), cfg.is_moe(layer), cfg.q_lora) if s.alias}
    assert len(recs) == len(sites) * len(STEPS)  # one record per site and step, nothing dropped
    for phase, step in STEPS:
        for site in sites:
            r = recs[(phase, step, site)]
            if site in aliases:
                assert r["status"] == "skipped" and r["reason"].startswith("isolated:"), r
                continue
            assert r["status"] == "pass", (phase, step, site, r.get("message") or r.get("reason"))
            if site == "mlp.gate.topk_idx":
                assert r["flipped"] == 0 and r["tokens"] == (40 if phase == "prefill" else 1)
            else:
                assert r["max_ulp_raw"] is not None and r["n"] > 0


@pytest.mark.parametrize("layer", [KDA, MLA])
def test_measured_bounds(clean, cfg, layer):
    """Bounds as measured (default XLA flags), before any floor: projections ≤ 1 ULP; the elementwise fp32 pieces
    and the conv bit-exact. Norms (≤ 2 ULP) and swiglu_down (XLA keeps silu(g) unrounded before ⊙ u, see the
    report) are not bounded here beyond the default rules."""
    exact_classes = {"conv", "gate_beta", "o_norm", "router_logits", "topk_weight"}  # KDA and MLA gates, β
    exact_sites = {"attention.dense:in", "mlp", "output"}  # gate product, MoE sum, residual adds
    for r in clean[layer]:
        if r.get("max_ulp_raw") is None:
            continue
        cls = site_class(r["site"])
        if r.get("dtype") != "bfloat16":
            continue  # fp32 tensors are compared in fp32 since issue 15: a few fp32 ULPs, judged by the calibrated rule
        if cls == "projection":
            assert r["max_ulp_raw"] <= 1, (r["phase"], r["step"], r["site"], r["max_ulp_raw"])
        elif cls in exact_classes or r["site"] in exact_sites:
            assert r["max_ulp_raw"] == 0, (r["phase"], r["step"], r["site"], r["max_ulp_raw"])


# ------------------------------------------------------------------------------------------------ bugs
class BuggyTarget(ReferenceTarget):
    """The reference with one sub-module replaced by a buggy version (`bug(target, i, inputs, state, out)`)."""

    def __init__(self, site: str, bug):
        super().__init__()
        self.bug_site, self.bug = site, bug

    def submodule(self, i, site, inputs, state=None):
        out = super().submodule(i, site, inputs, state)
        return self.bug(self, i, inputs, state, out) if site == self.bug_site else out


def _o_proj_one_channel(t, i, inputs, state, out):
    # 3 % on one output channel. (1 % is 1-2 bf16 ULP — bf16 resolves 0.4-0.8 % — so it stays within a 2-ULP rule;
    # the measured projection noise, ≤ 1 ULP, would allow a 1-ULP rule that catches it: see the report.)
    out = np.array(out, np.float32)
    out[..., 5] *= 1.03
    return out.astype(np.asarray(inputs["attention.o_norm"]).dtype)


def _beta_no_sigmoid(t, i, inputs, state, out):
    return np.asarray(inputs["attention.b_proj"], np.float32)  # β = b_proj(x), sigmoid forgotten (facts §3.4)


def _mla_scale_v_head_dim(t, i, inputs, state, out):
    """Softmax scale v_head_dim^-1/2 instead of qk_head_dim^-1/2 (facts §4.4)."""
    from parity.targets.reference import _isolated_jit
    import jax.numpy as jnp

    spec = t.spec(i)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model,
                                                               attn_scale=spec.model.v_head_dim ** -0.5))
    x = {k: jnp.asarray(v) for k, v in inputs.items()}
    st = None if state is None else {k: jnp.asarray(v) for k, v in state.items()}
    return np.asarray(_isolated_jit(t.params[i], x, st, site="attention.core", spec=spec))


def _shared_scaled(t, i, inputs, state, out):
    f = float(t.cfg.routed_scaling_factor)  # scaling applied to the shared expert too (facts §5.4: routed only)
    return (np.asarray(out, np.float32) * f).astype(np.asarray(out).dtype)


@pytest.mark.parametrize("layer,site,bug", [
    (KDA, "attention.o_proj", _o_proj_one_channel),
    (KDA, "attention.beta", _beta_no_sigmoid),
    (MLA, "attention.core", _mla_scale_v_head_dim),
    (MLA, "mlp.shared_experts", _shared_scaled),
], ids=["o_proj_3pct_channel", "beta_no_sigmoid", "mla_scale", "shared_scaled"])
def test_bug_fails_exactly_its_site(clean, layer, site, bug):
    buggy = _by_key(_replay(BuggyTarget(site, bug), layer))
    ref = _by_key(clean[layer])
    assert buggy.keys() == ref.keys()
    for key, r in buggy.items():
        if key[2] == site:
            # The 40-token prefill must fail. (At a 1-token decode step the one perturbed o_proj element can fall
            # under the floor of 1 ULP of its row's RMS, so decode steps are not required to fail.)
            if key[0] == "prefill" or site != "attention.o_proj":
                assert r["status"] == "fail", (key, r.get("max_ulp"))
        else:  # neighbours are fed dumped tensors: the same verdict, to the ULP
            assert r["status"] == ref[key]["status"], (key, r.get("message"))
            assert r.get("max_ulp_raw") == ref[key].get("max_ulp_raw"), key


def test_target_without_isolated_capability_is_refused():
    """No silent all-skipped run: isolated mode on a target without sub-modules is one error up front."""
    from parity.replay import ModeError

    class NoIso(ReferenceTarget):
        capabilities = ReferenceTarget.capabilities - {"isolated"}

    with pytest.raises(ModeError, match="capability 'isolated'"):
        _replay(NoIso(), KDA)


def test_kda_state_does_not_read_q():
    """The site graph feeds `attention.state` no q (the state update reads k, v, gate, β: facts §3.6). Check it on
    the kernel itself: the state computed with the dumped q and with an unrelated q is bit-identical, while the core
    output (which does read q) changes."""
    import jax
    import jax.numpy as jnp

    from parity.targets.reference import _isolated_jit, _kda_kernel

    t = ReferenceTarget()
    with DumpReader(DUMP) as d:
        t.build(d.config, d.meta.get("compute_dtype", "bfloat16"))
        t.load_layer(KDA, CheckpointReader(CKPT).hf_tensors(KDA))
        x = {s: jnp.asarray(d.read(Point("prefill", 0, KDA, s))) for s in
             ("attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.gate", "attention.beta")}
    other = dict(x, **{"attention.q_conv1d": x["attention.q_conv1d"][:, ::-1] * 3})
    run = lambda site, inp: np.asarray(_isolated_jit(t.params[KDA], inp, None, site=site, spec=t.spec(KDA)))
    assert not np.array_equal(run("attention.core", x), run("attention.core", other))
    state = jax.jit(lambda p, inp: _kda_kernel(p, inp, None, t.spec(KDA))[1])  # jitted like the isolated sites
    with_q, with_other_q = np.asarray(state(t.params[KDA], x)), np.asarray(state(t.params[KDA], other))
    np.testing.assert_array_equal(with_q, with_other_q)
    without_q = t.submodule(KDA, "attention.state", {k: np.asarray(v) for k, v in x.items() if k != "attention.q_conv1d"})
    np.testing.assert_array_equal(with_q, without_q)


def test_pytest_face_isolated_mode(tmp_path):
    """`pytest parity --parity-mode isolated -k layer_3` selects layer 3's points and they pass."""
    cmd = [sys.executable, "-m", "pytest", "parity", "--parity-dump", str(DUMP), "--parity-mode", "isolated",
           "-k", "layer_3", "-q", "-p", "no:cacheprovider", "--parity-report", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = res.stdout[-3000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
    assert (tmp_path / "tiny-bf16" / "report.json").is_file()
