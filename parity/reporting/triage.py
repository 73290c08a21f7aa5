"""Triage across tiers (issue 25, DESIGN §8): one replay of an fp32 and a bf16 dump of the same checkpoint tells
*semantic* errors (the formula differs: the site fails on the fp32 dump) from *precision* errors (it passes fp32 and
fails bf16 beyond the named variants: the target keeps less precision than the reference somewhere) and from named
*variants* (parity.numerics.variants). A port engineer fixes the first semantic error first, then the first precision
error; variants are listed, not failed.

Pure functions over report dicts (`parity.reporting.report.build_report`); the pytest plugin pairs the reports of one run by
checkpoint fingerprint, target and mode, and `tools/report.py triage FP32_REPORT BF16_REPORT` does it afterwards.
`parity.reporting.report` renders the result (terminal lines, report.md section).
"""

from __future__ import annotations

from parity.reporting.report import _loc_site

SEMANTIC, PRECISION, VARIANT = "semantic", "precision", "variant"
# issue 31: the site's failing points all match the reference whose fp32 dots run one bf16 pass
# (parity.replay.dot_precision): the target's dot precision, not its formula nor its roundings
DOT_PRECISION = "dot precision"


def _site(rec: dict) -> tuple:
    """A site across the steps of its phase; the backward phase's points are their own sites (`backward/<site>`:
    a cotangent is not the forward tensor of the same name)."""
    if rec.get("phase") == "backward":
        return rec.get("layer"), f"backward/{rec['site']}"
    return rec.get("layer"), rec["site"]


def _statuses(report: dict) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in report["points"]:
        out.setdefault(_site(r), []).append(r)
    return out


def pair_key(report: dict) -> tuple | None:
    """What two reports must share to be triaged together: checkpoint fingerprint, target, mode."""
    fp = report.get("checkpoint_fingerprint")
    return None if not fp else (fp, report.get("target"), report.get("mode"))


def pairs(reports: list[dict]) -> list[tuple[dict, dict]]:
    """(fp32 report, bf16 report) pairs among one run's reports: same `pair_key`, one float32 and one bfloat16 dump.
    Every bf16 report is paired with the first fp32 report of its key."""
    fp32 = {}
    for r in reports:
        if r.get("dump_dtype") == "float32" and pair_key(r) is not None:
            fp32.setdefault(pair_key(r), r)
    return [(fp32[pair_key(r)], r) for r in reports
            if r.get("dump_dtype") == "bfloat16" and pair_key(r) in fp32]


def _brief(rec: dict | None) -> dict | None:
    if rec is None:
        return None
    keep = ("phase", "step", "layer", "site", "status", "max_ulp", "p99_ulp", "rel_l2", "worst_index", "worst_ref",
            "worst_test", "message", "dtype", "dot_precision")
    return {k: rec[k] for k in keep if k in rec}


def triage(fp32: dict, bf16: dict) -> dict:
    """The per-site diagnosis of a pair: `sites` (layer, site, diagnosis, the statuses seen on each tier) for every
    site that fails on either tier or is a variant, in execution order (a report's points are in that order);
    `first_semantic` (the first failing fp32 point of a semantic site), `first_precision` (the first failing bf16
    point of a precision site), `variants` (per name: the sites that matched it, those that only inherit it),
    `first_dot_precision` (the first failing point of a site whose failing points, on the tier that decides its
    diagnosis, all match the dot-precision shadow: diagnosis `dot precision`, never semantic nor precision)."""
    a, b = _statuses(fp32), _statuses(bf16)
    # a site is diagnosed dot precision only where its report's shadow explains that report's first failing point
    dot_a, dot_b = _explains_first(fp32), _explains_first(bf16)
    rank: dict[tuple, int] = {}
    for n, r in enumerate(bf16["points"] + fp32["points"]):
        rank.setdefault(_site(r), n)
    pos = {id(r): n for rep in (fp32, bf16) for n, r in enumerate(rep["points"])}  # execution order in its report

    def earlier(x: dict | None, y: dict) -> dict:
        return y if x is None or pos[id(y)] < pos[id(x)] else x

    sites, first_sem, first_prec, first_dot, variants = [], None, None, None, {}
    for key in sorted(set(a) | set(b), key=rank.__getitem__):
        ra, rb = a.get(key, []), b.get(key, [])  # each in execution order
        fa = [r for r in ra if r.get("status") in ("fail", "missing")]
        fb = [r for r in rb if r.get("status") in ("fail", "missing")]
        vb = [r for r in rb + ra if r.get("status") == "variant"]
        if fa and dot_a and _dot_precision(fa):
            diagnosis, first = DOT_PRECISION, fa[0]
            first_dot = earlier(first_dot, first)
        elif fa:
            diagnosis, first = SEMANTIC, fa[0]
            first_sem = earlier(first_sem, first)
        elif fb and dot_b and _dot_precision(fb):
            diagnosis, first = DOT_PRECISION, fb[0]
            first_dot = earlier(first_dot, first)
        elif fb:
            compared = any(r.get("status") in ("pass", "benign", "semantic", "variant") for r in ra)
            diagnosis, first = (PRECISION if compared else "bf16 only (not compared on the fp32 dump)"), fb[0]
            if compared:
                first_prec = earlier(first_prec, first)
        elif vb:
            diagnosis, first = VARIANT, vb[0]
            v = vb[0].get("variant") or {}
            e = variants.setdefault(v.get("name", "?"), {"name": v.get("name", "?"), "formula": v.get("formula"),
                                                         "points": 0, "sites": [], "inheriting_sites": []})
            e["points"] += len(vb)
            direct = any(not (r.get("variant") or {}).get("inherited_from") for r in vb)
            e["sites" if direct else "inheriting_sites"].append(_loc_site(*key))
        else:
            continue
        sites.append({"layer": key[0], "site": key[1], "diagnosis": diagnosis,
                      "fp32": _count(ra), "bf16": _count(rb), "first": _brief(first)})
    return {"fp32_dump": fp32.get("dump"), "bf16_dump": bf16.get("dump"), "first_semantic": _brief(first_sem),
            "first_precision": _brief(first_prec), "first_dot_precision": _brief(first_dot),
            "variants": list(variants.values()), "sites": sites}


def _explains_first(report: dict) -> bool:
    """The report's dot-precision shadow explains its first failing point (`dot_precision.explains_first`)."""
    return bool((report.get("dot_precision") or {}).get("explains_first"))


def _dot_precision(failing: list[dict]) -> bool:
    """Every failing point of a site matches the dot-precision shadow (a `missing` point never does)."""
    return all((r.get("dot_precision") or {}).get("matches") for r in failing)


def _count(recs: list[dict]) -> dict:
    out: dict[str, int] = {}
    for r in recs:
        out[r.get("status", "?")] = out.get(r.get("status", "?"), 0) + 1
    return out
