"""Issue 13: the MTP layer replayed (capability `mtp`) and the semantic forks honoured by the replay.

Runs on the bundled official-runtime golden dump (`dumps/tiny-flash-official-bf16.h5`: the official
modeling_bailing_moe_v3.py, which ignores the SwiGLU clamp lists and runs an MTP layer), so it needs no official file.
"""

from collections import Counter

import numpy as np
import pytest

from parity.golden import DUMPS, GOLDEN
from parity.replay import run_replay
from parity.targets.mutants import MutantTarget
from parity.targets.reference import ReferenceTarget

OFFICIAL = DUMPS / next(g.file for g in GOLDEN if g.runtime == "official")


def _mtp(rep):
    return [p for p in rep["points"] if str(p["site"]).startswith("MTP")]


@pytest.fixture(scope="module")
def dump_semantics_report():
    return run_replay(OFFICIAL)


def test_official_dump_replays_clean_with_the_dumps_semantics(dump_semantics_report):
    rep = dump_semantics_report
    st = Counter(p["status"] for p in rep["points"])
    assert rep["passed"] and st["fail"] == 0 and st["missing"] == 0 and st["semantic"] == 0, st
    moe = [p for p in rep["points"] if "mlp" in str(p["site"])]
    assert moe and all(p["status"] in ("pass", "benign") for p in moe)  # every MoE point compared
    assert rep["semantics"]["replayed_with"] == "dump"
    assert [d["fork"] for d in rep["semantics"]["departures"]] == ["swiglu_clamp"]


def test_mtp_points_are_replayed(dump_semantics_report):
    mtp = _mtp(dump_semantics_report)
    st = Counter(p["status"] for p in mtp)
    # 25 MTP sites x (prefill + 4 decode steps); only the official MLA's inline head gate is unavailable
    assert len(mtp) == 125 and st["pass"] + st["benign"] == 120, st
    assert {p["site"] for p in mtp if p["status"] == "skipped"} == {"MTP0/attention.gate"}
    assert {p["site"] for p in mtp} >= {"MTP0/embed", "MTP0/enorm", "MTP0/hnorm", "MTP0/eh_proj",
                                        "MTP0/final_layernorm", "MTP0/logits", "MTP0/mlp.gate.topk_idx"}


class _SwappedEhProj(ReferenceTarget):
    """A porting bug of the MTP layer: eh_proj applied to [hnorm(h) ; enorm(e)] (facts §2: embedding first)."""

    name = "mtp-eh-proj-swapped"

    def load_mtp(self, j, hf_tensors):
        import jax.numpy as jnp

        super().load_mtp(j, hf_tensors)
        p = self.params[("mtp", j)]
        D = self.cfg.hidden_size
        p["eh_proj"] = jnp.concatenate([p["eh_proj"][D:], p["eh_proj"][:D]], axis=0)


def test_a_broken_mtp_layer_is_caught_at_eh_proj():
    rep = run_replay(OFFICIAL, target=_SwappedEhProj(clamp=False), backward=False)  # a forward bug
    assert not rep["passed"]
    fd = rep["first_divergence"]
    assert fd["site"] == "MTP0/eh_proj" and fd["source"]["site"] == "MTP0/eh_proj", fd
    main = [p for p in rep["points"] if p["status"] == "fail" and not str(p["site"]).startswith("MTP")]
    assert not main  # the main stack is untouched


class _NoMtp(ReferenceTarget):
    name = "no-mtp"
    capabilities = ReferenceTarget.capabilities - {"mtp"}


def test_a_target_without_mtp_skips_the_mtp_points_saying_so():
    rep = run_replay(OFFICIAL, target=_NoMtp(clamp=False), layers=[0])
    mtp = _mtp(rep)
    assert mtp == []  # a main-layer selection does not replay the MTP layer ...
    rep = run_replay(OFFICIAL, target=_NoMtp(clamp=False))
    mtp = _mtp(rep)
    assert mtp and all(p["status"] == "skipped" and "lacks capability mtp" in p["reason"] for p in mtp)


def test_intended_semantics_reports_the_clamp_as_semantic_not_fail():
    rep = run_replay(OFFICIAL, semantics="intended")
    # both phases: the backward points of the clamped layers are classified by the fork's backward shadow (issue 33)
    st = Counter(p["status"] for p in rep["points"])
    assert st["fail"] == 0 and st["semantic"] > 0, st
    sem = [p for p in rep["points"] if p["status"] == "semantic"]
    from parity.dumpfile import DumpReader

    with DumpReader(OFFICIAL) as d:
        cfg = d.config
    clamped = {i for i in range(cfg.num_hidden_layers)
               if cfg.expert_swiglu_limit(i) or cfg.shared_swiglu_limit(i)}
    assert clamped and {p["layer"] for p in sem} <= clamped
    fwd = [p for p in sem if p["phase"] != "backward"]
    assert {p["site"] for p in fwd} <= {"mlp.routed", "mlp.shared_experts", "mlp", "output"}
    # the clamp is inside the shared expert's SwiGLU: its output cotangent (= the layer output's) is untouched, its
    # VJP is not — its down_proj gradient (fed the clamped activation) and every cotangent upstream of it, down to
    # the layer's dL/d input, differ. Every clamped layer has such semantic backward points.
    bw = [p for p in sem if p["phase"] == "backward"]
    assert {p["layer"] for p in bw} == clamped, Counter(p["layer"] for p in bw)
    assert {p["site"] for p in bw} >= {"grad.mlp.shared_experts.down_proj.weight", "post_attention_layernorm",
                                       "input"}, sorted({p["site"] for p in bw})
    assert not {p["site"] for p in bw} & {"output", "mlp", "mlp.shared_experts"}  # cotangents the clamp cannot move
    assert all("swiglu_clamp" in p["reason"] for p in sem)
    assert rep["semantics"]["explained_points"] == len(sem)
    # the report's keys spell the phase as Point.key does (a backward point is not a decode step)
    keys = rep["semantics"]["explained"]
    assert "backward/L05/input" in keys and not any(k.startswith("decode/S000/") for k in keys), keys[:8]


def test_an_explicit_clamped_reference_instance_keeps_its_setting_and_is_classified():
    """An instance the caller built keeps clamp=True (not overridden by the dump's semantics); its differences at the
    clamped layers are the fork's, so `semantic`."""
    rep = run_replay(OFFICIAL, target=ReferenceTarget(clamp=True))
    st = Counter((p["phase"] == "backward", p["status"]) for p in rep["points"])
    assert st[(False, "fail")] == st[(True, "fail")] == 0 and st[(False, "semantic")] and st[(True, "semantic")], st


def test_a_real_bug_on_a_clamped_layer_stays_a_failure_under_intended_semantics():
    """Negative control: the shared expert scaled by mistake, on a layer the clamp also changes (layer 5: its shared
    expert's clamp is set; one layer is enough to show a fork layer's real bug is not excused as `semantic`)."""
    rep = run_replay(OFFICIAL, target=MutantTarget("moe_shared_expert_scaled", clamp=True), semantics="intended",
                     layers=[5])
    fails = [p for p in rep["points"] if p["status"] == "fail"]
    assert any(p["site"] == "mlp.shared_experts" and p["layer"] >= 5 for p in fails), Counter(
        (p["layer"], p["site"], p["status"]) for p in rep["points"] if p["status"] != "pass")


def test_a_backward_bug_on_a_clamped_layer_stays_a_failure_under_intended_semantics():
    """Negative control of the backward shadow: the shared expert's gradient doubled (forward bit-identical) on a
    layer the clamp changes. The fork explains the clamp's own differences, never the bug: the shared expert's
    cotangent, where the bug starts, fails and is the first divergence. One layer (5, the first clamped one)."""
    rep = run_replay(OFFICIAL, target=MutantTarget("bw_shared_expert_grad_twice", clamp=True), semantics="intended",
                     layers=[5])
    bw = {p["site"]: p["status"] for p in rep["points"] if p["phase"] == "backward" and p["layer"] == 5}
    assert bw["mlp.shared_experts"] == "fail" and "semantic" not in bw.values(), Counter(bw.values())
    fd = rep["first_divergence"]
    assert (fd["phase"], fd["layer"], fd["site"]) == ("backward", 5, "mlp.shared_experts"), fd
    assert fd["source"]["site"] == "mlp.shared_experts"
    # the forward is bit-identical to the clamped reference: its clamp differences stay `semantic`, none fails
    fwd = Counter(p["status"] for p in rep["points"] if p["phase"] != "backward")
    assert fwd["fail"] == 0 and fwd["semantic"] > 0, fwd


def test_semantics_option_is_validated():
    from parity.errors import ParityError

    with pytest.raises(ParityError, match="semantics 'both'"):
        run_replay(OFFICIAL, semantics="both")
