#!/usr/bin/env python3
"""Calibrate the default tolerance table from measured reference self-noise (thin CLI over parity.calibrate).

    python tools/calibrate.py [--seeds 1,2] [--prompt-lens 40,160] [--write-defaults]

Writes parity/numerics/calibration/{measurements.json, calibration.md, proposed_tolerances.toml} and, with
--write-defaults, the proposed table to parity/numerics/default_tolerances.toml.
"""

import argparse
import datetime
import gzip
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity import calibrate as C  # noqa: E402


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = C.CorpusSpec()
    ap.add_argument("--presets", default=",".join(d.presets))
    ap.add_argument("--seeds", default=",".join(map(str, d.seeds)))
    ap.add_argument("--native-seeds", default=",".join(map(str, d.native_seeds)),
                    help="seeds of the unclamped tiny-flash compared against the built-in model ('' = none)")
    ap.add_argument("--prompt-lens", default=",".join(map(str, d.prompt_lens)))
    ap.add_argument("--dtypes", default=",".join(d.dtypes))
    ap.add_argument("--decode-steps", type=int, default=d.decode_steps)
    ap.add_argument("--modes", default=",".join(d.modes))
    ap.add_argument("--safety", type=float, default=C.SAFETY)
    ap.add_argument("--out", default=str(ROOT / "parity/numerics/calibration"))
    ap.add_argument("--workdir", default=None, help="keep checkpoints/dumps here (default: a temp dir)")
    ap.add_argument("--from-points", default=None,
                    help="re-aggregate points.json.gz/routing.json.gz of an earlier run in this directory (no corpus)")
    ap.add_argument("--remeasure", default=None,
                    help="with --from-points and --workdir: replay the kept corpus dumps again in these modes "
                         "(comma-separated) and replace their points (the corpus is unchanged)")
    ap.add_argument("--write-defaults", action="store_true",
                    help="also write the proposed table to parity/numerics/default_tolerances.toml")
    a = ap.parse_args(argv)
    if a.decode_steps < 2:
        ap.error("--decode-steps must be ≥ 2")
    spec = C.CorpusSpec(presets=tuple(a.presets.split(",")), seeds=_ints(a.seeds), prompt_lens=_ints(a.prompt_lens),
                        dtypes=tuple(a.dtypes.split(",")), decode_steps=a.decode_steps,
                        modes=tuple(a.modes.split(",")), native_seeds=_ints(a.native_seeds))
    command = "python tools/calibrate.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    date = datetime.date.today().isoformat()
    mach = C.machine()
    t0 = time.perf_counter()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.from_points:
        src = Path(a.from_points)
        meas = C.Measurement(points=json.load(gzip.open(src / "points.json.gz", "rt")),
                             routing=json.load(gzip.open(src / "routing.json.gz", "rt")),
                             runs=json.load(open(src / "measurements.json"))["runs"])
        old = json.load(open(src / "measurements.json"))
        command, date, mach = old["command"], old["date"], old["machine"]
        if a.remeasure:
            if not a.workdir:
                ap.error("--remeasure needs --workdir (the kept corpus of the run that made --from-points)")
            modes = tuple(m for m in a.remeasure.split(",") if m)
            meas = C.remeasure(meas, Path(a.workdir), modes,
                               log=lambda s: print(f"[{time.perf_counter() - t0:6.0f}s] {s}", flush=True))
            command += (" && python tools/calibrate.py " +
                        " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])))
            date = datetime.date.today().isoformat()
            with gzip.open(Path(a.out) / "points.json.gz", "wt") as f:
                json.dump(meas.points, f)
            with gzip.open(Path(a.out) / "routing.json.gz", "wt") as f:
                json.dump(meas.routing, f)
        # the corpus is the measured one, not this invocation's (default) corpus options
        spec = C.CorpusSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in old["corpus"].items()})
    else:
        meas = None
    with tempfile.TemporaryDirectory(prefix="ling3-calib-") as tmp:
      if meas is None:
        work = Path(a.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        meas = C.run_calibration(spec, work, log=lambda s: print(f"[{time.perf_counter() - t0:6.0f}s] {s}", flush=True))
        with gzip.open(Path(a.out) / "points.json.gz", "wt") as f:
            json.dump(meas.points, f)
        with gzip.open(Path(a.out) / "routing.json.gz", "wt") as f:
            json.dump(meas.routing, f)
    n_flip = C.flag_after_flips(meas.points, meas.routing)
    print(f"{n_flip} point(s) downstream of a non-benign routing flip left out of the rules (reported)")
    rules, floors = C.propose_rules(meas.points, a.safety)
    aggs = C.aggregate(meas.points, floors)
    routing = C.routing_summary(meas.routing)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    toml = C.rules_toml(rules, C.toml_header(command, date, mach, spec, a.safety))
    (out / "proposed_tolerances.toml").write_text(toml, encoding="utf-8")
    (out / "measurements.json").write_text(json.dumps({
        "command": command, "date": date, "machine": mach, "corpus": spec.__dict__, "safety": a.safety,
        "seconds": round(time.perf_counter() - t0, 1), "excluded_after_nonbenign_flip": n_flip,
        "groups": [{"class": k[0], "mode": k[1], "dtype": k[2], "compute": k[3], **v} for k, v in aggs.items()],
        "routing": routing, "runs": meas.runs,
    }, indent=1, default=str), encoding="utf-8")
    (out / "calibration.md").write_text(C.markdown(aggs, routing, meas.runs, command, date, mach, rules),
                                        encoding="utf-8")
    if a.write_defaults:
        (ROOT / "parity/numerics/default_tolerances.toml").write_text(toml, encoding="utf-8")
    print(f"done in {time.perf_counter() - t0:.0f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
