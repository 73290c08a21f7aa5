"""Exactness test of isolated mode (issue 15): how many rows of a bf16 site are not bit-identical, against the rate a
correct implementation shows.

Why rows, and why a binomial tail. Fed its own dumped inputs, a correct bf16 site reproduces the reference bit for bit
except where the two implementations' fp32 intermediates differ by a few fp32 ULPs and an element lies that close to
a bf16 rounding boundary. Such differences come per *row*: a norm's rsqrt, a softmax's sum, a GEMM kernel choice are
per-row quantities, so when one is an fp32 ULP off many elements of that row may flip together (the 2026-11-24
element-fraction attempt raised a false alarm on 3 elements of one post_attention_layernorm row). A sub-ULP bug
(an epsilon 1e-6 → 1e-5 in a norm, a bf16 accumulation of the MoE combine) moves *every* row by a small amount, so it
flips elements in many rows. Counting rows with any non-bit-identical element, r of R, and asking how unlikely r is
for a correct implementation whose rows are inexact with probability p0 (the binomial tail P(X ≥ r), X ~ Bin(R, p0))
gives one criterion for small and large tensors alike: a point fails when that tail is below `ALPHA`. Rows are the
last axis, as for the floor; `parity.numerics.compare` counts them (a row with any element whose bits differ, ±0
equal, matching NaN/Inf classes equal) and applies the test.

p0 (`inexact_row_rate` of a tolerance rule) is calibrated per site class from a corpus of correct replays
(`tools/calibrate.py`, `derive_rate`): the pooled rate's one-sided upper confidence bound, raised until no corpus
point is less likely than `CORPUS_TAIL` under it — so the corpus itself sits well inside the pass region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

ALPHA = 1e-6  # a point fails when P(X ≥ r | R, p0) < ALPHA: ~1 false alarm in 10^6 points if p0 is right
CORPUS_TAIL = 1e-3  # every corpus point must have tail ≥ this under the derived p0 (3 decades above ALPHA)
CONFIDENCE = 0.999  # one-sided upper confidence bound of the pooled rate


def tail(r: int, rows: int, p0: float) -> float:
    """P(X ≥ r) for X ~ Binomial(rows, p0): how unlikely r inexact rows are for a correct implementation."""
    if r <= 0:
        return 1.0
    from scipy import stats  # here, not at import: scipy.stats costs ~1 s, and only isolated-mode rules need it

    return float(stats.binom.sf(r - 1, rows, min(max(p0, 0.0), 1.0)))


def rate_that_passes(r: int, rows: int, alpha: float = ALPHA) -> float:
    """The smallest p0 under which r inexact rows of `rows` are not below `alpha` (the 'would pass with' number):
    P(X ≥ r) for X ~ Bin(rows, p) is the regularised incomplete beta I_p(r, rows - r + 1), so p = its inverse."""
    if r <= 0:
        return 0.0
    from scipy import stats

    return float(stats.beta.ppf(alpha, r, rows - r + 1))


@dataclass(frozen=True)
class RateDerivation:
    """How a class's p0 came about (written next to the rule in the generated file)."""

    rate: float
    points: int
    rows: int
    inexact: int
    pooled_bound: float
    worst_point: str | None  # the corpus point that raised the rate above the pooled bound, if any
    worst_r: int
    worst_rows: int


def derive_rate(points: Iterable[tuple[str, int, int]]) -> RateDerivation:
    """p0 for one site class from its corpus points (label, rows, inexact rows): the larger of the pooled rate's
    `CONFIDENCE` upper bound (Clopper-Pearson) and the smallest p under which every point has tail ≥ `CORPUS_TAIL`."""
    from scipy import stats

    pts = list(points)
    if not pts:
        raise ValueError("derive_rate: no corpus points")
    R = sum(p[1] for p in pts)
    r = sum(p[2] for p in pts)
    pooled = float(stats.beta.ppf(CONFIDENCE, r + 1, max(R - r, 1))) if r < R else 1.0
    rate, worst = pooled, None
    for label, rows, k in pts:
        need = rate_that_passes(k, rows, CORPUS_TAIL)
        if need > rate:
            rate, worst = need, (label, k, rows)
    return RateDerivation(rate=min(1.0, rate), points=len(pts), rows=R, inexact=r, pooled_bound=pooled,
                          worst_point=worst and worst[0], worst_r=worst[1] if worst else 0,
                          worst_rows=worst[2] if worst else 0)


def nice_rate(p: float) -> float:
    """p rounded *up* to two significant digits (a generated table stays readable; never below the derived p)."""
    if p <= 0 or p >= 1:
        return min(max(p, 0.0), 1.0)
    e = math.floor(math.log10(p)) - 1
    return min(1.0, math.ceil(p / 10 ** e) * 10 ** e)
