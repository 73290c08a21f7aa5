"""The per-element safety bound (`bound_rms` of a tolerance rule): derivation from the calibration corpus.

The rule (parity.numerics.compare): every finite element outside the absolute floor must have
    |a - b| ≤ bound_rms · RMS(reference row)        (row = last axis, as the floor)
and `allowed_fraction` never relaxes it. The ULP criteria judge *how many* elements may be a few ULPs off; the bound
says how far *any* element may be off at all, so a few elements of finite garbage (3e38, or 0.625 -> 7.0) fail even
where the fraction would let them through.

Why a bound in multiples of the row's RMS, and why no correct implementation exceeds it
---------------------------------------------------------------------------------------
- A *correct* implementation has the reference's precision placement (the same fp32 upcast points and bf16 casts,
  ling3_facts.md §8; DESIGN §7) and differs from it only by rounding: accumulation order, fused kernels, exp / rsqrt
  approximations, and the bf16 rounding flips those cause downstream. Each is an error of relative size ~2^-p in
  some intermediate value, which reaches an output element through the layer's projections and normalisations —
  scaled by the size of the values flowing through that row (its RMS), not by the element's own magnitude, which can
  be ~0 after cancellation. That is why a per-element limit in the element's *own* ULPs (`hard_ulps`) explodes on
  correct implementations and is off in the calibrated table, while |Δ| / RMS(row) stays bounded.
  (A port that computes in another precision — say the whole layer in fp32 against a bf16 reference — is *not*
  correct in this sense: measured on the bundled bf16 dumps it already fails the ULP criteria at ~12 % of the
  points, with |Δ| up to 722 ULPs of the row RMS at attention.state; the bound is not meant to cover it.)
- The corpus measures exactly this quantity: `floor_needed` of `parity.calibration.noise.point_noise` is, per point, the
  largest |Δ| / ulp(RMS(row)) of any element. Pairs of correct implementations it holds, per mode:
    layer (and every mode but free: forced, isolated, ...): the pure-JAX reference vs the PyTorch twin's dump,
        teacher-forced (`layer`, `forced`) and each site fed its dumped inputs (`isolated`);
    free: the same in free mode, and the twin vs transformers' built-in `bailing_hybrid` (an independent
        implementation, both run freely: `twin_vs_native`).
- bound_rms = nice(SAFETY · worst · UNIT[grid]), per site class × mode × tensor dtype × compute dtype, where
  worst = the largest `floor_needed` of the group over the corpus and UNIT[grid] = 2^(1-p) = the largest
  ulp(x) / x of a normal x (bf16 2^-7, fp16 2^-10, fp32 2^-23): worst · UNIT ≥ the measured worst |Δ| / RMS (the
  conversion from ULPs of the RMS back to multiples of the RMS overestimates by < 2×). At least MIN_ULPS · UNIT.
- SAFETY = 2 × T (`safety_from_growth`; 12 for the shipped corpus):
    × 2 for other implementations: the measured worst is one pair's disagreement; a third implementation with
        another accumulation order can sit on the other side of the reference, up to both deviations together;
    × T for the tail beyond the corpus: splitting the JAX-vs-twin pairs by seed into two halves, a group's worst over
        the whole corpus was at most G × the worst of either half, wherever both halves are above the grid's
        resolution (`tail_growth`; the tool prints it) — G = 4.5 (layer, o_norm of fp32 runs) / 4.04 (free) on the
        shipped corpus; T = nice_up(G) (6) covers one more doubling of the corpus at the worst growth seen. The
        free-mode twin-vs-built-in pairs exist for one seed only (no growth estimate).
  The bound is a safety net, not the instrument: real bugs are caught by the ULP criteria long before it.
- The bound is relative (multiples of the RMS), so it does not depend on the comparison grid: it stays valid when
  an fp32 tensor of a bf16 run is compared in fp32 rather than after rounding to bf16 (DESIGN §5, issue 15).
- A reference row whose RMS is 0 has no scale: any difference there is beyond every bound.

Checked against the calibration corpus (`check_points`: every point within its bound, by construction — a test guards
the shipped file against drift) and the no-false-alarm sweep (tests/test_no_false_alarms.py, out-of-sample seeds).
Written as the `safety_bounds` section of parity/numerics/calibration.toml by `python tools/calibrate.py rules`
(parity.calibration.pipeline); `default_rules()` reads it with the calibrated rules (no entry there sets `bound_rms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

SAFETY = 8.0  # the least safety factor: 2 × 4 (safety_from_growth)
MIN_ULPS = 4  # smallest bound, in ULPs of the row RMS on the measured grid (a group whose corpus shows no difference)
UNIT = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}  # max ulp(x)/x of a normal x: 2^(1-p)
# measured mode -> the mode group whose bound it informs (pairs of correct implementations; module docstring)
SOURCES = {"layer": "layer", "forced": "layer", "isolated": "layer", "free": "free", "twin_vs_native": "free"}
SECTION = "safety_bounds"  # its section of the calibration file


def nice_up(x: float) -> float:
    """Round x > 0 up to the sequence 1, 1.5, 2 × 2^k (any integer k); exact in binary, so the TOML round-trips."""
    if x <= 0:
        return 0.0
    k = math.floor(math.log2(x))
    for m in (1.0, 1.5, 2.0):
        v = math.ldexp(m, k)
        if x <= v:
            return v
    return math.ldexp(1.0, k + 2)  # unreachable up to float rounding of log2


@dataclass(frozen=True)
class Bound:
    cls: str
    sites: tuple[str, ...]
    mode: str  # "layer" (entries match every mode but free) or "free"
    dtype: str
    compute: str
    bound_rms: float
    worst_rms: float  # measured worst |Δ| / RMS(row), upper estimate (worst ULPs of the RMS × UNIT)
    worst_at: str
    n_points: int


def _group(p: dict) -> tuple[str, str, str, str] | None:
    mode = SOURCES.get(p["mode"])
    return None if mode is None else (p["class"], mode, p["dtype"], p["compute"])


def _pid(p: dict) -> str:
    lay = "model" if p.get("layer") is None else f"L{p['layer']:02d}"
    step = "" if p["phase"] == "prefill" else f"/S{p['step']:03d}"
    return f"{p['mode']} {p['corpus']}:{p['phase']}{step}/{lay}/{p['site']}"


def worst_rms(p: dict) -> float:
    """A point's largest |Δ| / RMS(row), upper estimate from its `floor_needed` (ULPs of the row RMS on its grid)."""
    return float(p["floor_needed"]) * UNIT[p["grid"]]


def safety_from_growth(growth: dict[tuple, tuple[float, float, float]]) -> float:
    """2 × nice_up(the largest growth full/min(half A, half B) over groups whose halves are both above the grid's
    resolution, MIN_ULPS ULPs of the RMS) — at least SAFETY."""
    g = 1.0
    for (cls, mode, dtype, compute), (a, b, full) in growth.items():
        res = MIN_ULPS * UNIT["bfloat16" if compute == "bfloat16" else "float32"]
        if min(a, b) >= res:
            g = max(g, full / min(a, b))
    return max(SAFETY, 2 * nice_up(g))


def derive_bounds(points: Iterable[dict], safety: float = SAFETY) -> list[Bound]:
    """One bound per (class, mode group, tensor dtype, compute dtype) of the corpus points (module docstring)."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        g = _group(p)
        if g is not None:
            groups.setdefault(g, []).append(p)
    out = []
    for (cls, mode, dtype, compute), ps in sorted(groups.items()):
        w = max(ps, key=worst_rms)
        grid_min = MIN_ULPS * max(UNIT[p["grid"]] for p in ps)
        out.append(Bound(cls, tuple(sorted({p["site"] for p in ps})), mode, dtype, compute,
                         nice_up(max(safety * worst_rms(w), grid_min)), worst_rms(w), _pid(w), len(ps)))
    return out


def tail_growth(points: Iterable[dict]) -> dict[tuple, tuple[float, float, float]]:
    """Per group: (worst of seed half A, worst of seed half B, worst of all) of |Δ| / RMS — how much the worst grows
    when the corpus doubles. Halves: even / odd seed of the point's corpus id ('preset/sN/...'). Only the JAX-vs-twin
    pairs, which the corpus has for every seed (twin_vs_native is run for one seed only)."""
    out: dict[tuple, list[float]] = {}
    for p in points:
        g = _group(p)
        if g is None or p["mode"] == "twin_vs_native":
            continue
        seed = next((int(s[1:]) for s in p["corpus"].split("/") if s[:1] == "s" and s[1:].isdigit()), 0)
        a = out.setdefault(g, [0.0, 0.0])
        a[seed % 2] = max(a[seed % 2], worst_rms(p))
    return {g: (a, b, max(a, b)) for g, (a, b) in out.items()}


def check_points(points: Iterable[dict], rules: Any) -> list[tuple[float, str]]:
    """(measured worst |Δ|/RMS ÷ bound_rms, point id) for every source point, largest first; a ratio above 1 means
    the table's bound would fail a point of the corpus."""
    out = []
    for p in points:
        g = _group(p)
        if g is None:
            continue
        b = rules.value_for("bound_rms", p["site"], "free" if g[1] == "free" else "layer", p["dtype"], p["compute"])
        if b is None:
            out.append((math.inf, _pid(p)))
        else:
            out.append((worst_rms(p) / b, _pid(p)))
    return sorted(out, reverse=True)


def _entry(site: str, mode: str, dtype: str, compute: str, bound: float, note: str, table: str) -> str:
    return (f'[[{table}]]\nsite = "{site}"\nmode = "{mode}"\ndtype = "{dtype}"\ncompute = "{compute}"\n'
            f'bound_rms = {bound!r}\nnote = "{note}"\n')


def render_toml(bounds: list[Bound], header: str) -> str:
    """The bounds as a stand-alone tolerance file ([[rule]] entries after `header`)."""
    return "\n".join([header.rstrip("\n"), "", 'schema = "ling3-parity-tolerances"', "version = 1", "",
                      bounds_entries(bounds)])


def bounds_entries(bounds: list[Bound], table: str = "rule", catch_alls: bool = True) -> str:
    """The bounds as `[[table]]` entries that set only `bound_rms`: per site (free entries, then every other mode),
    then per-tier catch-alls (the loosest class of the tier), then one last catch-all per mode for what the corpus
    never measured (fp16, callers without a compute dtype)."""
    lines = []
    order = sorted(bounds, key=lambda b: (b.mode != "free", b.cls, b.dtype, b.compute))
    for b in order:
        lines.append(f"# {b.cls} · {b.mode} · {b.dtype} tensors · compute {b.compute}: worst |Δ| ≤ "
                     f"{b.worst_rms:.3g}×row RMS over {b.n_points} points, at {b.worst_at}")
        for s in b.sites:
            lines.append(_entry(s, "free" if b.mode == "free" else "*", b.dtype, b.compute, b.bound_rms,
                                f"safety bound: {b.cls}, {b.mode}", table))
    if not catch_alls:
        return "\n".join(lines) + "\n"
    tiers: dict[tuple, Bound] = {}
    for b in bounds:
        k = (b.mode, b.dtype, b.compute)
        if k not in tiers or b.bound_rms > tiers[k].bound_rms:
            tiers[k] = b
    for (mode, dtype, compute), b in sorted(tiers.items(), key=lambda kv: (kv[0][0] != "free", kv[0])):
        lines.append(f"# catch-all · {mode} · {dtype} · compute {compute}: the loosest class of the tier ({b.cls})")
        lines.append(_entry("*", "free" if mode == "free" else "*", dtype, compute, b.bound_rms,
                            f"safety bound: catch-all, {mode}", table))
    for mode in ("free", "layer"):
        loosest = max((b.bound_rms for b in bounds if b.mode == mode), default=None)
        if loosest is not None:
            lines.append(f"# not measured (fp16, no compute dtype given): the loosest {mode} bound of the corpus")
            lines.append(f'[[{table}]]\nmode = "{"free" if mode == "free" else "*"}"\nbound_rms = {loosest!r}\n'
                         f'note = "safety bound: unmeasured catch-all, {mode}"\n')
    return "\n".join(lines) + "\n"


__all__ = ["Bound", "MIN_ULPS", "SAFETY", "SECTION", "SOURCES", "UNIT", "bounds_entries", "check_points",
           "derive_bounds", "nice_up", "render_toml", "safety_from_growth", "tail_growth", "worst_rms"]
