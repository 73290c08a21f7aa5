"""Issue 32 item 3: a target may declare a point in another form (parity.targets.taps: `coarser`, `transposed`,
`fused_part`). A declared coarser point is one named structural difference (status `semantic`, never compared, no
invented numbers); a declared transposed layout / fused part is mapped and compared exactly, and fails when its
values are wrong.

The targets are the reference with one point returned in another form, replaying the bundled tiny fp32 golden dump
(layer 0: KDA, dense MLP), so everything but the declared point passes exactly as the reference does.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parity.golden import DUMPS
from parity.replay import run_replay
from parity.targets.reference import ReferenceTarget
from parity.targets.taps import coarser, fused_part, transposed

DUMP = DUMPS / "tiny-fp32.h5"


class _Reshaped(ReferenceTarget):
    """The reference, with `change(points)` applied to each layer call's points and `declare` as its transforms."""

    name = "reshaped"
    change = staticmethod(lambda pts: None)
    declare: dict = {}

    def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
        res = super().layer_forward(i, hidden, positions, state, forced_topk)
        pts = {k: np.asarray(v) for k, v in res.points.items()}
        type(self).change(pts)
        res.points = pts
        res.transforms = dict(res.transforms or {}, **self.declare)
        return res


def _replay(change, declare):
    tgt = type("T", (_Reshaped,), {"change": staticmethod(change), "declare": declare})()
    return run_replay(DUMP, target=tgt, layers=[0])


def _of(rep, site):
    return [p for p in rep["points"] if p["site"] == site and p["phase"] != "backward"]


PER_HEAD = coarser("the KDA decay", "per head [B,T,H]", "per channel [B,T,H,d]")


def _per_head(pts):
    pts["attention.gate"] = pts["attention.gate"].mean(axis=-1)  # what a per-head port would hand over


def test_a_declared_coarser_point_is_one_named_structural_difference():
    rep = _replay(_per_head, {"attention.gate": PER_HEAD})
    gate = _of(rep, "attention.gate")
    assert gate and all(p["status"] == "semantic" for p in gate), Counter(p["status"] for p in gate)
    assert all("target computes the KDA decay per head [B,T,H]; the dump's is per channel [B,T,H,d]" in p["reason"]
               for p in gate)
    others = Counter(p["status"] for p in rep["points"] if p["site"] != "attention.gate")
    assert set(others) <= {"pass", "benign", "skipped"}, others  # nothing else is touched
    assert rep["first_divergence"] is None
    (d,) = rep["structural_differences"]
    assert d["site"] == "attention.gate" and d["layers"] == [0] and d["points"] == len(gate)
    assert rep["semantics"]["explained_points"] == 0  # no semantic fork is credited with it


def test_a_coarser_point_needs_no_value_from_the_target():
    rep = _replay(lambda pts: pts.pop("attention.gate"), {"attention.gate": PER_HEAD})
    assert {p["status"] for p in _of(rep, "attention.gate")} == {"semantic"}


def test_without_the_declaration_the_same_port_is_a_shape_failure():
    """Negative control: the coarse value undeclared is not silently accepted."""
    rep = _replay(_per_head, {})
    gate = _of(rep, "attention.gate")
    assert gate and all(p["status"] == "fail" for p in gate)
    assert not rep.get("structural_differences")


CORE_T = transposed("attention.core", "B,T,H,d", "B,H,T,d")


def test_a_declared_transposed_layout_is_compared_exactly():
    rep = _replay(lambda pts: pts.update({"attention.core": pts["attention.core"].transpose(0, 2, 1, 3)}),
                  {"attention.core": CORE_T})
    core = _of(rep, "attention.core")
    assert core and all(p["status"] == "pass" for p in core), [(p["status"], p.get("message")) for p in core]
    assert all("B,H,T,d" in p["transform"] for p in core)


def test_a_declared_transposed_layout_with_wrong_values_fails():
    def wrong(pts):  # transposed, but one head's values swapped with another's
        c = pts["attention.core"].transpose(0, 2, 1, 3).copy()
        c[:, [0, 1]] = c[:, [1, 0]]
        pts["attention.core"] = c

    rep = _replay(wrong, {"attention.core": CORE_T})
    core = _of(rep, "attention.core")
    assert core and all(p["status"] == "fail" for p in core)


def test_a_declared_fused_part_is_cut_and_compared_exactly():
    def fuse(pts):  # q, k, v projections returned as one [B,T,3P] tensor for each of the three sites
        qkv = np.concatenate([pts[f"attention.{x}_proj"] for x in "qkv"], axis=-1)
        for x in "qkv":
            pts[f"attention.{x}_proj"] = qkv

    declare = {f"attention.{x}_proj": fused_part(f"attention.{x}_proj", -1, n, 3) for n, x in enumerate("qkv")}
    rep = _replay(fuse, declare)
    for x in "qkv":
        pts = _of(rep, f"attention.{x}_proj")
        assert pts and all(p["status"] == "pass" for p in pts), x
    # the wrong part for q (k's) fails
    declare["attention.q_proj"] = fused_part("attention.q_proj", -1, 1, 3)
    rep = _replay(fuse, declare)
    assert {p["status"] for p in _of(rep, "attention.q_proj")} == {"fail"}


def test_a_transposed_declaration_that_is_no_permutation_is_refused():
    with pytest.raises(ValueError, match=r"target layout \[B,T,H\] is not a permutation of the dump's \[B,T,H,d\]"):
        transposed("attention.gate", "B,T,H,d", "B,T,H")
