"""What flows through the replay pipeline (DESIGN §2): observations in, typed point records out.

An `Observation` is what a strategy saw at one point — the reference array from the dump, the target's array and
where it came from — and carries no judgement. A `PointRecord` is the judge's verdict on it; `to_json()` gives the
point dict of report.json (DESIGN §8).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.model.points import Point


class Status(str, enum.Enum):
    """Outcome of one point. `str` so a status compares equal to its report.json spelling."""

    PASS = "pass"
    FAIL = "fail"
    BENIGN = "benign"  # routing differs only where the reference's own margin is within the router-score noise
    SEMANTIC = "semantic"  # differs where the dump's runtime departs from the model's intended semantics
    VARIANT = "variant"  # a named, legitimate implementation variant (parity.numerics.variants): counted as passing
    SKIPPED = "skipped"  # not compared, with a reason (declared unavailable, not produced by the target, ...)
    NOT_TESTED = "not-tested"  # deselected by the user (layers, -k): listed, never compared
    MISSING = "missing"  # the target produces the point but the dump lacks it

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Observation:
    """One point as a strategy observed it.

    ref:    the dump's array (None: the dump does not hold the point).
    test:   the target's array (None: the target did not produce it).
    skip:   a reason the strategy could not observe the point at all (e.g. an isolated site's input is not dumped).
    forced: the array comes from a run forced to the reference's expert choice, made in addition to the plain run
            (the judge uses it for the router's downstream points when routing differs benignly).
    positions: absolute token positions of this step; feeds: the dumped sites an isolated site was fed.
    expert_bias: the layer's router bias (routing analysis of `mlp.gate.topk_idx`).
    transform / why_absent: see the fields (protocol v2, targets read through taps).
    rounding: for an isolated RMSNorm site, what its rounding check needs (`parity.numerics.rounding.RmsNormCheck`).
    """

    point: Point
    ref: np.ndarray | None
    test: np.ndarray | None
    mode: str
    skip: str | None = None
    forced: bool = False
    positions: np.ndarray | None = None
    feeds: tuple[str, ...] | None = None
    expert_bias: np.ndarray | None = field(default=None, repr=False)
    # protocol v2: a declared transform (`parity.targets.taps.Transform`) mapping the dump's array into the form the
    # target computed, and the target's own reason when it did not produce the point
    transform: Any = None
    why_absent: str | None = None
    rounding: Any = field(default=None, repr=False)
    # the shadows' payloads at this point (parity.replay.shadows: {kind name: payload}), e.g. `semantic`: the site's
    # arrays from the references following the dump's and the intended semantics, `variant`: the site's array from the
    # reference computing the named variant the target matched upstream; the judge classifies a failure a shadow
    # explains with the status that shadow confers
    shadows: dict = field(default_factory=dict, repr=False)


@dataclass
class PointRecord:
    """The judged outcome of one point. `stats` holds the verdict statistics (`Verdict.to_dict()`) or the routing
    counts, in report.json spelling; `observation` links back to what was judged (not serialised)."""

    point: Point
    status: Status
    reason: str | None = None
    message: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    forced_routing: bool = False
    feeds: tuple[str, ...] | None = None
    observation: Observation | None = field(default=None, repr=False, compare=False)

    @property
    def failed(self) -> bool:
        return self.status in (Status.FAIL, Status.MISSING)

    def to_json(self) -> dict:
        """The report.json point dict (DESIGN §8)."""
        p = self.point
        out: dict[str, Any] = {"phase": p.phase, "step": p.step, "layer": p.layer, "site": p.site}
        out.update(self.stats)
        out["status"] = self.status.value
        if self.reason is not None:
            out["reason"] = self.reason
        if self.message is not None:
            out["message"] = self.message
        if self.forced_routing:
            out["forced_routing"] = True
        if self.feeds is not None:
            out["isolated_inputs"] = list(self.feeds)
        return out


def skipped(point: Point, reason: str, **kw) -> PointRecord:
    return PointRecord(point, Status.SKIPPED, reason=reason, **kw)
