"""Detection resolution (issue 15): the smallest single-site perturbation a rule detects. numpy + ml_dtypes only.

A *trial* plants one perturbation in the reference tensor of one point and asks whether `compare` then fails that
point against the target's (correct) output. Planting in the reference is what `tools/calibrate.py resolution` does:
in every replay mode the target's output of the planted site does not change, so the point's verdict is exactly
`compare(planted_ref, test, rule)`; the earlier points do not change either, so a detected plant is also the first
divergence, i.e. pinned to its site, whenever the unplanted replay passes (the tool checks that).

Two kinds of perturbation of magnitude m, with an independent random sign per element:
- `relative`: x -> x·(1 + m·s), s = ±1: every element off by m of its own magnitude (a wrong scale, eps or
  precision moves whole rows by a relative amount);
- `ulps`: x -> x moved m steps on the comparison grid (`parity.numerics.compare.comparison_grid`), s = ±1 steps:
  the finest change a grid can express, e.g. 1 ULP = a rounding placed differently.
The result is computed on the comparison grid (values rounded RNE to it, as compare does).

`resolution(...)` scans magnitudes upward and returns the smallest one detected in ≥ `rate` of the trials (points ×
seeds), i.e. the resolution of that rule on those points; None if no magnitude of the scan reaches the rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from parity.numerics.compare import compare, comparison_grid
from parity.numerics.tolerances import ToleranceRule
from parity.numerics.ulp import _spec, ordered_int, to_dtype, value_class, FINITE

KINDS = ("relative", "ulps")
RELATIVE_SCAN = tuple(float(f"{m}e{e}") for e in range(-8, 0) for m in (1, 2, 5))  # 1e-8 .. 5e-1
# fp32 tensors of a bf16 run carry bf16-sized noise: 2^16 fp32 ULPs per bf16 ULP, hence the long tail of the scan
ULP_SCAN = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768) + \
    tuple(m * 2**k for k in range(10, 24) for m in (1, 1.5)) + (2**24,)


def _from_ordered(o: np.ndarray, grid: str) -> np.ndarray:
    """Inverse of `ordered_int` on `grid` (sign-magnitude bit pattern from the monotone integer line)."""
    sp = _spec(grid)
    mag = np.abs(o).astype(sp.uint)
    sign = np.where(o < 0, np.array(1 << (sp.bits - 1), sp.uint), np.array(0, sp.uint))
    return (mag | sign).view(sp.np_dtype)


def plant(ref: Any, kind: str, magnitude: float, rng: np.random.Generator, grid: str) -> np.ndarray:
    """`ref` with one perturbation of `kind` and `magnitude` (module docstring), on `grid`. Non-finite values and
    exact zeros (relative kind) stay as they are."""
    r = to_dtype(np.asarray(ref), grid)
    s = rng.choice(np.array([-1, 1]), size=r.shape)
    if kind == "relative":
        out = r.astype(np.float64) * (1.0 + magnitude * s)
        return to_dtype(np.where(value_class(r) == FINITE, out, r.astype(np.float64)), grid)
    if kind == "ulps":
        o = ordered_int(r) + s * int(magnitude)
        lim = int(ordered_int(np.array([_spec(grid).max], _spec(grid).np_dtype))[0])
        moved = _from_ordered(np.clip(o, -lim, lim), grid)
        return np.where(value_class(r) == FINITE, moved, r)
    raise ValueError(f"plant: kind {kind!r}; expected one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Resolution:
    kind: str
    magnitude: float | None  # smallest magnitude detected in ≥ rate of the trials (None: none of the scan)
    rate_at: float | None  # detection rate at that magnitude
    trials: int  # trials per magnitude
    rates: tuple[tuple[float, float], ...]  # (magnitude, detection rate) over the scan, up to the first that reached


def detection_rate(pairs: Sequence[tuple[Any, Any, ToleranceRule]], kind: str, magnitude: float,
                   seeds: Iterable[int]) -> float:
    """Fraction of trials (pair × seed) in which the planted reference fails `compare` against the test."""
    hit = n = 0
    for seed in seeds:
        for i, (ref, test, rule) in enumerate(pairs):
            grid = comparison_grid(np.asarray(ref).dtype, rule)
            rng = np.random.default_rng([seed, i])
            hit += not compare(plant(ref, kind, magnitude, rng, grid), test, rule).passed
            n += 1
    return hit / n if n else 0.0


def resolution(pairs: Sequence[tuple[Any, Any, ToleranceRule]], kind: str, *, seeds: Sequence[int] = (0, 1, 2, 3, 4),
               rate: float = 0.95, scan: Sequence[float] | None = None) -> Resolution:
    """Smallest magnitude of the scan detected in ≥ `rate` of the trials (every pair × every seed). A pair whose
    unplanted comparison already fails would count as detected at any magnitude: such pairs are refused."""
    for i, (ref, test, rule) in enumerate(pairs):
        if not compare(ref, test, rule).passed:
            raise ValueError(f"resolution: pair {i} fails without a plant; the resolution of a failing point is "
                             f"meaningless")
    scan = scan or (RELATIVE_SCAN if kind == "relative" else ULP_SCAN)
    rates = []
    for m in scan:
        r = detection_rate(pairs, kind, m, seeds)
        rates.append((m, r))
        if r >= rate:
            return Resolution(kind, m, r, len(pairs) * len(seeds), tuple(rates))
    return Resolution(kind, None, None, len(pairs) * len(seeds), tuple(rates))


# ------------------------------------------------------------------------------------------------ the table
def collect(dump: Any, mode: str) -> tuple[dict[str, list], int, str]:
    """{site class: [(ref, test, rule), ...]} of one replay of `dump` by the reference target in `mode`; the number of
    pairs left out because they fail unplanted; the compute dtype. The layer's `input` (fed, not computed) and exact
    (integer) tensors are left out."""
    from parity.model.points import site_class
    from parity.replay import Session, observe, observe_free, observe_model_points

    by_class: dict[str, list] = {}
    failing = 0
    with Session.open(dump, mode=mode) as s:
        streams = [observe_free(s)] if mode == "free" else \
            [observe(s, i) for i in s.layers()] + [observe_model_points(s)]
        for obs in (o for st in streams for o in st):
            p = obs.point
            if obs.skip or obs.ref is None or obs.test is None or obs.forced or p.site == "input":
                continue
            ref = np.asarray(obs.ref)
            if ref.dtype.kind not in "f" and ref.dtype.name != "bfloat16":
                continue  # top-k ids compare exactly
            test = np.asarray(obs.test).reshape(ref.shape)
            rule = s.rules.rule_for(p.site, mode, s.dump.dtype(p), s.dtype)
            if not compare(ref, test, rule).passed:
                failing += 1
                continue
            by_class.setdefault(site_class(p.site), []).append((ref, test, rule))
        return by_class, failing, s.dtype


def spaced(pairs: Sequence[Any], limit: int) -> list[Any]:
    """At most `limit` of `pairs`, evenly spaced (first and last kept)."""
    if len(pairs) <= limit:
        return list(pairs)
    idx = np.linspace(0, len(pairs) - 1, limit).round().astype(int)
    return [pairs[i] for i in sorted(set(idx))]


def table_rows(by_class: dict[str, list], *, limit: int, seeds: Sequence[int], rate: float) -> list[dict]:
    """One row per site class: points used, smallest `relative` and `ulps` magnitude detected in ≥ rate, trials."""
    rows = []
    for cls, pairs in sorted(by_class.items()):
        pairs = spaced(pairs, limit)
        rel = resolution(pairs, "relative", seeds=seeds, rate=rate)
        ulp = resolution(pairs, "ulps", seeds=seeds, rate=rate)
        rows.append({"class": cls, "points": len(pairs), "relative": rel.magnitude, "ulps": ulp.magnitude,
                     "trials": rel.trials})
    return rows


__all__ = ["KINDS", "RELATIVE_SCAN", "ULP_SCAN", "Resolution", "collect", "detection_rate", "plant", "resolution",
           "spaced", "table_rows"]
