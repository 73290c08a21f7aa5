"""Calibrate the default tolerance table from measured reference self-noise (DESIGN §5).

DESIGN §5: defaults are *measured* from the noise between independently validated correct implementations, never
tuned until a test goes green. This module:
  1. builds a corpus (presets × seeds × prompt lengths × bf16/fp32; random checkpoints + twin dumps in a temp dir),
  2. measures, per point, the noise of the JAX reference against the twin's dumps (`layer` and `free` replays), of
     the twin against transformers' built-in `bailing_hybrid` (dumps compared directly), and of the twin's bf16 run
     against its fp32 run (scale of bf16 rounding itself),
  3. aggregates per site class × mode × (tensor dtype, compute dtype) and proposes rules = observed worst case ×
     a stated safety factor, rounded up, with documented minimums (`propose_rules`), written as TOML.

Per-point statistic (`point_noise`): the comparison runs on the same grid as `parity.numerics.compare`: the precision
the tensor was computed in (`comparison_grid`: bf16 tensors in bf16, every fp32 tensor — also the fp32 tensors of a
bf16 run — in fp32). Modes measured: `layer`, `free` and `isolated` (each site fed its own dumped inputs).
For every element, `need` = |Δ| / ulp(RMS of its reference row) is the smallest `floor_ulps` that lets it pass by
the absolute floor. For each candidate floor F in `FLOORS`, the *effective* ULP distance is the raw ULP distance of
elements with need > F and 0 for the others (exactly what compare() judges), and we record its max, p99, p99.9.
For the fp32 tier we also record `rtol_floor_needed`: the smallest floor with which every element passes
|Δ| ≤ floor·ulp(row RMS) or |Δ| ≤ rtol·|ref| (the fp32 tier's per-element check at rtol = 1e-5).

Proposal (`propose_rules`, documented in the TOML header):
  bf16 grid, layer/forced : floor F = S · worst p99.9 of |Δ|/ulp(row RMS), rounded up to a candidate floor, at least
                            BF16_FLOOR (1) ULP of the row RMS;
                            max_ulps = nice(S · worst p99.9 effective ULP), allowed_fraction = 0.001, hard_ulps off
                            (a corpus maximum is a tail statistic that grows with the corpus — see propose_rule);
                            every corpus point then passes by construction (a point with p99.9 ≤ M has
                            ≤ floor(0.001·n) elements above M).
  bf16 grid, free         : same floor; statistical: max_ulps = nice(S · worst p99), allowed_fraction = 0.01,
                            hard_ulps off (drift through layers is not bounded per element).
  isolated (every run)    : the fine instrument — same floor method (p99.9); max_ulps = the smallest of 1, 2, 4, ...
                            ≥ S · worst p99.9 effective ULP; allowed_fraction as layer;
                            hard_ulps = nice(S · worst max) where that is ≤ HARD_OFF_ABOVE (a per-element limit
                            where the noise allows one).
  fp32 tier (not isolated): rtol 1e-5 elementwise (DESIGN §5), except elements within floor F fp32-ULPs of their row
                            RMS, F = nice(S · worst rtol_floor_needed) — the floor absorbs cancellation near zero.
S = `SAFETY` (2), nice() rounds up to 1, 1.5, 2, 3, 4, 6, 8, 12, ... ; minimums in `MINIMUMS`.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from parity.numerics.compare import comparison_grid, percentile_rank
from parity.numerics.ulp import FINITE, ordered_int, to_dtype, ulp_of, value_class
from parity.points import site_class

FLOORS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fp32 grid: a bf16-compute run's fp32 tensors carry bf16-sized noise = up to 2^16 fp32 ULPs per bf16 ULP
FLOORS_FP32 = FLOORS + tuple(2**k for k in range(15, 25))
KS = (1, 2, 4, 8, 16, 32, 64)
RTOL_FP32 = 1e-5  # DESIGN §5: the fp32 tier is ~1e-5 relative
SAFETY = 2.0
BF16_FLOOR = 1
MINIMUMS = {"max_ulps": 2, "hard_ulps": 4, "fp32_floor_ulps": 16, "isolated_max_ulps": 1}
LAYER_FRACTION = 0.001
FREE_FRACTION = 0.01

def nice(x: float) -> float:
    """Round up to the sequence 1, 1.5, 2, 3, 4, 6, 8, 12, 16, ... (≤ 1.5× above x); 0 stays 0."""
    if x <= 0:
        return 0
    if x <= 1:
        return 1
    k = 2 ** math.floor(math.log2(x))
    for m in (1, 1.5, 2):
        if x <= m * k:
            v = m * k
            return int(v) if float(v).is_integer() else v
    raise AssertionError("unreachable")


def _ranks(m: int) -> tuple[int, int]:
    """0-based ranks of p99 and p99.9 among m sorted values ('inverted_cdf', as parity.numerics.compare)."""
    return percentile_rank("99", m), percentile_rank("99.9", m)


def _quantiles(e: np.ndarray) -> tuple[int, int, int]:
    """(max, p99, p99.9) of a flat int array (attained values)."""
    m = e.size
    if m == 0:
        return 0, 0, 0
    r99, r999 = _ranks(m)
    part = np.partition(e, (r99, r999, m - 1))
    return int(part[m - 1]), int(part[r99]), int(part[r999])


def _fquantiles(x: np.ndarray) -> tuple[float, float, float]:
    """(max, p99, p99.9) of a flat float array (attained values)."""
    m = x.size
    if m == 0:
        return 0.0, 0.0, 0.0
    r99, r999 = _ranks(m)
    part = np.partition(x, (r99, r999, m - 1))
    return float(part[m - 1]), float(part[r99]), float(part[r999])


# ------------------------------------------------------------------------------------------------ one point
def floors_of(grid: str) -> tuple[int, ...]:
    """Candidate floors (ULPs of the row RMS) measured on `grid`."""
    return FLOORS_FP32 if grid == "float32" else FLOORS


def point_noise(ref: Any, test: Any, grid: str) -> dict:
    """Noise statistics of one point compared on `grid` ('bfloat16' or 'float32'); see the module docstring."""
    r, t = to_dtype(np.asarray(ref), grid), to_dtype(np.asarray(test), grid)
    if r.shape != t.shape:
        raise ValueError(f"point_noise: reference shape {r.shape} != test shape {t.shape}")
    last = r.shape[-1] if r.ndim else 1
    r, t = r.reshape(-1, last), t.reshape(-1, last)
    cr, ct = value_class(r), value_class(t)
    fin = (cr == FINITE) & (ct == FINITE)
    n_nonfinite_mismatch = int((cr != ct).sum())
    rv, tv = np.where(fin, r.astype(np.float64), 0.0), np.where(fin, t.astype(np.float64), 0.0)
    raw = np.where(fin, np.abs(ordered_int(r) - ordered_int(t)), 0)
    diff = np.abs(rv - tv)
    rms = np.sqrt((rv * rv).sum(-1, keepdims=True) / np.maximum(fin.sum(-1, keepdims=True), 1))
    need = diff / ulp_of(rms, grid)  # floor (in ULPs of the row RMS) this element needs to pass by the floor
    raw_f, need_f = raw.ravel(), need.ravel()
    by_floor = {}
    for F in floors_of(grid):
        eff = np.where(need_f > F, raw_f, 0)
        mx, p99, p999 = _quantiles(eff)
        by_floor[str(F)] = {"max": mx, "p99": p99, "p999": p999,
                            "frac_over": {str(k): float((eff > k).mean()) if eff.size else 0.0 for k in KS}}
    outside = diff > RTOL_FP32 * np.abs(rv)
    need_rtol = np.where(outside, need, 0.0).ravel()
    need_q = _fquantiles(need_f)
    need_rtol_q = _fquantiles(need_rtol)
    mx, p99, p999 = _quantiles(raw_f)
    nref = float(np.sqrt((rv * rv).sum()))
    return {
        "n": int(r.size), "grid": grid, "max_ulp_raw": mx, "p99_ulp_raw": p99, "p999_ulp_raw": p999,
        "frac_exact": float((raw_f == 0).mean()) if raw_f.size else 1.0,
        "floor_needed": need_q[0], "floor_needed_p99": need_q[1], "floor_needed_p999": need_q[2],
        "rtol_floor_needed": need_rtol_q[0], "rtol_floor_needed_p999": need_rtol_q[2],
        "rel_l2": float(np.sqrt((diff * diff).sum()) / nref) if nref > 0 else (0.0 if not diff.any() else math.inf),
        "max_abs_diff": float(diff.max()) if diff.size else 0.0,
        "nonfinite_mismatches": n_nonfinite_mismatch,
        "by_floor": by_floor,
    }


# ------------------------------------------------------------------------------------------------ corpus
@dataclass(frozen=True)
class CorpusSpec:
    presets: tuple[str, ...] = ("tiny", "tiny-flash")
    seeds: tuple[int, ...] = (1, 2)
    prompt_lens: tuple[int, ...] = (40, 160)  # ≤ 64: recurrent KDA path of the official kernel; > 64: chunked
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    decode_steps: int = 2
    modes: tuple[str, ...] = ("layer", "free", "isolated")
    native_seeds: tuple[int, ...] = (1,)  # twin vs built-in on an unclamped copy of tiny-flash


@dataclass
class Measurement:
    """Flat per-point measurements plus routing counts; JSON-able via `to_dict`."""

    points: list[dict] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)


def measure_replay(dump_path: Path, ckpt_dir: Path, mode: str, corpus_id: str, out: Measurement,
                   target: Any = None) -> dict:
    """Replay one dump (reference target unless given), record per-point noise and routing outcomes into `out`, and
    return the report. The noise is measured on exactly the arrays the judge compared (`PointRecord.observation`:
    for a benign routing flip, the run forced to the reference's experts)."""
    from parity.numerics.tolerances import default_rules
    from parity.replay import Session, replay_records

    from parity.report import build_report, order_key

    records = []
    with Session.open(dump_path, ckpt_dir, target=target, mode=mode, rules=default_rules()) as ses:
        compute = ses.dtype
        judged = sorted(((r.to_json(), r) for r in replay_records(ses)), key=lambda jr: order_key(ses.config, jr[0]))
        for js, rec in judged:  # in report order, so ties in the aggregation resolve as before
            records.append(js)
            p = rec.point
            base = {"corpus": corpus_id, "mode": mode, "phase": p.phase, "step": p.step, "layer": p.layer,
                    "site": p.site, "compute": compute}
            if p.site == "mlp.gate.topk_idx":
                out.routing.append({**base, "status": rec.status.value, "tokens": rec.stats.get("tokens"),
                                    "flipped": rec.stats.get("flipped", 0),
                                    "benign_flips": rec.stats.get("benign_flips", 0)})
                continue
            obs = rec.observation
            if rec.status.value not in ("pass", "fail") or obs is None or obs.ref is None or obs.test is None:
                continue
            tdtype = ses.dump.dtype(p)
            if tdtype not in ("bfloat16", "float32", "float16") or np.shape(obs.test) != obs.ref.shape:
                continue
            # measured in the precision the tensor was computed in (comparison_grid, DESIGN §5)
            out.points.append({**base, "class": site_class(p.site), "dtype": tdtype,
                               "forced_routing": rec.forced_routing, "status_old_rules": rec.status.value,
                               "replay_max_ulp_raw": rec.stats.get("max_ulp_raw"),
                               **point_noise(obs.ref, obs.test, comparison_grid(tdtype))})
        return build_report(ses.config, records, dump=str(dump_path), target=getattr(ses.target, "name", "?"),
                            mode=mode)


def measure_dump_pair(ref_path: Path, test_path: Path, kind: str, corpus_id: str, out: Measurement,
                      grid: str | None = None) -> None:
    """Compare two dumps of the same checkpoint and ids directly, point by point (both are free runs)."""
    from parity.dumpfile import DumpReader

    a, b = DumpReader(ref_path), DumpReader(test_path)
    try:
        compute = a.meta.get("compute_dtype", "bfloat16")
        for pt in a.points():
            if not b.has(pt):
                continue
            base = {"corpus": corpus_id, "mode": kind, "phase": pt.phase, "step": pt.step, "layer": pt.layer,
                    "site": pt.site, "compute": compute}
            ra, rb = a.read(pt), b.read(pt)
            if pt.site == "mlp.gate.topk_idx":
                same = (np.sort(ra, -1) == np.sort(rb.reshape(ra.shape), -1)).all(-1)
                out.routing.append({**base, "status": "pass" if same.all() else "flipped", "tokens": int(same.size),
                                    "flipped": int((~same).sum()), "benign_flips": None})
                continue
            tdtype = a.attrs(pt).get("dtype", str(ra.dtype))
            if tdtype not in ("bfloat16", "float32", "float16") or ra.size != rb.size or "cache" in pt.site:
                continue
            out.points.append({**base, "class": site_class(pt.site), "dtype": tdtype,
                               **point_noise(ra, rb.reshape(ra.shape), grid or comparison_grid(tdtype))})
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------------------------ aggregation
def _mode_group(mode: str) -> str:
    return {"layer": "layer", "forced": "layer"}.get(mode, mode)


def group_key(p: dict) -> tuple[str, str, str, str]:
    """(class, mode group, tensor dtype, compute dtype)."""
    return p["class"], _mode_group(p["mode"]), p["dtype"], p["compute"]


def _pid(p: dict) -> str:
    lay = "model" if p.get("layer") is None else f"L{p['layer']:02d}"
    step = "" if p["phase"] == "prefill" else f"/S{p['step']:03d}"
    return f"{p['corpus']}:{p['phase']}{step}/{lay}/{p['site']}"


def _worst(points: list[dict], value) -> tuple[float, str]:
    best = max(points, key=value)
    return value(best), _pid(best)


def _p99_over(vals: list[float]) -> float:
    v = sorted(vals)
    return v[percentile_rank("99", len(v))] if v else 0.0


def floor_for(need: float, grid: str = "bfloat16") -> int:
    """Smallest candidate floor of `grid` (`floors_of`) that is ≥ need (the largest one if none is)."""
    floors = floors_of(grid)
    return next((F for F in floors if F >= need), floors[-1])


def aggregate(points: Iterable[dict], floors: dict[tuple, int] | None = None) -> dict[tuple, dict]:
    """Per group (`group_key`): n points, and for each statistic the worst value, which point it was, and its p99
    over points. Effective-ULP statistics are taken at the group's floor (`floors`, default BF16_FLOOR)."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault(group_key(p), []).append(p)
    out = {}
    for key, ps in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        F = str((floors or {}).get(key, BF16_FLOOR))
        s: dict[str, Any] = {"n_points": len(ps), "n_elements": int(sum(p["n"] for p in ps)),
                             "sites": sorted({p["site"] for p in ps}), "floor": float(F)}
        stats = {
            "eff_max": lambda p: p["by_floor"][F]["max"],
            "eff_p999": lambda p: p["by_floor"][F]["p999"],
            "eff_p99": lambda p: p["by_floor"][F]["p99"],
            "eff_frac_over_2": lambda p: p["by_floor"][F]["frac_over"]["2"],
            "raw_max": lambda p: p["max_ulp_raw"],
            "floor_needed": lambda p: p["floor_needed"],
            "floor_needed_p999": lambda p: p["floor_needed_p999"],
            "floor_needed_p99": lambda p: p["floor_needed_p99"],
            "rtol_floor_needed": lambda p: p["rtol_floor_needed"],
            "rel_l2": lambda p: p["rel_l2"] if math.isfinite(p["rel_l2"]) else 1e300,
            "nonfinite_mismatches": lambda p: p["nonfinite_mismatches"],
        }
        for name, fn in stats.items():
            w, where = _worst(ps, fn)
            s[name] = {"worst": w, "worst_at": where, "p99_over_points": _p99_over([fn(p) for p in ps])}
        out[key] = s
    return out


@dataclass(frozen=True)
class ProposedRule:
    sites: tuple[str, ...]
    cls: str
    mode: str  # "layer" (also used for forced and any non-free mode) or "free"
    dtype: str
    compute: str
    fields: dict
    basis: str  # the measured numbers the fields came from


HARD_OFF_ABOVE = 16384  # a hard limit this high only flags sign flips of near-zero elements: leave it off
HARD_PER_ELEMENT_OFF = True  # see propose_rule


def propose_rule(points: Sequence[dict], safety: float = SAFETY) -> tuple[ProposedRule, int]:
    """Rule for one group of point measurements (same `group_key`) — see the module docstring. Returns the rule and
    the floor its effective-ULP statistics were taken at."""
    cls, mode, dtype, compute = group_key(points[0])
    grid = points[0].get("grid", "float32" if compute == "float32" else "bfloat16")
    sites = tuple(sorted({p["site"] for p in points}))

    def worst(k, F=None):
        val = (lambda p: p["by_floor"][str(F)][k]) if F is not None else (lambda p: p[k])
        return _worst(list(points), val)

    if compute == "float32" and mode != "isolated":
        # fp32 tier: rtol 1e-5 elementwise + floor; every element must pass (compare has no allowed fraction for
        # rtol), so the floor covers the worst element needing it.
        need, at = worst("rtol_floor_needed")
        F = max(MINIMUMS["fp32_floor_ulps"], nice(safety * need))
        fields = {"floor_ulps": F, "max_ulps": "off", "allowed_fraction": 0.0, "hard_ulps": "off",
                  "rtol": RTOL_FP32, "atol": "off", "compare_dtype": "off"}
        rl, rl_at = worst("rel_l2")
        basis = f"floor needed with rtol {RTOL_FP32:g}: worst {need:.4g} fp32-ULP of row RMS at {at}; worst rel-L2 {rl:.3g}"
        return ProposedRule(sites, cls, mode, dtype, compute, fields, basis), floor_for(F, grid)
    # ULP rule on the grid the tensor was computed in (fp32 tensors of a bf16 run: fp32 ULPs; issue 15)
    q, frac_default = ("floor_needed_p99", FREE_FRACTION) if mode == "free" else ("floor_needed_p999", LAYER_FRACTION)
    need, need_at = worst(q)
    F = max(BF16_FLOOR, floor_for(safety * need, grid))
    if mode == "isolated":
        # the fine instrument: the smallest max_ulps the noise allows (each sub-module fed its own dumped inputs)
        p999, _ = worst("p999", F)
        M = next((k for k in KS if k >= max(MINIMUMS["isolated_max_ulps"], safety * p999)), KS[-1])
    else:
        M = MINIMUMS["max_ulps"]
    over, over_at = _worst(list(points), lambda p: p["by_floor"][str(F)]["frac_over"][str(M)])
    allowed = max(frac_default, float(nice(1000 * safety * over)) / 1000)
    mx, mx_at = worst("max", F)
    # No per-element hard limit in the propagating modes (layer/forced/free): the worst single element of a corpus
    # is a tail statistic that keeps growing with the corpus. Measured: the 735 layer-mode o_norm points of the
    # 4-seed corpus peak at 8 row-RMS ULPs raw, the out-of-sample bundled tiny-flash bf16 dump (seed 0) reaches 13
    # on one KDA head row 13x below the tensor's RMS (a near-zero recurrence output, normalised by o_norm). Systematic
    # errors are caught by the floor + allowed-fraction rule; per-element limits belong to the isolated mode, where
    # they are set wherever the measured maximum leaves them below HARD_OFF_ABOVE.
    H = int(max(MINIMUMS["hard_ulps"], M, nice(safety * mx)))
    hard = "off" if (HARD_PER_ELEMENT_OFF and mode != "isolated") or H > HARD_OFF_ABOVE else H
    fields = {"floor_ulps": F, "max_ulps": M, "allowed_fraction": min(allowed, 1.0), "hard_ulps": hard,
              "rtol": "off", "atol": "off", "compare_dtype": "off"}
    basis = (f"{grid} grid; worst {q.replace('floor_needed_', '')} of |Δ|/ulp(row RMS): {need:.4g} at {need_at}; at "
             f"floor {F}: worst fraction above {M} ULP {over:.3g} at {over_at}, worst max {mx} ULP at {mx_at}")
    return ProposedRule(sites, cls, mode, dtype, compute, fields, basis), F


ROUTER_DOWNSTREAM = ("mlp.gate.topk_weight", "mlp.routed", "mlp", "output")


def flag_after_flips(points: list[dict], routing: list[dict]) -> int:
    """Mark points downstream of a NON-benign top-k flip of the same replay step (the routing check already fails
    there; their noise is a routing difference, not numerics) with `after_nonbenign_flip`. Returns how many."""
    bad = {(r["corpus"], r["mode"], r["phase"], r["step"], r["layer"]) for r in routing if r.get("status") == "fail"}
    n = 0
    for p in points:
        hit = p["site"] in ROUTER_DOWNSTREAM and (p["corpus"], p["mode"], p["phase"], p["step"], p["layer"]) in bad
        p["after_nonbenign_flip"] = hit
        n += hit
    return n


def propose_rules(points: Iterable[dict], safety: float = SAFETY) -> tuple[list[ProposedRule], dict[tuple, int]]:
    """One rule per measured (class, mode ∈ {layer, free}, dtype, compute) group, plus per-tier catch-alls = the
    loosest value of any class of that tier (for sites the corpus does not cover). Also returns each group's floor."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        if not p.get("after_nonbenign_flip"):
            groups.setdefault(group_key(p), []).append(p)
    rules, floors = [], {}
    for key, ps in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        if key[1] not in ("layer", "free", "isolated"):
            continue  # cross-checks (twin vs native, fp32 vs bf16) inform, they do not define rules
        r, floors[key] = propose_rule(ps, safety)
        rules.append(r)
    tiers: dict[tuple, list[ProposedRule]] = {}
    for r in rules:
        tiers.setdefault((r.mode, r.dtype, r.compute), []).append(r)
    for (mode, dtype, compute), rs in sorted(tiers.items()):
        loose = {}
        for f in rs[0].fields:
            vals = [r.fields[f] for r in rs]
            if "off" in vals and f in ("max_ulps", "hard_ulps"):
                loose[f] = "off"
            elif all(isinstance(v, (int, float)) for v in vals):
                loose[f] = max(vals)
            else:
                loose[f] = vals[0]
        rules.append(ProposedRule(("*",), "catch-all", mode, dtype, compute, loose,
                                  "loosest measured class of this tier"))
    return rules, floors


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e6 and v != 0:
        return str(int(v))
    return repr(v) if not isinstance(v, bool) else str(v).lower()


def rules_toml(rules: Sequence[ProposedRule], header: str) -> str:
    """The table as TOML in the format of parity.numerics.tolerances: free entries first (specific mode), then the
    layer-mode entries with mode "*" (layer, forced and any other mode), per-site before catch-alls."""
    lines = [header.rstrip(), "", 'schema = "ling3-parity-tolerances"', "version = 1", ""]
    order = sorted(rules, key=lambda r: (r.cls == "catch-all", r.mode not in ("free", "isolated"), r.mode, r.compute,
                                         r.dtype, r.cls))
    for r in order:
        lines.append(f"# {r.cls} · {r.mode} · {r.dtype} tensors · compute {r.compute}: {r.basis}")
        for site in r.sites:
            lines.append("[[rule]]")
            lines.append(f'site = "{site}"')
            lines.append(f'mode = "{r.mode if r.mode in ("free", "isolated") else "*"}"')
            lines.append(f'dtype = "{r.dtype}"')
            lines.append(f'compute = "{r.compute}"')
            for k, v in r.fields.items():
                lines.append(f"{k} = {_toml_value(v)}")
            lines.append(f'note = "calibrated: {r.cls}, {r.mode}"')
        lines.append("")
    # Last resort for dtypes / compute dtypes the corpus never produced (fp16, integer tensors — these compare
    # exactly and ignore the numbers; runs that pass no compute dtype).
    lines += ["# Not measured (no fp16 runs; integer tensors compare exactly; callers without a compute dtype):",
              "# the provisional bf16 default, kept as the last resort.",
              "[[rule]]", 'site = "*"', 'mode = "*"', 'dtype = "*"', "floor_ulps = 1", "max_ulps = 2",
              "allowed_fraction = 0.001", "hard_ulps = 64", 'note = "uncalibrated catch-all"', ""]
    return "\n".join(lines)


def machine() -> str:
    import os

    return f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{platform.system()} {platform.release()}, Python {platform.python_version()}"


# ------------------------------------------------------------------------------------------------ the whole run
def _unclamped_flash() -> dict:
    """tiny-flash with both SwiGLU limit lists null: the built-in bailing_hybrid has no clamp (task brief, ORC §5)."""
    from parity.torch_ref.ckpt import resolve_config

    d = dict(resolve_config("tiny-flash"))
    d["expert_swiglu_limit_list"] = None
    d["share_expert_swiglu_limit_list"] = None
    return d


def run_calibration(spec: CorpusSpec, workdir: Path, log=print) -> Measurement:
    """Build the corpus in `workdir` and measure everything (steps 1-2 and 5 of the calibration brief)."""
    import time

    from parity.torch_ref.ckpt import make_checkpoint
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    out = Measurement()
    workdir = Path(workdir)

    def dump(ckpt, path, T, dtype, seed, runtime="remote"):
        t0 = time.perf_counter()
        ids = builtin_ids(512, T, seed=seed)
        dump_checkpoint(ckpt, path, ids, DumpOptions(runtime=runtime, dtype=dtype, decode_steps=spec.decode_steps,
                                                     progress=False, force=True, causality_check=False))
        out.runs.append({"what": f"dump {runtime} {path.name}", "seconds": round(time.perf_counter() - t0, 1)})
        log(f"dumped {path.name} ({runtime}) in {time.perf_counter() - t0:.1f}s")

    def replay(path, ckpt, cid):
        for mode in spec.modes:
            t0 = time.perf_counter()
            rep = measure_replay(path, ckpt, mode, cid, out)
            out.runs.append({"what": f"replay {mode} {cid}", "seconds": round(time.perf_counter() - t0, 1),
                             "counts_old_rules": rep["counts"]})
            log(f"replayed {cid} {mode} in {time.perf_counter() - t0:.1f}s: {rep['counts']} (old rules)")

    jobs = [(p, s, p) for p in spec.presets for s in spec.seeds]
    jobs += [("tiny-flash-noclamp", s, _unclamped_flash()) for s in spec.native_seeds]
    for name, seed, preset in jobs:
        ckpt = make_checkpoint(workdir / f"{name}-s{seed}", preset, seed=seed, force=True)
        for T in spec.prompt_lens:
            paths = {}
            for dtype in spec.dtypes:
                tag = "fp32" if dtype == "float32" else "bf16"
                cid = f"{name}/s{seed}/T{T}/{tag}"
                paths[dtype] = workdir / f"{name}-s{seed}-T{T}-{tag}.h5"
                dump(ckpt, paths[dtype], T, dtype, seed)
                replay(paths[dtype], ckpt, cid)
                if name == "tiny-flash-noclamp":
                    npath = workdir / f"{name}-s{seed}-T{T}-{tag}-native.h5"
                    dump(ckpt, npath, T, dtype, seed, runtime="native")
                    measure_dump_pair(paths[dtype], npath, "twin_vs_native", cid, out)
            if "float32" in paths and "bfloat16" in paths:
                measure_dump_pair(paths["float32"], paths["bfloat16"], "twin_fp32_vs_bf16",
                                  f"{name}/s{seed}/T{T}", out, grid="bfloat16")
    return out


def remeasure(meas: Measurement, workdir: Path, modes: Sequence[str], log=print) -> Measurement:
    """Replay the corpus dumps kept in `workdir` (by `run_calibration`) again in `modes` and replace those modes'
    points and routing records in `meas` — e.g. after a change to how a mode feeds a site, without rebuilding the
    corpus. Dumps are found by `run_calibration`'s names: `<preset>-s<seed>-T<T>-<bf16|fp32>.h5`, checkpoint
    `<preset>-s<seed>/`."""
    import re
    import time

    workdir = Path(workdir)
    keep = [p for p in meas.points if p["mode"] not in modes]
    keep_r = [r for r in meas.routing if r["mode"] not in modes]
    out = Measurement(points=keep, routing=keep_r, runs=list(meas.runs))
    pat = re.compile(r"^(?P<name>.+)-s(?P<seed>\d+)-T(?P<T>\d+)-(?P<tag>bf16|fp32)\.h5$")
    dumps = sorted(p for p in workdir.glob("*.h5") if pat.match(p.name))
    if not dumps:
        raise ValueError(f"{workdir}: no corpus dumps (<preset>-s<seed>-T<T>-<bf16|fp32>.h5) to re-measure")
    for path in dumps:
        m = pat.match(path.name)
        cid = f"{m['name']}/s{m['seed']}/T{m['T']}/{m['tag']}"
        ckpt = workdir / f"{m['name']}-s{m['seed']}"
        for mode in modes:
            t0 = time.perf_counter()
            rep = measure_replay(path, ckpt, mode, cid, out)
            out.runs.append({"what": f"re-measure {mode} {cid}", "seconds": round(time.perf_counter() - t0, 1),
                             "counts_old_rules": rep["counts"]})
            log(f"re-measured {cid} {mode} in {time.perf_counter() - t0:.1f}s: {rep['counts']} (old rules)")
    return out


def routing_summary(routing: list[dict]) -> dict:
    """Top-k flips per (mode, compute dtype): tokens compared, flipped, benign (replay's classification)."""
    s: dict[str, dict] = {}
    for r in routing:
        k = f"{r['mode']}/{r['compute']}"
        d = s.setdefault(k, {"router_points": 0, "tokens": 0, "flipped": 0, "benign": 0, "failing_points": 0,
                             "failing_at": []})
        d["router_points"] += 1
        d["tokens"] += r.get("tokens") or 0
        d["flipped"] += r.get("flipped") or 0
        d["benign"] += r.get("benign_flips") or 0
        if r.get("status") in ("fail", "flipped"):
            d["failing_points"] += 1
            d["failing_at"].append(_pid(r))
    return s


# ------------------------------------------------------------------------------------------------ outputs
def toml_header(command: str, date: str, mach: str, spec: CorpusSpec, safety: float) -> str:
    return "\n".join("# " + s if s else "#" for s in [
        "Default tolerance rules of ling3-parity (DESIGN §5). Format and lookup: parity/numerics/tolerances.py.",
        "",
        f"Calibrated by `{command}` on {date}, {mach}.",
        "Generated by parity/calibrate.py; measurements in parity/numerics/calibration/ (measurements.json,",
        "calibration.md). Do not edit numbers by hand; never raise one to make a failing test pass — re-run the tool.",
        "",
        f"Corpus: presets {', '.join(spec.presets)} (+ tiny-flash without SwiGLU clamp) × seeds "
        f"{', '.join(map(str, spec.seeds))} × prompts {', '.join(map(str, spec.prompt_lens))} tokens",
        f"(≤ 64: recurrent KDA path, > 64: chunked) × {', '.join(spec.dtypes)} × prefill + {spec.decode_steps} decode "
        "steps. Noise measured: the",
        f"pure-JAX reference against the PyTorch twin's dumps, replayed in {', '.join(f'`{m}`' for m in spec.modes)} mode;",
        "both agree with transformers' built-in bailing_hybrid to ≤ 1e-5 in fp32 (tests/test_jax_model.py,",
        "tests/test_twin_vs_builtin.py).",
        "",
        f"Rule = observed worst case over the corpus × safety factor {safety:g}, rounded up to 1, 1.5, 2, 3, 4, 6, 8, ...:",
        "Every tensor is measured and compared in the precision it was computed in (DESIGN §5): bf16 tensors in bf16",
        "ULPs, the fp32 tensors of a bf16 run (KDA gate/beta/state, router logits, top-k weights) in fp32 ULPs.",
        f"- bf16 runs (ULP rule on the tensor's grid): floor_ulps = {BF16_FLOOR} ULP of",
        "  the row RMS at least, else S·worst p99.9 (layer, isolated) / p99 (free) of |Δ|/ulp(row RMS). layer/forced:",
        f"  max_ulps = {MINIMUMS['max_ulps']}, allowed_fraction = max({LAYER_FRACTION}, S·worst fraction above it), hard_ulps off (the worst single element of a",
        f"  finite corpus is a tail statistic that grows with the corpus; per-element limits: isolated mode).",
        f"  free: max_ulps = {MINIMUMS['max_ulps']}, allowed_fraction = {FREE_FRACTION} at least, hard_ulps off (drift).",
        f"  isolated (the fine instrument, every run dtype): max_ulps = the smallest of 1, 2, 4, ... ≥ S·worst p99.9 effective",
        f"  ULP (at least {MINIMUMS['isolated_max_ulps']}), allowed_fraction = max({LAYER_FRACTION}, S·worst fraction above it),",
        f"  hard_ulps = S·worst max effective ULP where that is ≤ {HARD_OFF_ABOVE} (per-element limit), else off.",
        f"  Minimums: max_ulps ≥ {MINIMUMS['max_ulps']}, hard_ulps ≥ {MINIMUMS['hard_ulps']}.",
        f"- fp32 tier (fp32 runs, every mode but isolated): per element |Δ| ≤ rtol·|ref| with rtol = {RTOL_FP32:g} (DESIGN §5), except",
        "  elements within floor_ulps fp32-ULPs of their row RMS: after cancellation a near-zero element carries the",
        "  absolute error of its row's scale, not of its own magnitude. floor_ulps = S·(worst floor needed),",
        f"  minimum {MINIMUMS['fp32_floor_ulps']}.",
        "Entries are per site, most specific first (free and isolated entries, then all other modes, then per-tier",
        "catch-alls =",
        "the loosest measured class of the tier). Lookup is FIRST MATCH WINS, PER FIELD.",
    ])


def markdown(aggs: dict, routing: dict, runs: list[dict], command: str, date: str, mach: str,
             rules: list[ProposedRule]) -> str:
    L = [f"# Tolerance calibration", "", f"Command: `{command}`", f"Date: {date}", f"Machine: {mach}", "",
         "Method: parity/calibrate.py module docstring and the header of default_tolerances.toml.",
         "Effective ULP = ULP distance of elements outside the group floor (column `floor`, bf16 ULPs of row RMS); fp32 groups: `floor need` =",
         "smallest floor (fp32 ULPs of row RMS) with which every element passes rtol 1e-5.", "",
         "## Noise per class (worst over the corpus; p99 over points in brackets)", "",
         "| class | mode | dtype | compute | points | floor | max eff ULP | p99.9 eff | p99 eff | raw max | floor need (rtol) | rel-L2 | worst at |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (cls, mode, dtype, compute), a in aggs.items():
        def w(k, fmt="{:g}"):
            return fmt.format(a[k]["worst"]) + " (" + fmt.format(a[k]["p99_over_points"]) + ")"
        at = a["eff_max"]["worst_at"] if compute != "float32" else a["rtol_floor_needed"]["worst_at"]
        L.append(f"| {cls} | {mode} | {dtype} | {compute} | {a['n_points']} | {a['floor']:g} | {w('eff_max')} | {w('eff_p999')} | "
                 f"{w('eff_p99')} | {w('raw_max')} | {w('rtol_floor_needed', '{:.4g}')} | "
                 f"{w('rel_l2', '{:.2e}')} | `{at}` |")
    L += ["", "## Routing (top-k expert sets)", "", "| mode / compute | router points | tokens | flipped | benign | points with non-benign flips |",
          "|---|---|---|---|---|---|"]
    for k, d in routing.items():
        L.append(f"| {k} | {d['router_points']} | {d['tokens']} | {d['flipped']} | {d['benign']} | "
                 f"{d['failing_points']} |")
    L += ["", "(twin_vs_native / twin_fp32_vs_bf16 are free runs compared dump to dump; the replay's benign",
          "classification does not apply there, every flip is counted as flipped.)", "",
          "## Proposed rules", "", "| class | mode | dtype | compute | rule | basis |", "|---|---|---|---|---|---|"]
    for r in rules:
        f = r.fields
        txt = ", ".join(f"{k}={v}" for k, v in f.items() if v not in ("off",))
        L.append(f"| {r.cls} | {r.mode} | {r.dtype} | {r.compute} | {txt} | {r.basis} |")
    total = sum(x["seconds"] for x in runs)
    L += ["", f"Run time of dumps + replays: {total:.0f} s over {len(runs)} steps.", ""]
    return "\n".join(L)
