"""Noise of isolated replay (DESIGN §6, `--parity-mode isolated`): per site class, how far the target is from the
dump when every sub-module is fed its own dumped inputs. The replay itself is `parity.replay` (strategy
`observe_isolated`); this module measures and prints.

`python -m parity.replay.isolated DUMP.h5 ... [--measure]` replays each dump in isolated mode and prints status counts and
the per-class noise table; `--measure` judges with `measurement_rules()` so `min_passing_*` are the noise itself.
"""

from __future__ import annotations

from parity.model.points import site_class

MODE = "isolated"


def noise_table(records: list[dict]) -> dict[str, dict]:
    """Per site class (`parity.model.points.site_class`) over compared records: n points, worst max ULP before / after the
    floor, worst fraction of elements not bit-exact (> 1/2 ULP) and > 1 ULP, worst min_passing_max_ulps /
    min_passing_hard_ulps, fails."""
    out: dict[str, dict] = {}
    for r in records:
        if r.get("layer") is None or r.get("max_ulp_raw") is None:
            continue
        t = out.setdefault(site_class(r["site"]), {
            "points": 0, "fail": 0, "max_ulp_raw": 0, "max_ulp": 0, "frac_not_exact": 0.0, "frac_gt1_ulp": 0.0,
            "min_passing_max_ulps": 0, "min_passing_hard_ulps": 0, "worst": None})
        t["points"] += 1
        t["fail"] += r["status"] == "fail"
        if (r["max_ulp"] or 0) > t["max_ulp"] or t["worst"] is None:
            t["worst"] = f"{r['phase']}/{r['step']}/L{r['layer']:02d}/{r['site']}"
        t["max_ulp_raw"] = max(t["max_ulp_raw"], r["max_ulp_raw"] or 0)
        t["max_ulp"] = max(t["max_ulp"], r["max_ulp"] or 0)
        t["frac_not_exact"] = max(t["frac_not_exact"], 1.0 - (r["frac_exact"] or 0.0))
        t["frac_gt1_ulp"] = max(t["frac_gt1_ulp"], 1.0 - (r["frac_le1_ulp"] or 0.0))
        for k in ("min_passing_max_ulps", "min_passing_hard_ulps"):
            t[k] = max(t[k], r.get(k) or 0)
    return out


def measurement_rules():
    """Default rules with every `isolated` lookup replaced by a measuring rule: floor 1 ULP of the row RMS, 1 ULP
    allowed on <= 0.1 % (so `min_passing_max_ulps` / `min_passing_hard_ulps` are the noise), fp32 tensors of bf16 runs
    on the bf16 grid, fp32 runs on the fp32 grid. For measuring only: it never becomes a default."""
    from parity.numerics.tolerances import default_rules, parse_override

    common = "floor_ulps=1,max_ulps=1,allowed_fraction=0.001,hard_ulps=off,rtol=off,atol=off"
    rules = default_rules()
    for text in (f"*:{MODE}:bfloat16:{common},compare_dtype=off",
                 f"*:{MODE}:float32:{common},compare_dtype=bfloat16",
                 f"*:{MODE}:float32:compute=float32,{common},compare_dtype=off"):  # merged last = looked up first
        rules = rules.merged(parse_override(text))
    return rules


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.replay.isolated DUMP.h5 ...`: isolated replay of each dump, status counts and the noise table."""
    import argparse
    import collections

    from parity.dumpfile import DumpReader
    from parity.model.points import parse_layers
    from parity.replay import run_replay

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--layers", default=None, help="e.g. 0,3")
    ap.add_argument("--measure", action="store_true", help="judge with `measurement_rules()` (floor 1 ULP)")
    a = ap.parse_args(argv)
    layers = parse_layers(a.layers)
    for path in a.dumps:
        with DumpReader(path) as d:
            dt = d.meta.get("compute_dtype")
        rep = run_replay(path, mode=MODE, layers=layers, rules=measurement_rules() if a.measure else None)
        counts = collections.Counter(r["status"] for r in rep["points"])
        print(f"{path} ({dt}): {dict(counts)}")
        print(f"  {'class':16s} {'pts':>4s} {'fail':>4s} {'rawmax':>7s} {'max':>5s} {'!exact':>8s} {'>1ulp':>8s} "
              f"{'mp_max':>6s} {'mp_hard':>7s}  worst")
        for cls, t in sorted(noise_table(rep["points"]).items()):
            print(f"  {cls:16s} {t['points']:4d} {t['fail']:4d} {t['max_ulp_raw']:7d} {t['max_ulp']:5d} "
                  f"{t['frac_not_exact']:8.4f} {t['frac_gt1_ulp']:8.4f} {t['min_passing_max_ulps']:6d} "
                  f"{t['min_passing_hard_ulps']:7d}  {t['worst']}")
        for r in rep["points"]:
            if r["status"] in ("fail", "missing"):
                print(f"  {r['status'].upper()} {r['phase']}/{r['step']}/L{r['layer']}/{r['site']}: "
                      f"max {r.get('max_ulp')} ULP, worst {r.get('worst_index')} ref {r.get('worst_ref')} "
                      f"test {r.get('worst_test')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
