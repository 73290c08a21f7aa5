#!/usr/bin/env python3
"""The calibration tool (thin CLI over parity.calibration): one corpus walk, every derived quantity.

    python tools/calibrate.py corpus [--seeds 1,2,3,4 --prompt-lens 40,160 --decode-steps 4 ...]
                                     [--exactness-seeds 1,2,3,4 --exactness-prompt-lens 24,100 ...] [--workdir W]
        build the corpus (random checkpoints, twin dumps, reference replays), store the measurements in
        parity/numerics/calibration/ and write the generated file (as `rules`); --only noise|exactness|kernels|grads
        walks one corpus and keeps the others' stored measurements (kernels: the real-kernel corpus, --kernel-seeds ...,
        dumped with fla's Triton kernels by $LING3_TRITON_PYTHON or .venv-triton's Python, --kernel-runtimes twin,official
        merged into the stored corpus by runtime; grads: the gradient corpus,
        --grad-seeds 1,2 --grad-prompt-lens 40,160 ..., --grads dumps replayed in layer mode); --remeasure MODES replays
        the noise corpus kept in --workdir again in MODES instead of rebuilding it
    python tools/calibrate.py merge-grads DIR [DIR ...]
        add gradient walks made in parallel (each `corpus --only grads --out DIR`) to the stored gradient corpus
        (a run already stored is refused) and write every generated file
    python tools/calibrate.py rules [--from parity/numerics/calibration] [--check]
        re-derive from stored measurements: parity/numerics/calibration.toml (one header; sections
        gradient_tolerances, the real-kernel ones, tolerances, safety_bounds, exactness_rates) and the reports calibration/calibration.md, calibration/measurements.json;
        --check writes nothing and exits 1 naming every file that differs
    python tools/calibrate.py precision [--workdir W]
        walk the precision corpus (parity.calibration.precision: fresh bf16 dumps replayed by correct-but-different
        targets and by the catalogue's mutants, each failing point's ratio to the fp32 shadow), store it in
        parity/numerics/calibration/ and write the generated file (as `rules`; section precision_ratios)
    python tools/calibrate.py resolution [--dump D ...] [--modes layer,isolated] [--seeds 5] [--pairs 40] [--json F]
        detection resolution of each replay mode (markdown table; parity.calibration.resolution)
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.calibration import corpus as K  # noqa: E402
from parity.calibration import pipeline as P  # noqa: E402
from parity.calibration import rules as R  # noqa: E402
from parity.errors import ParityError  # noqa: E402


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _words(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def _command(argv: list[str]) -> str:
    return "python tools/calibrate.py " + " ".join(shlex.quote(x) for x in argv)


def _write(files: dict[Path, str | bytes], root: Path) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        print(f"wrote {rel}")


def _derive_and_write(meas: K.Measurement, noise_meta: dict, ex_meta: dict, command: str, a: argparse.Namespace) -> None:
    kernels = P.load_kernels(Path(a.out) / P.MEASURED) or P.load_kernels(ROOT / P.MEASURED)
    grads = P.load_grads(Path(a.out) / P.MEASURED) or P.load_grads(ROOT / P.MEASURED)
    precision = P.load_precision(Path(a.out) / P.MEASURED) or P.load_precision(ROOT / P.MEASURED)
    files, log = P.derive(meas, noise_meta, ex_meta, command, a.safety, a.bounds_safety, kernels, grads, precision)
    print("\n".join(log))
    _write({**P.measured_files(meas, noise_meta, ex_meta), **files}, Path(a.out))


def cmd_corpus(a: argparse.Namespace, argv: list[str]) -> int:
    t0 = time.perf_counter()
    command = _command(argv)
    today = datetime.date.today().isoformat()
    log = (lambda s: print(f"[{time.perf_counter() - t0:6.0f}s] {s}", flush=True))
    spec = K.CorpusSpec(presets=_words(a.presets), seeds=_ints(a.seeds), prompt_lens=_ints(a.prompt_lens),
                        dtypes=_words(a.dtypes), decode_steps=a.decode_steps, modes=_words(a.modes),
                        native_seeds=_ints(a.native_seeds))
    xspec = K.ExactnessSpec(seeds=_ints(a.exactness_seeds), prompt_lens=_ints(a.exactness_prompt_lens),
                            decode_steps=a.exactness_decode_steps)
    if a.only == "grads":  # the gradient corpus: walked and stored on its own, then every file re-derived
        gspec = K.GradSpec(presets=_words(a.grad_presets), seeds=_ints(a.grad_seeds),
                           prompt_lens=_ints(a.grad_prompt_lens), dtypes=_words(a.grad_dtypes),
                           runtimes=_words(a.grad_runtimes), kernels="" if a.grad_kernels == "cpu" else a.grad_kernels)
        if not gspec.seeds or 0 in gspec.seeds:
            raise ParityError("corpus --only grads: --grad-seeds must be fresh seeds (not empty, not the bundled 0)")
        try:
            runs = K.grad_runs(gspec)
        except ValueError as e:
            raise ParityError(f"corpus --only grads: {e}") from None
        stored = P.load_grads(Path(a.out) / P.MEASURED) or P.load_grads(ROOT / P.MEASURED) if a.merge else None
        if stored is not None:  # refused before walking: a run already stored is never measured twice
            try:
                K.merge_grad_corpus(stored, [{"corpus": r.corpus_id} for r in runs], {})
            except ValueError as e:
                raise ParityError(str(e)) from None
        with tempfile.TemporaryDirectory(prefix="ling3-calib-") as tmp:
            gmeas = K.walk(runs, Path(a.workdir or tmp), log=log)
        gmeta = {"command": command, "date": today, "machine": R.machine(), "corpus": gspec.__dict__,
                 "runs": gmeas.runs, "seconds": round(time.perf_counter() - t0, 1)}
        gpoints = gmeas.points
        if stored is not None:  # --merge: this walk added to the stored gradient corpus (K.merge_grad_corpus)
            gpoints, gmeta = K.merge_grad_corpus(stored, gpoints, gmeta)
        _write(P.grad_files(gpoints, gmeta), Path(a.out))  # stored before deriving: nothing measured is lost
        meas, noise_meta, ex_meta = P.load(ROOT / P.MEASURED)
        _derive_and_write(meas, noise_meta, ex_meta, command, a)
        print(f"done in {time.perf_counter() - t0:.0f}s")
        return 0
    if a.only == "kernels":  # the real-kernel corpus: walked and stored on its own, then every file re-derived
        runtimes = _words(a.kernel_runtimes)
        bad = [r for r in runtimes if r not in K.KERNEL_RUNTIMES]
        if bad or not runtimes:
            raise ParityError(f"corpus --only kernels: --kernel-runtimes {a.kernel_runtimes!r}: expected a "
                              f"comma-separated subset of {','.join(K.KERNEL_RUNTIMES)}")
        if "official" in runtimes:
            from parity.torch_ref import official

            ok, why = official.available()
            if not ok:
                runtimes = tuple(r for r in runtimes if r != "official")
                print(f"official runtime skipped: {why}", flush=True)
                if not runtimes:
                    raise ParityError("corpus --only kernels: no runtime left to walk (the official file is absent)")
        kspec = K.KernelSpec(presets=_words(a.kernel_presets), seeds=_ints(a.kernel_seeds),
                             prompt_lens=_ints(a.kernel_prompt_lens), dtypes=_words(a.kernel_dtypes),
                             decode_steps=a.kernel_decode_steps, modes=_words(a.modes), runtimes=runtimes)
        if not kspec.seeds:
            raise ParityError("corpus --only kernels: --kernel-seeds is empty")
        with tempfile.TemporaryDirectory(prefix="ling3-calib-") as tmp:
            kmeas = K.walk(K.kernel_runs(kspec), Path(a.workdir or tmp), log=log)
        kmeta = {"command": command, "date": today, "machine": R.machine(), "corpus": kspec.__dict__,
                 "kernel_python": K.kernel_python(), "seconds": round(time.perf_counter() - t0, 1)}
        # a walk of some runtimes replaces those runtimes' stored runs and keeps the others' (K.merge_kernel_corpus)
        try:
            stored = P.load_kernels(Path(a.out) / P.MEASURED) or P.load_kernels(ROOT / P.MEASURED)
            kmeas, kmeta = K.merge_kernel_corpus(stored, kmeas, kmeta)
        except ValueError as e:
            raise ParityError(str(e)) from None
        _write(P.kernel_files(kmeas, kmeta), Path(a.out))  # stored before deriving: nothing measured is lost
        meas, noise_meta, ex_meta = P.load(ROOT / P.MEASURED)
        _derive_and_write(meas, noise_meta, ex_meta, command, a)
        print(f"done in {time.perf_counter() - t0:.0f}s")
        return 0
    stored = P.load(ROOT / P.MEASURED) if (a.only or a.remeasure) else None
    if a.remeasure:
        meas, noise_meta, ex_meta = stored
        meas = K.remeasure(meas, Path(a.workdir), _words(a.remeasure), log=log)
        noise_meta = {**noise_meta, "command": noise_meta["command"] + " && " + command, "date": today}
        _derive_and_write(meas, noise_meta, ex_meta, command, a)
        return 0
    runs = (K.noise_runs(spec) if a.only != "exactness" else []) + \
        (K.exactness_runs(xspec) if a.only != "noise" else [])
    with tempfile.TemporaryDirectory(prefix="ling3-calib-") as tmp:
        work = Path(a.workdir or tmp)
        meas = K.walk(runs, work, log=log)
    seconds = round(time.perf_counter() - t0, 1)
    mine = {"command": command, "date": today, "machine": R.machine()}
    noise_meta = {**mine, "corpus": spec.__dict__, "safety": a.safety, "seconds": seconds}
    ex_meta = {**mine, "corpus": xspec.__dict__}
    if a.only == "exactness":  # keep the stored noise corpus
        meas = K.Measurement(points=stored[0].points, routing=stored[0].routing, runs=stored[0].runs, rows=meas.rows)
        noise_meta = stored[1]
    elif a.only == "noise":  # keep the stored exactness corpus
        meas.rows, ex_meta = stored[0].rows, stored[2]
    _derive_and_write(meas, noise_meta, ex_meta, command, a)
    print(f"done in {time.perf_counter() - t0:.0f}s")
    return 0


def cmd_merge_grads(a: argparse.Namespace, argv: list[str]) -> int:
    """Each walk's gradient corpus (its own points and metadata) added to the stored one, in the order given; a run
    stored twice is refused (K.merge_grad_corpus) before anything is written."""
    stored = P.load_grads(Path(a.out) / P.MEASURED) or P.load_grads(ROOT / P.MEASURED)
    for w in a.walks:
        walk = P.load_grads(Path(w) / P.MEASURED)
        if walk is None:
            raise ParityError(f"{Path(w) / P.MEASURED / 'grad_corpus.json'}: no gradient walk stored there "
                              f"(expected the --out folder of `calibrate.py corpus --only grads`)")
        try:
            stored = K.merge_grad_corpus(stored, *walk)
        except ValueError as e:
            raise ParityError(f"{w}: {e}") from None
    _write(P.grad_files(*stored), Path(a.out))
    meas, noise_meta, ex_meta = P.load(ROOT / P.MEASURED)
    _derive_and_write(meas, noise_meta, ex_meta, _command(argv), a)
    return 0


def _recorded(argv: list[str]) -> list[str]:
    """The `rules` arguments the generated header records: without --check and --out DIR, which change where (or
    whether) the files are written, not what they hold — so `rules --check` compares against what `rules` wrote."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--check" or x.startswith("--out="):
            pass
        elif x == "--out":
            skip = True
        else:
            out.append(x)
    return out


def cmd_rules(a: argparse.Namespace, argv: list[str]) -> int:
    meas, noise_meta, ex_meta = P.load(Path(a.from_))
    files, log = P.derive(meas, noise_meta, ex_meta, _command(_recorded(argv)), a.safety, a.bounds_safety,
                          P.load_kernels(Path(a.from_)), P.load_grads(Path(a.from_)), P.load_precision(Path(a.from_)))
    print("\n".join(log))
    if a.check:
        stale = [str(rel) for rel, text in files.items() if (Path(a.out) / rel).read_text(encoding="utf-8") != text]
        for rel in stale:
            print(f"{rel}: differs from what the stored measurements give (run `python tools/calibrate.py rules`)")
        return 1 if stale else 0
    _write(files, Path(a.out))
    return 0


def cmd_precision(a: argparse.Namespace, argv: list[str]) -> int:
    from parity.calibration import precision as Q

    spec = Q.PrecisionSpec()
    only = None if not a.runs else tuple(tuple(int(x) if i else x for i, x in enumerate(r.split(":")))
                                         for r in a.runs.split(","))
    modes = spec.modes if not a.modes else tuple(a.modes.split(","))
    walked = Q.PrecisionSpec(runs=only or spec.runs, modes=modes)
    with tempfile.TemporaryDirectory() as tmp:
        points = Q.walk(Path(a.workdir or tmp), walked)
    command = _command(argv)
    if only or a.modes:  # re-measured (runs, modes) replace theirs in the stored corpus; the others are kept, both
        stored = P.load_precision(Path(a.out) / P.MEASURED)  # commands recorded
        if stored is None:
            raise P.CalibrationError("precision --runs/--modes: no stored precision corpus to merge into")
        redone = {f"{p}/s{s}/T{t}/" for p, s, t in walked.runs}
        points = [p for p in stored[0] if not (any(p["run"].startswith(r) for r in redone)
                                               and Q.point_mode(p) in modes)] + points
        command = f"{stored[1]['command']} && {command}"
    meta = {"command": command, "date": datetime.date.today().isoformat(), "machine": R.machine(),
            "corpus": f"runs {', '.join(f'{p} seed {s} T={t}' for p, s, t in spec.runs)} (bf16, --grads, "
                      f"{spec.decode_steps} decode steps) × targets {', '.join(Q.corpus_targets())} × modes "
                      f"{', '.join(spec.modes)}"}
    _write(P.precision_files(points, meta), Path(a.out))
    return cmd_rules(argparse.Namespace(from_=str(Path(a.out) / P.MEASURED), check=False, out=a.out,
                                        safety=R.SAFETY, bounds_safety=None), ["rules"])


def cmd_resolution(a: argparse.Namespace, argv: list[str]) -> int:
    from parity.calibration.resolution import collect, table_rows

    dumps = [Path(d) for d in a.dump] if a.dump else sorted((ROOT / "dumps").glob("*.h5"))
    rows = []
    print("| dump | compute | mode | site class | points | relative (≥95 %) | ULP shift (≥95 %) |")
    print("|---|---|---|---|---|---|---|")
    for d in dumps:
        for mode in _words(a.modes):
            t0 = time.perf_counter()
            by_class, failing, compute = collect(d, mode)
            for r in table_rows(by_class, limit=a.pairs, seeds=range(a.seeds), rate=a.rate):
                row = {"dump": d.name, "compute": compute, "mode": mode, **r, "failing_unplanted": failing}
                rows.append(row)
                fmt = (lambda v: "not within the scan" if v is None else f"{v:g}")
                print(f"| {d.name} | {compute} | {mode} | {r['class']} | {r['points']} | {fmt(r['relative'])} | "
                      f"{fmt(r['ulps'])} |", flush=True)
            print(f"<!-- {d.name} {mode}: {time.perf_counter() - t0:.0f}s, {failing} point(s) failing unplanted "
                  f"left out -->", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    d, x = K.CorpusSpec(), K.ExactnessSpec()
    c = sub.add_parser("corpus", help="build the corpus, store the measurements, write every generated file")
    c.add_argument("--presets", default=",".join(d.presets))
    c.add_argument("--seeds", default=",".join(map(str, d.seeds)))
    c.add_argument("--native-seeds", default=",".join(map(str, d.native_seeds)),
                   help="seeds of the unclamped tiny-flash compared against the built-in model ('' = none)")
    c.add_argument("--prompt-lens", default=",".join(map(str, d.prompt_lens)))
    c.add_argument("--dtypes", default=",".join(d.dtypes))
    c.add_argument("--decode-steps", type=int, default=d.decode_steps)
    c.add_argument("--modes", default=",".join(d.modes))
    c.add_argument("--exactness-seeds", default=",".join(map(str, x.seeds)))
    c.add_argument("--exactness-prompt-lens", default=",".join(map(str, x.prompt_lens)))
    c.add_argument("--exactness-decode-steps", type=int, default=x.decode_steps)
    k = K.KernelSpec()
    c.add_argument("--kernel-presets", default=",".join(k.presets))
    c.add_argument("--kernel-seeds", default=",".join(map(str, k.seeds)),
                   help="seeds of the real-kernel corpus (fla's Triton kernels, --only kernels)")
    c.add_argument("--kernel-prompt-lens", default=",".join(map(str, k.prompt_lens)))
    c.add_argument("--kernel-dtypes", default=",".join(k.dtypes))
    c.add_argument("--kernel-decode-steps", type=int, default=k.decode_steps)
    c.add_argument("--kernel-runtimes", default=",".join(k.runtimes),
                   help="whose modeling file the real-kernel dumps run: twin,official (official: the verified "
                        "official file installed into each checkpoint, parity.torch_ref.official; skipped with a "
                        "one-line message where it is absent). A walk of some runtimes is merged into the stored "
                        "corpus: their stored runs are replaced, the others kept")
    g = K.GradSpec()
    c.add_argument("--grad-presets", default=",".join(g.presets))
    c.add_argument("--grad-seeds", default=",".join(map(str, g.seeds)),
                   help="seeds of the gradient corpus (--grads dumps replayed in layer mode, --only grads)")
    c.add_argument("--grad-prompt-lens", default=",".join(map(str, g.prompt_lens)))
    c.add_argument("--grad-dtypes", default=",".join(g.dtypes))
    c.add_argument("--grad-runtimes", default=",".join(g.runtimes),
                   help="whose modeling file dumps the gradient corpus: twin, official (comma-separated)")
    c.add_argument("--grad-kernels", choices=("cpu", "fla"), default="cpu",
                   help="cpu: the CPU stand-ins in this process; fla: fla's real kernels in the Triton Python "
                        "(.venv-triton, as .ci/run makes it; $LING3_TRITON_PYTHON)")
    c.add_argument("--merge", action="store_true",
                   help="--only grads: add this walk to the stored gradient corpus (refused where a run is already "
                        "stored) instead of replacing it")
    c.add_argument("--only", choices=("noise", "exactness", "kernels", "grads"), default=None,
                   help="walk one corpus only; the others' stored measurements are kept (kernels: dumped by "
                        "$LING3_TRITON_PYTHON or .venv-triton's Python, under TRITON_INTERPRET=1 without CUDA)")
    c.add_argument("--remeasure", default=None,
                   help="replay the noise corpus kept in --workdir again in these modes (comma-separated) and "
                        "replace their stored points (the corpus is unchanged)")
    c.add_argument("--workdir", default=None, help="keep checkpoints/dumps here (default: a temp dir)")
    r = sub.add_parser("rules", help="re-derive every generated file from the stored measurements")
    r.add_argument("--from", dest="from_", default=str(ROOT / P.MEASURED), help="folder of the stored measurements")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file differs")
    for s in (c, r):
        s.add_argument("--out", default=str(ROOT),
                       help="write under this folder instead of the repository (same relative paths)")
        s.add_argument("--safety", type=float, default=R.SAFETY, help="safety factor of the tolerance rules")
        s.add_argument("--bounds-safety", type=float, default=None,
                       help="safety factor of the bounds (default: from the corpus' growth, parity/calibration/bounds.py)")
    m = sub.add_parser("merge-grads", help="add gradient walks stored elsewhere (each a `corpus --only grads --out "
                                           "DIR`, walked in parallel) to the stored gradient corpus, write every "
                                           "generated file")
    m.add_argument("walks", nargs="+", help="the --out folders of the walks")
    m.add_argument("--out", default=str(ROOT), help="write under this folder instead of the repository")
    m.add_argument("--safety", type=float, default=R.SAFETY)
    m.add_argument("--bounds-safety", type=float, default=None)
    q = sub.add_parser("precision", help="walk the precision corpus (three-way verdict), write the generated file")
    q.add_argument("--workdir", default=None, help="keep the dumps here (default: a temp dir)")
    q.add_argument("--runs", default=None, help="re-measure only these runs (PRESET:SEED:PROMPT_LEN,...) and keep the "
                                                "stored points of the others")
    q.add_argument("--modes", default=None, help="re-measure only these replay modes (layer,isolated) and keep the "
                                                 "stored points of the others")
    q.add_argument("--out", default=str(ROOT), help="write under this folder instead of the repository")
    s = sub.add_parser("resolution", help="detection resolution of each replay mode")
    s.add_argument("--dump", action="append", default=None, help="dump(s) (default: the bundled dumps)")
    s.add_argument("--modes", default="layer,isolated")
    s.add_argument("--seeds", type=int, default=5, help="trials per pair and magnitude")
    s.add_argument("--pairs", type=int, default=40, help="at most this many points per class (evenly spaced)")
    s.add_argument("--rate", type=float, default=0.95)
    s.add_argument("--json", default=None, help="write the rows here")
    return ap


def legacy(argv: list[str]) -> list[str]:
    """The arguments of the pre-issue-27 tool (no subcommand) as a subcommand's: --from-points DIR -> rules --from
    DIR (with --remeasure: corpus --remeasure); anything else -> corpus. --write-defaults is implied now."""
    rest = [x for x in argv if x != "--write-defaults"]
    if "--from-points" in rest:
        i = rest.index("--from-points")
        src = rest[i + 1]
        del rest[i:i + 2]
        return ["corpus", *rest] if "--remeasure" in rest else ["rules", "--from", src, *rest]
    return ["corpus", *rest]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--") and argv[0] != "--help":
        argv = legacy(argv)
        print(f"tools/calibrate.py needs a subcommand now: running `{_command(argv)}`", file=sys.stderr)
    ap = parser()
    a = ap.parse_args(argv)
    if a.command == "corpus":
        if a.decode_steps < 2:
            ap.error("--decode-steps must be ≥ 2")
        if a.remeasure and not a.workdir:
            ap.error("--remeasure needs --workdir (the kept corpus of the run that made the stored measurements)")
    run = {"corpus": cmd_corpus, "rules": cmd_rules, "resolution": cmd_resolution,
           "precision": cmd_precision, "merge-grads": cmd_merge_grads}[a.command]
    try:
        return run(a, argv)
    except ParityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
