"""Isolated mode's backward phase (issue 33 item 3): every sub-module's VJP on its own dumped inputs and cotangent
(`parity.replay.strategies.observe_isolated_backward`, `Target.submodule_backward`).

On the bundled bf16 golden `tiny-flash-bf16` (100 tokens: the chunked KDA's VJP), one layer each, so the replays stay
short: layer 0 is KDA + dense MLP. What isolated mode promises is the test's subject: a bug in one sub-module's VJP
fails exactly the backward points that VJP computes, every other point (fed the dump's own cotangents, not the
buggy ones) passes as in the clean run.
"""

from __future__ import annotations

from collections import Counter

import pytest

from parity.dumpfile import DumpReader
from parity.golden import DUMPS
from parity.model.points import backward_sites
from parity.replay import run_replay
from parity.targets.base import Target
from parity.targets.mutants import MutantTarget
from parity.targets.reference import ReferenceTarget

BF16 = DUMPS / "tiny-flash-bf16.h5"
OFFICIAL = DUMPS / "tiny-flash-official-bf16.h5"
KDA_DENSE = 0  # tiny-flash layout: layers 0-1 KDA + dense MLP, 2-4 KDA + MoE, 5-7 MLA + MoE


def _backward(rep, layer: int) -> dict[str, dict]:
    return {p["site"]: p for p in rep["points"] if p["phase"] == "backward" and p["layer"] == layer}


@pytest.fixture(scope="module")
def clean():
    return run_replay(BF16, mode="isolated", layers=[KDA_DENSE])


def test_isolated_mode_replays_every_backward_point_of_a_layer(clean):
    with DumpReader(BF16) as d:
        owed = set(backward_sites(d.config, KDA_DENSE))
    bw = _backward(clean, KDA_DENSE)
    assert set(bw) == owed
    st = Counter(p["status"] for p in bw.values())
    # every point compared and passing: the cotangents, dL/d input and each weight gradient (`output` is fed)
    assert st == {"pass": len(owed)}, {s: p.get("reason") for s, p in bw.items() if p["status"] != "pass"}
    assert clean["passed"]


def test_a_backward_bug_fails_exactly_the_points_its_vjp_computes():
    """bw_kda_gate_detached: the decay gate's VJP is zero (forward bit-identical). Its VJP alone computes f_proj's
    cotangent and the A_log / dt_bias gradients; f_proj's weight gradient is fed the dump's f_proj cotangent and the
    gate's own cotangent comes from the KDA core's VJP, so both pass."""
    rep = run_replay(BF16, mode="isolated", layers=[KDA_DENSE], target=MutantTarget("bw_kda_gate_detached"))
    bw = _backward(rep, KDA_DENSE)
    failed = {s for s, p in bw.items() if p["status"] == "fail"}
    assert failed == {"attention.f_proj", "grad.attention.A_log", "grad.attention.dt_bias"}, failed
    assert {p["status"] for s, p in bw.items() if s not in failed} == {"pass"}
    assert not [p for p in rep["points"] if p["phase"] != "backward" and p["status"] == "fail"]  # forward intact
    assert not rep["passed"]


class _NoIsolatedBackward(ReferenceTarget):
    """A target with both capabilities that has no isolated VJP (the protocol's default)."""

    name = "no-isolated-backward"
    submodule_backward = Target.submodule_backward


def test_points_isolated_mode_cannot_replay_are_skipped_saying_why():
    # the official runtime computes the MLA head gate inline: `attention.gate` is not in the dump, so the VJP of
    # `attention.dense:in` (core x gate) cannot run, and the cotangents only it computes are skipped naming it
    rep = run_replay(OFFICIAL, mode="isolated", layers=[5])
    bw = _backward(rep, 5)
    skipped = {s: p["reason"] for s, p in bw.items() if p["status"] == "skipped"}
    assert set(skipped) == {"attention.core", "attention.gate", "attention.g_proj"}, skipped
    assert all("prefill/L05/attention.gate" in r or "backward/L05/attention.gate" in r for r in skipped.values())
    assert {p["status"] for s, p in bw.items() if s not in skipped} == {"pass"}
    # a target without `submodule_backward`: every backward point skipped with the reason, none silently
    rep = run_replay(BF16, mode="isolated", layers=[KDA_DENSE], target=_NoIsolatedBackward())
    bw = _backward(rep, KDA_DENSE)
    assert bw and all(p["status"] == "skipped" and "does not implement submodule_backward" in p["reason"]
                      for p in bw.values())
