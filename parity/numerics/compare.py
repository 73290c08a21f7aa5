"""Compare one point: `compare(ref, test, rule) -> Verdict` (DESIGN §5 hybrid rule). numpy + ml_dtypes only.

Float tensors, on the grid of dtype `D` = the `dtype` argument, else `comparison_grid` (`rule.compare_dtype`, else the
reference's dtype = the precision the tensor was computed in; both sides rounded RNE to `D`; an fp32 tensor compared
"in bf16" is rounded first):
 0. NaN / +Inf / -Inf are classes (parity.numerics.ulp): a class mismatch (NaN or Inf where the other side is finite,
    +Inf vs -Inf, NaN vs Inf) is a failure counted in `nan_inf_mismatches` and left out of every statistic; matching
    NaN/NaN, +Inf/+Inf, -Inf/-Inf count as equal (0 ULP).
 1. absolute floor: an element with |a - b| ≤ floor_ulps · ulp_D(RMS of the finite reference values of its row)
    passes (row = last axis; a 0-d tensor is one row). Its *effective* ULP distance is 0.
 2. every other element gets its ULP distance on D's monotone integer line (its effective ULP distance).
 3. pass iff no NaN/Inf mismatch, at most `allowed_over_count(allowed_fraction, n)` elements have an effective ULP
    distance above `max_ulps`, none is above `hard_ulps` (each limit only if not off), — if the rule has rtol/atol
    (the fp32 tier) — every element outside the floor has |a - b| ≤ atol + rtol·|ref| (elementwise, as
    torch.testing.assert_close; rtol/atol off count as 0), and — if the rule has `bound_rms` — every finite element
    outside the floor has |a - b| ≤ bound_rms · RMS of its reference row: the per-element safety bound, which
    `allowed_fraction` never relaxes (so a few elements of finite garbage fail; reasoning: parity.calibration.bounds),
    and — if the rule has `inexact_row_rate` p0 (isolated mode) — the r rows holding any non-bit-identical element are
    not less likely than exactness.ALPHA under Binomial(rows, p0) (the exactness test: parity.numerics.exactness),
    and — if the rule has `max_rel_l2` (the bf16 gradient rules) — the whole tensor's rel-L2 (finite pairs, on the
    grid) is at most it: a per-tensor criterion no floor or allowed fraction relaxes (parity.calibration.gradients).
Statistics: `max_ulp`, `p50/p99/p999_ulp` are effective (after the floor) — the numbers the rule judges;
`max_diff_rms` = the largest |a - b| / RMS(reference row) of any finite element (the smallest `bound_rms` that passes;
inf where a row with RMS 0 has a difference);
`max_ulp_raw`, `frac_exact`, `frac_le1_ulp` use the raw ULP distance (bit-level facts); rel-L2, cosine and |Δ| use the
finite pairs in float64. Percentiles are attained values (numpy "inverted_cdf": p99 = smallest v with ≥ 99 % ≤ v).

Integer / bool tensors (e.g. router top-k ids) compare exactly; the rule is recorded but not used.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any

import numpy as np

from parity.errors import ParityError
from parity.numerics import exactness
from parity.numerics.tolerances import ToleranceRule
from parity.numerics.ulp import DTYPE_NAMES, FINITE, dtype_name, ordered_int, to_dtype, ulp_of, value_class


class ComparisonError(ParityError):
    """Two tensors that cannot be compared at all (shape mismatch, no ULP convention for the dtype, ...)."""


@functools.lru_cache(maxsize=4096)  # exact Fraction arithmetic, asked again for every point of the same size
def allowed_over_count(allowed_fraction: float, n: int) -> int:
    """How many of n elements may be above max_ulps: floor(allowed_fraction · n), with the fraction taken as
    written in decimal (0.001 · 1000 = 1, 0.3 · 10 = 3) so binary rounding of the fraction never costs an element."""
    return int(math.floor(Fraction(repr(float(allowed_fraction))) * n))


@dataclass(frozen=True)
class Verdict:
    """Outcome and statistics of one comparison. Index tuples are into the compared tensors' shape."""

    passed: bool
    name: str
    n: int
    shape: tuple[int, ...]
    dtype: str  # grid the comparison ran on (or the integer dtype)
    max_ulp: int | None  # effective (after the floor)
    p50_ulp: int | None
    p99_ulp: int | None
    p999_ulp: int | None
    max_ulp_raw: int | None  # before the floor
    frac_exact: float | None  # bit-equal (±0 equal, matching NaN/Inf equal)
    frac_le1_ulp: float | None
    n_floored: int  # elements with |Δ| > 0 passed by the absolute floor
    floor_abs_max: float | None  # largest absolute floor of any row
    n_over: int  # effective ULP above max_ulps
    frac_over: float
    allowed_over: int  # how many may be above max_ulps
    n_hard: int  # effective ULP above hard_ulps
    n_tol_fail: int  # outside the floor and outside atol + rtol·|ref|
    n_bound: int  # outside the floor and beyond the per-element safety bound bound_rms·RMS(row)
    max_diff_rms: float | None  # largest |Δ| / RMS(reference row) of any finite element
    bound_index: tuple[int, ...] | None  # the element furthest beyond the bound (in row-RMS units), if any
    bound_ref: float | None
    bound_test: float | None
    rel_l2: float | None
    cosine: float | None
    max_abs_diff: float | None
    max_abs_index: tuple[int, ...] | None
    worst_index: tuple[int, ...] | None  # greatest effective ULP; else greatest |Δ|; None if all equal
    worst_ulp: int | None
    worst_ref: float | None
    worst_test: float | None
    nan_inf_mismatches: int
    first_nan_inf_index: tuple[int, ...] | None
    first_nan_inf_ref: float | None
    first_nan_inf_test: float | None
    rule: dict
    rows: int | None  # rows (last axis) of the comparison
    inexact_rows: int | None  # rows with any element whose bits differ (valid elements)
    exactness_p: float | None  # P(≥ inexact_rows | rows, rule's inexact_row_rate); None without that rate
    min_passing_max_ulps: int | None  # smallest max_ulps that passes the fraction criterion
    min_passing_hard_ulps: int | None  # smallest hard_ulps that passes (= max_ulp)

    def to_dict(self) -> dict:
        """JSON-able: tuples become lists, non-finite floats become the strings 'nan', 'inf', '-inf'."""
        # _jsonable copies every list and dict it meets, so asdict's deep copy would only do the work twice
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    def message(self) -> str:
        """Multi-line explanation in the style of torch.testing.assert_close."""
        where = f" [{self.name}]" if self.name else ""
        if self.dtype not in DTYPE_NAMES:  # integer / bool tensors, compared exactly
            if self.passed:
                return f"Tensors are equal{where}: {self.n} {self.dtype} elements compared exactly."
            return (f"Tensors are not equal{where} ({self.dtype}, exact comparison)\n\n"
                    f"Mismatched elements: {self.n_over} / {self.n} ({_pct(self.frac_over)})\n"
                    f"Greatest absolute difference: {_g(self.max_abs_diff)} at index {self.worst_index} "
                    f"(ref {_g(self.worst_ref)}, test {_g(self.worst_test)})")
        rule = ToleranceRule(**self.rule).describe()
        head = "Tensor-likes are close" if self.passed else "Tensor-likes are not close!"
        lines = [f"{head}{where} compared in {self.dtype} (rule: {rule})", ""]
        r = self.rule
        if r["max_ulps"] is not None:
            lines.append(f"Mismatched elements: {self.n_over} / {self.n} ({_pct(self.frac_over)}) above "
                         f"{r['max_ulps']} ULP after the floor (allowed {_pct(r['allowed_fraction'])} = "
                         f"{self.allowed_over} element{'s' * (self.allowed_over != 1)})")
        if r["hard_ulps"] is not None and self.n_hard:
            lines.append(f"Elements above the hard limit of {r['hard_ulps']} ULP: {self.n_hard}")
        if r["rtol"] is not None or r["atol"] is not None:
            lines.append(f"Elements outside |Δ| ≤ atol + rtol·|ref| (rtol {r['rtol'] or 0:g}, atol {r['atol'] or 0:g}) "
                         f"after the floor: {self.n_tol_fail} / {self.n}")
        if r.get("bound_rms") is not None and self.n_bound:
            lines.append(f"Elements beyond the per-element safety bound |Δ| ≤ {r['bound_rms']:g}×row RMS: "
                         f"{self.n_bound} / {self.n}; furthest at index {self.bound_index} (|Δ| = "
                         f"{_g(self.max_diff_rms, 4)}×row RMS, ref {_g(self.bound_ref)}, test {_g(self.bound_test)})")
        if r.get("max_rel_l2") is not None and self.rel_l2 is not None and self.rel_l2 > r["max_rel_l2"]:
            lines.append(f"Tensor rel-L2 {_g(self.rel_l2, 4)} above the per-tensor ceiling {r['max_rel_l2']:g} (a "
                         f"correct implementation's whole-tensor error is below it)")
        if self.exactness_p is not None and self.inexact_rows:
            lines.append(f"Rows not bit-identical: {self.inexact_rows} / {self.rows}; a correct implementation "
                         f"(rate ≤ {r['inexact_row_rate']:.2g} per row) gives so many with probability "
                         f"{self.exactness_p:.3g} (fails below {exactness.ALPHA:g})")
        if self.nan_inf_mismatches:
            lines.append(f"NaN/Inf mismatches: {self.nan_inf_mismatches}, first at index {self.first_nan_inf_index} "
                         f"(ref {_g(self.first_nan_inf_ref)}, test {_g(self.first_nan_inf_test)})")
        if self.worst_index is not None:
            d = abs(self.worst_ref - self.worst_test)
            lines.append(f"Greatest ULP distance: {self.worst_ulp} at index {self.worst_index} "
                         f"(ref {_g(self.worst_ref)}, test {_g(self.worst_test)}, |Δ| {_g(d)})")
            lines.append(f"Greatest absolute difference: {_g(self.max_abs_diff)} at index {self.max_abs_index}")
        if self.max_ulp is not None:
            lines.append(f"ULP after the floor: p50 {self.p50_ulp}, p99 {self.p99_ulp}, p99.9 {self.p999_ulp}, max "
                         f"{self.max_ulp} (before the floor: max {self.max_ulp_raw}; {self.n_floored} element(s) "
                         f"passed by the floor |Δ| ≤ {_g(self.floor_abs_max)})")
            lines.append(f"Exact {_pct(self.frac_exact)}, ≤ 1 ULP {_pct(self.frac_le1_ulp)}, rel-L2 {_g(self.rel_l2)}, "
                         f"cosine {_g(self.cosine, 9)}, largest |Δ| {_g(self.max_diff_rms, 4)}×row RMS")
        if not self.passed:
            if self.nan_inf_mismatches:
                lines.append("No tolerance passes while NaN/Inf classes differ.")
            else:
                lines += self._would_pass()
        return "\n".join(lines)

    def _would_pass(self) -> list[str]:
        """What the rule would need for this point to pass — every number that matters, so that no limit reads as
        enough while a few outliers hide behind the allowed fraction (each failing criterion is one line)."""
        r, need = self.rule, []
        if r["max_ulps"] is not None and self.n_over > self.allowed_over and self.min_passing_max_ulps is not None:
            k, a = self.min_passing_max_ulps, self.allowed_over
            if k < (self.max_ulp or 0):
                need.append(f"max_ulps ≥ {k} with allowed_fraction {_pct(r['allowed_fraction'])} (which lets ≤ {a} "
                            f"element{'s' * (a != 1)} stay above {k} ULP: the largest is {self.max_ulp} ULP); "
                            f"with every element within the limit: max_ulps ≥ {self.max_ulp}")
            else:
                need.append(f"max_ulps ≥ {k} (with any allowed_fraction: no element is above it)")
        if r["hard_ulps"] is not None and self.n_hard:
            need.append(f"hard_ulps ≥ {self.min_passing_hard_ulps}")
        if self.n_tol_fail:
            need.append(f"a wider rtol/atol ({self.n_tol_fail} element(s) outside atol + rtol·|ref|)")
        if self.n_bound:
            need.append(f"bound_rms ≥ {self.max_diff_rms:.3g} — the per-element safety bound "
                        f"({r['bound_rms']:g}×row RMS) that no correct implementation is expected to exceed")
        if r.get("max_rel_l2") is not None and self.rel_l2 is not None and self.rel_l2 > r["max_rel_l2"]:
            need.append(f"max_rel_l2 ≥ {self.rel_l2:.3g} — the per-tensor ceiling ({r['max_rel_l2']:g}) that no correct "
                        "implementation is expected to exceed")
        if self.exactness_p is not None and self.exactness_p < exactness.ALPHA:
            need.append(f"inexact_row_rate ≥ {exactness.rate_that_passes(self.inexact_rows, self.rows):.3g} — "
                        f"{self.inexact_rows} of {self.rows} rows are not bit-identical, where a correct "
                        f"implementation leaves a row inexact at a rate ≤ {r['inexact_row_rate']:.2g}")
        if not need:
            return []
        return ["Would pass only with all of:"] + [f"  - {x}" for x in need]


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _g(x: Any, digits: int = 8) -> str:
    return "-" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(flat), shape))


def comparison_grid(tensor_dtype: Any, rule: ToleranceRule | None = None) -> str:
    """The grid a tensor is compared on (DESIGN §5, issue 15): the precision it was *computed* in — the dtype the
    reference produced and stored it in (an fp32 router logit, KDA gate / beta / state or top-k weight of a bf16 run is
    compared in fp32, bf16 activations in bf16) — unless the rule names a `compare_dtype`. Rounding an fp32 tensor to
    bf16 first would erase exactly the rounding a precision-placement bug changes (a router GEMM in bf16 moves the fp32
    logits by ≤ ½ bf16 ULP: 0 ULP after rounding both sides, up to 2^15 fp32 ULP before). The rule for such a
    point is looked up by (site, mode, tensor dtype, compute dtype) — e.g. float32 under compute bfloat16 — and is
    calibrated on that grid for that site class."""
    return dtype_name(rule.compare_dtype if rule is not None and rule.compare_dtype else tensor_dtype)


def compare(ref: Any, test: Any, rule: ToleranceRule, *, name: str = "", dtype: Any = None) -> Verdict:
    """Compare `test` against the reference `ref` under `rule` (module docstring). Never raises on values
    (NaN/Inf are data); raises ComparisonError on a shape mismatch or a dtype with no comparison convention."""
    ref, test = np.asarray(ref), np.asarray(test)
    label = f"compare[{name}]" if name else "compare"
    if ref.shape != test.shape:
        raise ComparisonError(f"{label}: shape mismatch: reference {ref.shape}, test {test.shape}")
    for side, a in (("reference", ref), ("test", test)):
        if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":
            raise ComparisonError(f"{label}: {side} has dtype {a.dtype}; expected a float, integer or bool tensor")
    if ref.dtype.kind in "biu":
        if dtype is not None:
            raise ComparisonError(f"{label}: reference is {ref.dtype}; integer tensors compare exactly, not in {dtype}")
        return _compare_exact(ref, test, rule, name)
    try:
        cdt = dtype_name(dtype) if dtype is not None else comparison_grid(ref.dtype, rule)
    except ParityError as e:
        raise ComparisonError(f"{label}: {e}; pass dtype= to choose the grid") from None
    r, t = to_dtype(ref, cdt), to_dtype(test, cdt)
    if r.size > BLOCKED_ABOVE:  # the same verdict, block by block (a real vocabulary's weight gradients: 2.4e8 values)
        return _compare_float_blocked(r, t, rule, name, cdt)
    return _compare_float(r, t, rule, name, cdt)


def _compare_exact(ref: np.ndarray, test: np.ndarray, rule: ToleranceRule, name: str) -> Verdict:
    n = ref.size
    exact_ints = test.dtype.kind in "biu"
    r = ref.astype(np.int64) if exact_ints else ref.astype(np.float64)
    t = test.astype(np.int64) if exact_ints else test.astype(np.float64)
    bad = ~(r == t)  # NaN in a float test compares unequal
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(r.astype(np.float64) - t.astype(np.float64)).ravel()
    n_bad = int(bad.sum())
    worst = None
    if n_bad:
        d = np.where(bad.ravel(), np.nan_to_num(diff, nan=np.inf), -1.0)
        worst = int(np.argmax(d))
    return Verdict(
        passed=n_bad == 0, name=name, n=n, shape=tuple(ref.shape), dtype=str(ref.dtype),
        max_ulp=None, p50_ulp=None, p99_ulp=None, p999_ulp=None, max_ulp_raw=None,
        frac_exact=(n - n_bad) / n if n else None, frac_le1_ulp=None, n_floored=0, floor_abs_max=None,
        n_over=n_bad, frac_over=n_bad / n if n else 0.0, allowed_over=0, n_hard=0, n_tol_fail=0,
        n_bound=0, max_diff_rms=None, bound_index=None, bound_ref=None, bound_test=None,
        rel_l2=None, cosine=None,
        max_abs_diff=float(diff[worst]) if worst is not None else (0.0 if n else None),
        max_abs_index=_index(worst, ref.shape) if worst is not None else None,
        worst_index=_index(worst, ref.shape) if worst is not None else None, worst_ulp=None,
        worst_ref=float(ref.ravel()[worst]) if worst is not None else None,
        worst_test=float(test.ravel()[worst]) if worst is not None else None,
        nan_inf_mismatches=0, first_nan_inf_index=None, first_nan_inf_ref=None, first_nan_inf_test=None,
        rule=rule.to_dict(), rows=None, inexact_rows=None, exactness_p=None, min_passing_max_ulps=None,
        min_passing_hard_ulps=None)


@functools.lru_cache(maxsize=4096)
def percentile_rank(q: str, m: int) -> int:
    """0-based rank of the q-th percentile of m sorted values, "inverted_cdf" (smallest v with ≥ q % of values ≤ v),
    computed with exact fractions so 99.9 % of 1000 is rank 998, not 999."""
    return max(math.ceil(Fraction(q) / 100 * m) - 1, 0)


def _kth_smallest(e: np.ndarray, ranks: list[int]) -> list[int]:
    """Order statistics of non-negative ints: a histogram for small values (almost all ULP distances) and an exact
    sort of the rare large ones — much faster than sorting or np.partition on 10^7 mostly-equal values."""
    cap = 4096
    small = e < cap
    cum = np.cumsum(np.bincount(e[small], minlength=cap))
    big = np.sort(e[~small])
    return [int(np.searchsorted(cum, k, side="right")) if k < cum[-1] else int(big[k - cum[-1]]) for k in ranks]


def _row_rms(rv: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """RMS over the last axis of the finite reference values of a [rows, last] array (keepdims)."""
    x = np.where(finite, rv, 0.0)
    count = np.maximum(finite.sum(axis=-1, keepdims=True), 1)
    return np.sqrt((x * x).sum(axis=-1, keepdims=True) / count)


def _compare_float(r: np.ndarray, t: np.ndarray, rule: ToleranceRule, name: str, cdt: str) -> Verdict:
    shape, n = tuple(r.shape), r.size
    # Work on [rows, last axis]; a 0-d tensor is one row of one element. Indices are mapped back to `shape`.
    last = shape[-1] if r.ndim else 1
    rows = (n // last, last) if n else (0, 1)
    r, t = r.reshape(rows), t.reshape(rows)
    cr, ct = value_class(r), value_class(t)
    mism = cr != ct  # class mismatch: failure, excluded from statistics
    fin = (cr == FINITE) & (ct == FINITE)
    valid = ~mism
    rv, tv = r.astype(np.float64), t.astype(np.float64)
    raw = np.abs(ordered_int(r) - ordered_int(t))  # ULP distance on the integer line (parity.numerics.ulp)
    if not fin.all():  # NaN/Inf: values 0 so they drop out of norms and |Δ|; matching pairs count as 0 ULP
        rv[cr != FINITE] = 0.0
        tv[ct != FINITE] = 0.0
        raw[~fin] = 0
    diff = np.abs(rv - tv)
    diff[~fin] = 0.0

    # 1. absolute floor, per row (DESIGN §5)
    rms = _row_rms(rv, cr == FINITE)
    floor_abs = rule.floor_ulps * ulp_of(rms, cdt)
    within = fin & (diff <= floor_abs)
    with np.errstate(divide="ignore", invalid="ignore"):  # a row of RMS 0: any difference is infinitely many RMS
        ratio = np.where(diff > 0, diff / rms, 0.0)
    # 2. effective ULP distance
    eff = np.where(within, 0, raw)
    # 3. criteria
    allowed = allowed_over_count(rule.allowed_fraction, n)
    n_over = int((valid & (eff > rule.max_ulps)).sum()) if rule.max_ulps is not None else 0
    n_hard = int((valid & (eff > rule.hard_ulps)).sum()) if rule.hard_ulps is not None else 0
    n_tol_fail = 0
    if rule.has_allclose:
        lim = (rule.atol or 0.0) + (rule.rtol or 0.0) * np.abs(rv)
        n_tol_fail = int((fin & ~within & (diff > lim)).sum())
    n_bound, bound_at = 0, None
    if rule.bound_rms is not None:  # per-element safety bound: no allowed fraction (parity.calibration.bounds)
        beyond = fin & ~within & (ratio > rule.bound_rms)
        n_bound = int(beyond.sum())
        if n_bound:
            bound_at = int(np.argmax(np.where(beyond, ratio, -1.0)))
    n_mism = int(mism.sum())
    n_rows = rows[0]
    n_inexact = int((valid & (raw != 0)).any(axis=-1).sum()) if n else 0  # rows with any bit-different element
    p_exact = exactness.tail(n_inexact, n_rows, rule.inexact_row_rate) if rule.inexact_row_rate is not None else None
    rf, tf = rv[fin], tv[fin]
    nr, nt = float(np.sqrt((rf * rf).sum())), float(np.sqrt((tf * tf).sum()))
    nd = float(np.sqrt(((tf - rf) ** 2).sum()))
    rel_l2 = (nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf)) if rf.size else None
    # per-tensor criterion (gradients): the whole tensor's error, which no floor or allowed fraction relaxes (no
    # finite pair at all: rel_l2 None, nothing to measure; NaN/Inf class mismatches fail on their own above)
    rel_l2_ok = rule.max_rel_l2 is None or rel_l2 is None or rel_l2 <= rule.max_rel_l2
    passed = (n_mism == 0 and n_over <= allowed and n_hard == 0 and n_tol_fail == 0 and n_bound == 0
              and (p_exact is None or p_exact >= exactness.ALPHA) and rel_l2_ok)

    # statistics
    e_valid = eff[valid]
    stats: dict[str, Any] = dict(max_ulp=None, p50_ulp=None, p99_ulp=None, p999_ulp=None, max_ulp_raw=None,
                                 min_passing_max_ulps=None, min_passing_hard_ulps=None)
    if e_valid.size:
        m = e_valid.size
        p50, p99, p999 = (percentile_rank(q, m) for q in ("50", "99", "99.9"))
        # count(eff > M) ≤ allowed  ⟺  M ≥ the (allowed+1)-th largest effective distance (0 if allowed ≥ m)
        k_allowed = m - 1 - allowed if allowed < m else 0
        p50, p99, p999, kth = _kth_smallest(e_valid, [p50, p99, p999, k_allowed])
        stats.update(max_ulp=int(e_valid.max()), p50_ulp=p50, p99_ulp=p99, p999_ulp=p999,
                     max_ulp_raw=int(raw[valid].max()),
                     min_passing_max_ulps=kth if allowed < m else 0,
                     min_passing_hard_ulps=int(e_valid.max()))
    frac_exact = float((valid & (raw == 0)).sum() / n) if n else None
    frac_le1 = float((valid & (raw <= 1)).sum() / n) if n else None

    if not rf.size:
        cosine = None
    elif nr > 0 and nt > 0:
        cosine = float(np.clip((rf * tf).sum() / (nr * nt), -1.0, 1.0))
    else:
        cosine = 1.0 if nr == nt else 0.0

    flat_eff = np.where(valid, eff, -1).ravel()
    flat_diff = diff.ravel()
    max_abs_i = int(np.argmax(flat_diff)) if n else None
    if n and flat_eff.max() > 0:
        worst = int(np.argmax(flat_eff))
    elif n and flat_diff[max_abs_i] > 0:
        worst = max_abs_i
    else:
        worst = None
    first_bad = int(np.flatnonzero(mism.ravel())[0]) if n_mism else None
    return Verdict(
        passed=passed, name=name, n=n, shape=shape, dtype=cdt,
        frac_exact=frac_exact, frac_le1_ulp=frac_le1,
        n_floored=int((within & (diff > 0)).sum()),
        floor_abs_max=float(np.max(floor_abs)) if n else None,
        n_over=n_over, frac_over=n_over / n if n else 0.0, allowed_over=allowed, n_hard=n_hard,
        n_tol_fail=n_tol_fail, n_bound=n_bound,
        max_diff_rms=float(ratio[fin].max()) if fin.any() else None,
        bound_index=_index(bound_at, shape) if bound_at is not None else None,
        bound_ref=float(rv.ravel()[bound_at]) if bound_at is not None else None,
        bound_test=float(tv.ravel()[bound_at]) if bound_at is not None else None,
        rel_l2=rel_l2, cosine=cosine,
        max_abs_diff=float(flat_diff[max_abs_i]) if n and fin.any() else None,
        max_abs_index=_index(max_abs_i, shape) if n and fin.any() else None,
        worst_index=_index(worst, shape) if worst is not None else None,
        worst_ulp=int(flat_eff[worst]) if worst is not None else None,
        worst_ref=float(rv.ravel()[worst]) if worst is not None else None,
        worst_test=float(tv.ravel()[worst]) if worst is not None else None,
        nan_inf_mismatches=n_mism,
        first_nan_inf_index=_index(first_bad, shape) if first_bad is not None else None,
        first_nan_inf_ref=float(r.astype(np.float64).ravel()[first_bad]) if first_bad is not None else None,
        first_nan_inf_test=float(t.astype(np.float64).ravel()[first_bad]) if first_bad is not None else None,
        rule=rule.to_dict(), rows=n_rows, inexact_rows=n_inexact, exactness_p=p_exact, **stats)


# ------------------------------------------------------------------------------------------------ block by block
# `_compare_float` above is the readable reference; it holds a dozen float64 / int64 temporaries of the tensor's size,
# so a real vocabulary's embedding or head gradient ([157184, 1536]: 2.4e8 values, one row in `compare_gradient`)
# needs > 24 GB. `_compare_float_blocked` gives the same verdict with memory bounded by one block: the per-row RMS
# first (whole rows per block, each summed as the reference sums it; a row longer than a block is summed in column
# pieces, which can differ in its last bits), then each block's criteria and statistics, merged. The counts, maxima,
# indices and percentiles are the reference's exactly (the percentiles from a merged histogram of the small effective
# distances and the rare large ones kept); the norms behind rel-L2 and cosine are sums of per-block sums (last-bit
# differences). tests/test_numerics_compare.py checks the two agree.
BLOCKED_ABOVE = 1 << 24  # tensors with more elements are compared block by block
BLOCK_ELEMENTS = 1 << 22  # elements per block (a few hundred MB of temporaries)
_HIST_CAP = 4096  # effective distances below this are counted in a histogram (`_kth_smallest`'s split)


def _pieces(n_rows: int, last: int, block: int):
    """(row, first column, end column, rows) pieces in flat order: whole rows, `block // last` at a time, or one row
    in column pieces of `block` when a row is longer than a block."""
    if last <= block:
        step = max(1, block // last)
        for r0 in range(0, n_rows, step):
            yield r0, 0, last, min(step, n_rows - r0)
    else:
        for r0 in range(n_rows):
            for c0 in range(0, last, block):
                yield r0, c0, min(c0 + block, last), 1


def _compare_float_blocked(r: np.ndarray, t: np.ndarray, rule: ToleranceRule, name: str, cdt: str,
                           block: int = BLOCK_ELEMENTS) -> Verdict:
    """`_compare_float`'s verdict computed block by block (the section comment above)."""
    shape, n = tuple(r.shape), r.size
    last = shape[-1] if r.ndim else 1
    n_rows = n // last
    r2, t2 = r.reshape(n_rows, last), t.reshape(n_rows, last)
    pieces = list(_pieces(n_rows, last, block))

    def part(a: np.ndarray, row: int, c0: int, c1: int, k: int) -> np.ndarray:
        return a[row:row + k, c0:c1]

    # pass 1: the RMS of each row's finite reference values (as `_row_rms`)
    sq = np.zeros((n_rows, 1))
    cnt = np.zeros((n_rows, 1))
    for row, c0, c1, k in pieces:
        rp = part(r2, row, c0, c1, k)
        fin_r = value_class(rp) == FINITE
        x = np.where(fin_r, rp.astype(np.float64), 0.0)
        sq[row:row + k] += (x * x).sum(axis=-1, keepdims=True)
        cnt[row:row + k] += fin_r.sum(axis=-1, keepdims=True)
    rms = np.sqrt(sq / np.maximum(cnt, 1))
    floor_all = rule.floor_ulps * ulp_of(rms, cdt)

    # pass 2: each piece's criteria and statistics, merged in flat order (first occurrences kept, as argmax)
    acc = dict(n_over=0, n_hard=0, n_tol=0, n_bound=0, n_mism=0, n_floored=0, exact=0, le1=0, valid=0,
               nr2=0.0, nt2=0.0, nd2=0.0, dot=0.0, fin=0)
    hist = np.zeros(_HIST_CAP, np.int64)
    big: list[np.ndarray] = []
    inexact_rows = np.zeros(n_rows, bool)
    best = dict(bound=(-1.0, None), ratio=(-math.inf, None), absd=(-1.0, None), eff=(-1, None), raw=-1,
                first_bad=None)
    for row, c0, c1, k in pieces:
        rp, tp = part(r2, row, c0, c1, k), part(t2, row, c0, c1, k)
        cr, ct = value_class(rp), value_class(tp)
        mism = cr != ct
        fin = (cr == FINITE) & (ct == FINITE)
        valid = ~mism
        rv, tv = rp.astype(np.float64), tp.astype(np.float64)
        raw = np.abs(ordered_int(rp) - ordered_int(tp))
        if not fin.all():
            rv[cr != FINITE] = 0.0
            tv[ct != FINITE] = 0.0
            raw[~fin] = 0
        diff = np.abs(rv - tv)
        diff[~fin] = 0.0
        prms, floor_abs = rms[row:row + k], floor_all[row:row + k]
        within = fin & (diff <= floor_abs)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff > 0, diff / prms, 0.0)
        eff = np.where(within, 0, raw)
        if rule.max_ulps is not None:
            acc["n_over"] += int((valid & (eff > rule.max_ulps)).sum())
        if rule.hard_ulps is not None:
            acc["n_hard"] += int((valid & (eff > rule.hard_ulps)).sum())
        if rule.has_allclose:
            lim = (rule.atol or 0.0) + (rule.rtol or 0.0) * np.abs(rv)
            acc["n_tol"] += int((fin & ~within & (diff > lim)).sum())

        def flat(i: int) -> int:  # a piece-local flat index as the tensor's
            pr, pc = divmod(i, c1 - c0)
            return (row + pr) * last + c0 + pc

        if rule.bound_rms is not None:
            beyond = fin & ~within & (ratio > rule.bound_rms)
            nb = int(beyond.sum())
            if nb:
                acc["n_bound"] += nb
                i = int(np.argmax(np.where(beyond, ratio, -1.0)))
                if ratio.ravel()[i] > best["bound"][0]:
                    best["bound"] = (float(ratio.ravel()[i]), flat(i))
        nm = int(mism.sum())
        if nm and best["first_bad"] is None:
            best["first_bad"] = flat(int(np.flatnonzero(mism.ravel())[0]))
        acc["n_mism"] += nm
        inexact_rows[row:row + k] |= (valid & (raw != 0)).any(axis=-1)
        rf, tf = rv[fin], tv[fin]
        acc["fin"] += rf.size
        acc["nr2"] += float((rf * rf).sum())
        acc["nt2"] += float((tf * tf).sum())
        acc["nd2"] += float(((tf - rf) ** 2).sum())
        acc["dot"] += float((rf * tf).sum())
        e_valid = eff[valid]
        acc["valid"] += e_valid.size
        if e_valid.size:
            small = e_valid < _HIST_CAP
            hist += np.bincount(e_valid[small], minlength=_HIST_CAP)
            if not small.all():
                big.append(e_valid[~small].astype(np.int64))
            best["raw"] = max(best["raw"], int(raw[valid].max()))
        acc["exact"] += int((valid & (raw == 0)).sum())
        acc["le1"] += int((valid & (raw <= 1)).sum())
        acc["n_floored"] += int((within & (diff > 0)).sum())
        if fin.any():
            best["ratio"] = max(best["ratio"], (float(ratio[fin].max()), None), key=lambda x: x[0])
        fd = diff.ravel()
        i = int(np.argmax(fd))
        if fd[i] > best["absd"][0]:
            best["absd"] = (float(fd[i]), flat(i))
        fe = np.where(valid, eff, -1).ravel()
        i = int(np.argmax(fe))
        if fe[i] > best["eff"][0]:
            best["eff"] = (int(fe[i]), flat(i))

    allowed = allowed_over_count(rule.allowed_fraction, n)
    p_exact = exactness.tail(int(inexact_rows.sum()), n_rows, rule.inexact_row_rate) \
        if rule.inexact_row_rate is not None else None
    nr, nt, nd = math.sqrt(acc["nr2"]), math.sqrt(acc["nt2"]), math.sqrt(acc["nd2"])
    rel_l2 = (nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf)) if acc["fin"] else None
    rel_l2_ok = rule.max_rel_l2 is None or rel_l2 is None or rel_l2 <= rule.max_rel_l2
    passed = (acc["n_mism"] == 0 and acc["n_over"] <= allowed and acc["n_hard"] == 0 and acc["n_tol"] == 0
              and acc["n_bound"] == 0 and (p_exact is None or p_exact >= exactness.ALPHA) and rel_l2_ok)
    stats: dict[str, Any] = dict(max_ulp=None, p50_ulp=None, p99_ulp=None, p999_ulp=None, max_ulp_raw=None,
                                 min_passing_max_ulps=None, min_passing_hard_ulps=None)
    m = acc["valid"]
    if m:
        cum = np.cumsum(hist)
        bigs = np.sort(np.concatenate(big)) if big else np.zeros(0, np.int64)

        def kth(k: int) -> int:
            return int(np.searchsorted(cum, k, side="right")) if k < cum[-1] else int(bigs[k - cum[-1]])

        p50, p99, p999 = (kth(percentile_rank(q, m)) for q in ("50", "99", "99.9"))
        kth_allowed = kth(m - 1 - allowed if allowed < m else 0)
        mx = kth(m - 1)
        stats.update(max_ulp=mx, p50_ulp=p50, p99_ulp=p99, p999_ulp=p999, max_ulp_raw=best["raw"],
                     min_passing_max_ulps=kth_allowed if allowed < m else 0, min_passing_hard_ulps=mx)
    if not acc["fin"]:
        cosine = None
    elif nr > 0 and nt > 0:
        cosine = float(np.clip(acc["dot"] / (nr * nt), -1.0, 1.0))
    else:
        cosine = 1.0 if nr == nt else 0.0
    max_abs_i = best["absd"][1] if n else None
    if n and best["eff"][0] > 0:
        worst = best["eff"][1]
    elif n and best["absd"][0] > 0:
        worst = max_abs_i
    else:
        worst = None
    rflat, tflat = r.reshape(-1), t.reshape(-1)

    def val(a: np.ndarray, i: int) -> float:
        return float(np.asarray(a[i]).astype(np.float64))

    def fin_val(a: np.ndarray, i: int) -> float:  # as the reference reads rv / tv: a non-finite value reads 0
        return val(a, i) if value_class(a[i:i + 1])[0] == FINITE else 0.0

    bound_at, first_bad = best["bound"][1], best["first_bad"]
    any_fin = acc["fin"] > 0
    return Verdict(
        passed=passed, name=name, n=n, shape=shape, dtype=cdt,
        frac_exact=acc["exact"] / n if n else None, frac_le1_ulp=acc["le1"] / n if n else None,
        n_floored=acc["n_floored"], floor_abs_max=float(np.max(floor_all)) if n else None,
        n_over=acc["n_over"], frac_over=acc["n_over"] / n if n else 0.0, allowed_over=allowed, n_hard=acc["n_hard"],
        n_tol_fail=acc["n_tol"], n_bound=acc["n_bound"],
        max_diff_rms=best["ratio"][0] if any_fin else None,
        bound_index=_index(bound_at, shape) if bound_at is not None else None,
        bound_ref=fin_val(rflat, bound_at) if bound_at is not None else None,
        bound_test=fin_val(tflat, bound_at) if bound_at is not None else None,
        rel_l2=rel_l2, cosine=cosine,
        max_abs_diff=best["absd"][0] if n and any_fin else None,
        max_abs_index=_index(max_abs_i, shape) if n and any_fin else None,
        worst_index=_index(worst, shape) if worst is not None else None,
        worst_ulp=None if worst is None else best["eff"][0] if worst == best["eff"][1] else 0,
        worst_ref=fin_val(rflat, worst) if worst is not None else None,
        worst_test=fin_val(tflat, worst) if worst is not None else None,
        nan_inf_mismatches=acc["n_mism"],
        first_nan_inf_index=_index(first_bad, shape) if first_bad is not None else None,
        first_nan_inf_ref=val(rflat, first_bad) if first_bad is not None else None,
        first_nan_inf_test=val(tflat, first_bad) if first_bad is not None else None,
        rule=rule.to_dict(), rows=n_rows, inexact_rows=int(inexact_rows.sum()), exactness_p=p_exact, **stats)

