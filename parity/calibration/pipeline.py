"""The calibration pipeline: stored corpus measurements -> every generated file, as pure text (the tool writes them).

Measurements (in `parity/numerics/calibration/`, written by `python tools/calibrate.py corpus`):
  points.json.gz, routing.json.gz, measurements.json  the noise corpus (CorpusSpec) and its provenance
  exactness_rows.json.gz, exactness_corpus.json         the exactness corpus (ExactnessSpec) and its provenance
  kernel_*.json.gz, kernel_corpus.json                  the real-kernel corpus (KernelSpec), where one was walked
  grad_points.json.gz, grad_corpus.json                  the gradient corpus (GradSpec), where one was walked
  precision_points.json.gz, precision_corpus.json        the precision corpus (parity.calibration.precision), where
                                                         one was walked (`python tools/calibrate.py precision`)
Generated (`derive`): parity/numerics/calibration.toml — ONE file, one header (the command that generated it, and the
command, date and machine of each corpus), one section per derived quantity in lookup order: the gradient rules of
the backward phase (parity.calibration.gradients, first: they match only `backward/*` sites), the conditional
real-kernel sections, then `SECTIONS`: the tolerance rules (parity.calibration.rules), the per-element safety bounds
(parity.calibration.bounds), the exactness rates and norm-scale noise (parity.calibration.exactness_rates), and last
the precision ratios of the three-way verdict (parity.calibration.precision: only `precision_ratio`); read by
`parity.numerics.tolerances.default_rules`.
Beside it, reports of the same derivation: calibration/calibration.md and the aggregates of measurements.json.
A new class of derived rules is one more section: its entries function, its place in the lookup order, and its
method comment (as the gradient rules' section).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from parity.calibration import bounds as B
from parity.calibration import exactness_rates as X
from parity.calibration import gradients as G
from parity.calibration import rules as R
from parity.calibration.corpus import CorpusSpec, Measurement
from parity.errors import ParityError

NUMERICS = Path("parity") / "numerics"  # relative to the repository root
MEASURED = NUMERICS / "calibration"
CALIBRATION = NUMERICS / "calibration.toml"  # = parity.numerics.tolerances.CALIBRATION_FILE
SECTIONS = (R.SECTION, B.SECTION, X.SECTION)  # lookup order (they set disjoint fields: the order is for clarity)
# Real-kernel bf16 dumps (fla's chunk kernel keeps bf16 intermediates) are replayed by a reference that follows the
# recorded `kda_chunk_precision` fork, but in its own operation order: their noise gets sections of its own, applied
# only to dumps recording that fork value (`when`), listed before the base sections so that they win where they differ.
KERNEL_WHEN = {"kda_chunk_precision": "bfloat16"}
KERNEL_PREFIX = "kda_chunk_bf16_"


class CalibrationError(ParityError):
    """Stored measurements that cannot be read, or a derivation that contradicts its own corpus."""


@dataclass(frozen=True)
class Provenance:
    command: str
    date: str
    machine: str


def _read_json(path: Path, gz: bool = False):
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as e:
        raise CalibrationError(f"{path}: cannot read the stored calibration measurements ({e})") from None


def _field(meta: dict, key: str, path: Path):
    if key not in meta:
        raise CalibrationError(f"{path}: missing key {key!r}; expected the keys the corpus command writes "
                               f"(command, date, machine, corpus)")
    return meta[key]


def load(folder: Path) -> tuple[Measurement, dict, dict]:
    """(measurements, noise-corpus metadata = measurements.json, exactness-corpus metadata) stored in `folder`."""
    folder = Path(folder)
    noise_meta = _read_json(folder / "measurements.json")
    ex_meta = _read_json(folder / "exactness_corpus.json")
    for meta, name in ((noise_meta, "measurements.json"), (ex_meta, "exactness_corpus.json")):
        for k in ("command", "date", "machine", "corpus"):
            _field(meta, k, folder / name)
    meas = Measurement(points=_read_json(folder / "points.json.gz", gz=True),
                       routing=_read_json(folder / "routing.json.gz", gz=True),
                       runs=_field(noise_meta, "runs", folder / "measurements.json"),
                       rows=_read_json(folder / "exactness_rows.json.gz", gz=True))
    return meas, noise_meta, ex_meta


KERNEL_FILES = ("kernel_points.json.gz", "kernel_routing.json.gz", "kernel_rows.json.gz", "kernel_corpus.json")
GRAD_FILES = ("grad_points.json.gz", "grad_corpus.json")


def load_grads(folder: Path) -> tuple[list[dict], dict] | None:
    """(gradient points, metadata) of the gradient corpus stored in `folder`, or None where none was walked."""
    folder = Path(folder)
    if not (folder / "grad_corpus.json").exists():
        return None
    meta = _read_json(folder / "grad_corpus.json")
    for k in ("command", "date", "machine", "corpus", "runs"):
        _field(meta, k, folder / "grad_corpus.json")
    return _read_json(folder / "grad_points.json.gz", gz=True), meta


def grad_files(points: list[dict], meta: dict) -> dict[Path, bytes]:
    """The gradient corpus' measurements as files ({repository-relative path: bytes})."""
    return {MEASURED / "grad_points.json.gz": gzip.compress(json.dumps(points).encode("utf-8"), mtime=0),
            MEASURED / "grad_corpus.json": json.dumps(meta, indent=1).encode("utf-8")}


def load_kernels(folder: Path) -> tuple[Measurement, dict] | None:
    """(measurements, metadata) of the real-kernel corpus stored in `folder`, or None where none was walked."""
    folder = Path(folder)
    if not (folder / "kernel_corpus.json").exists():
        return None
    meta = _read_json(folder / "kernel_corpus.json")
    for k in ("command", "date", "machine", "corpus", "runs"):
        _field(meta, k, folder / "kernel_corpus.json")
    meas = Measurement(points=_read_json(folder / "kernel_points.json.gz", gz=True),
                       routing=_read_json(folder / "kernel_routing.json.gz", gz=True), runs=meta["runs"],
                       rows=_read_json(folder / "kernel_rows.json.gz", gz=True))
    return meas, meta


def load_precision(folder: Path) -> tuple[list[dict], dict] | None:
    """(points, metadata) of the precision corpus stored in `folder`, or None where none was walked."""
    folder = Path(folder)
    if not (folder / "precision_corpus.json").exists():
        return None
    meta = _read_json(folder / "precision_corpus.json")
    for k in ("command", "date", "machine", "corpus"):
        _field(meta, k, folder / "precision_corpus.json")
    return _read_json(folder / "precision_points.json.gz", gz=True), meta


def precision_files(points: list[dict], meta: dict) -> dict[Path, bytes]:
    """The precision corpus' measurements as files ({repository-relative path: bytes})."""
    return {MEASURED / "precision_points.json.gz": gzip.compress(json.dumps(points).encode(), mtime=0),
            MEASURED / "precision_corpus.json": json.dumps(meta, indent=1).encode()}


def derive_precision_section(points: list[dict], meta: dict) -> tuple[tuple[str, str, str], list[str]]:
    """The precision ratios' section (name, method comment, entries) and the lines to print (the margins)."""
    from parity.calibration import precision as Q

    ratios = Q.derive(points)
    log = [f"precision corpus: {sum(p['status'] == 'fail' for p in points)} failing points of {len(points)} (bf16 "
           f"runs), {len({p['run'] for p in points})} runs"]
    log += [f"precision ratio {c.mode:8s} {c.cls:16s} {c.ratio:<6.4g} worst correct {Q._fmt(c.worst_correct)} "
            f"({c.n_correct} pts, {c.worst_correct_at or '-'}); best bug {Q._fmt(c.best_bug)} ({c.n_bug} pts, "
            f"{c.best_bug_at or '-'}); at a bug's site {Q._fmt(c.best_pinned)} ({c.best_pinned_at or '-'})"
            + (" OVERLAP" if c.overlap else "") for c in ratios]
    failing = sum(p["status"] == "fail" for p in points)
    return (Q.SECTION, Q.method_text(meta, failing, Q.SAFETY), Q.entries(ratios, Q.SECTION)), log


def kernel_files(meas: Measurement, meta: dict) -> dict[Path, bytes]:
    """The real-kernel corpus' measurements as files ({repository-relative path: bytes})."""
    def gz(obj) -> bytes:
        return gzip.compress(json.dumps(obj).encode("utf-8"), mtime=0)

    return {MEASURED / "kernel_points.json.gz": gz(meas.points), MEASURED / "kernel_routing.json.gz": gz(meas.routing),
            MEASURED / "kernel_rows.json.gz": gz(meas.rows),
            MEASURED / "kernel_corpus.json": json.dumps({**meta, "runs": meas.runs}, indent=1).encode("utf-8")}


def noise_spec(noise_meta: dict) -> CorpusSpec:
    """The CorpusSpec recorded in measurements.json (lists back to tuples)."""
    return CorpusSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in noise_meta["corpus"].items()})


def header(command: str, corpora: list[tuple[str, Provenance]], sections: list[str] = list(SECTIONS)) -> str:
    """The calibration file's one header: what it is, the command that generated it, and each corpus' command, date
    and machine (the date and machine of the measurements: re-deriving from the same measurements gives the same
    file, which `rules --check` relies on)."""
    lines = ["# Calibrated numerics of ling3-parity (DESIGN §5): every quantity derived from the calibration corpora,",
             "# one section each. Format and lookup: parity/numerics/tolerances.py; reasoning: parity/calibration/.",
             f"# Generated by `{command}` from the measurements in parity/numerics/calibration/ of:"]
    for what, prov in corpora:
        lines.append(f"#   {what}: `{prov.command}` on {prov.date}, {prov.machine}.")
    lines += ["# Do not edit numbers by hand; never raise one to make a failing test pass — re-run the tool.",
              f"# Sections, in lookup order (first match wins, per field): {', '.join(sections)}."]
    return "\n".join(lines)


def bounds_method(safety: float, growth_text: str) -> str:
    return "\n".join([
        "# Per-element safety bounds (`bound_rms`: |a - b| ≤ bound_rms · RMS(reference row) for every element outside",
        "# the floor, whatever allowed_fraction allows), from the noise corpus' points. Reasoning: parity/calibration/bounds.py.",
        "# bound_rms = nice(SAFETY · worst measured |Δ|/RMS of the",
        f"# group), SAFETY = {safety:g} (= 2 × nice_up(largest growth) unless given); worst growth of a group's maximum from one seed half of the corpus to the whole",
        f"# (JAX vs twin): {growth_text}. Sources: layer (every mode but free) = JAX reference vs twin, teacher-forced;",
        "# free = JAX reference vs twin and twin vs transformers' built-in bailing_hybrid, both free runs.",
    ])


def exactness_method(n_records: int) -> str:
    return (f"# Isolated-mode exactness rates (`inexact_row_rate`, parity/numerics/exactness.py) and RMSNorm scale noise\n"
            f"# (`norm_scale_noise`, parity/numerics/rounding.py) from the exactness corpus: {n_records} bf16 points of\n"
            f"# correct isolated replays (parity/calibration/corpus.py, parity/calibration/exactness_rates.py).")


def calibration_toml(head: str, sections: list[tuple[str, str, str]], when: dict[str, dict] | None = None) -> str:
    """The calibration file: `head`, the schema lines, the conditions of conditional sections (`when`: {section:
    {fork: value}}), then per (section, method comment, entries) a banner, the comment and the `[[section]]`
    entries."""
    lines = [head.rstrip(), "", 'schema = "ling3-parity-calibration"', "version = 1",
             "sections = [" + ", ".join(f'"{name}"' for name, _, _ in sections) + "]", ""]
    for name, cond in (when or {}).items():
        lines += [f"[when.{name}]"] + [f'{k} = "{v}"' for k, v in cond.items()] + [""]
    for name, method, entries in sections:
        lines += ["# " + "=" * 116, f"# [[{name}]]", method.rstrip(), "", entries.rstrip(), ""]
    return "\n".join(lines) + "\n"


def growth_summary(bounds: list[B.Bound], growth: dict) -> tuple[list[str], str]:
    """Printable per-group lines (measured halves, growth, bound) and the worst growth per mode."""
    lines = [f"{'class':14} {'mode':5} {'dtype':9} {'compute':9} {'points':>6} {'half A':>9} {'half B':>9} "
             f"{'grow':>5} {'bound_rms':>10}"]
    worst = {"layer": 1.0, "free": 1.0}
    for b in bounds:
        ha, hb, full = growth.get((b.cls, b.mode, b.dtype, b.compute), (0.0, 0.0, 0.0))
        # growth only where both halves are above the grid's resolution (MIN_ULPS ULPs of the RMS)
        res = B.MIN_ULPS * B.UNIT["bfloat16" if b.compute == "bfloat16" else "float32"]
        g = full / min(ha, hb) if min(ha, hb) >= res else float("nan")
        if g == g:
            worst[b.mode] = max(worst[b.mode], g)
        lines.append(f"{b.cls:14} {b.mode:5} {b.dtype:9} {b.compute:9} {b.n_points:6} {ha:9.3g} {hb:9.3g} {g:5.2f} "
                     f"{b.bound_rms:10.4g}")
    return lines, ", ".join(f"{m} {g:.2f}×" for m, g in worst.items())


def kernel_method(kmeta: dict, n_runs: int, what: str) -> str:
    parts = [kmeta] + list(kmeta.get("merged", []))
    def walked(m: dict) -> str:
        c = m["corpus"]
        return (f"{', '.join(c['presets'])} × seeds {', '.join(map(str, c['seeds']))} × prompts "
                f"{', '.join(map(str, c['prompt_lens']))} tokens, {' and '.join(c.get('runtimes', ['twin']))} "
                f"modeling file")
    lines = [
        f"# {what} for dumps that record kda_chunk_precision = bfloat16 (fla's real chunk_kda keeps bf16 intermediates;",
        "# the reference follows the fork, in its own operation order): derived as the base section from the base corpus",
    ]
    if len(parts) == 1:  # the corpus of one walk: its comment as before
        c = kmeta["corpus"]
        lines += [f"# POOLED with the real-kernel corpus ({n_runs} bf16 runs of fla's Triton kernels: "
                  f"{', '.join(c['presets'])} × seeds {', '.join(map(str, c['seeds']))} × prompts",
                  f"# {', '.join(map(str, c['prompt_lens']))} tokens). Only the entries that differ from the base "
                  "section are listed (per-site entries; the base"]
    else:
        lines += [f"# POOLED with the real-kernel corpus ({n_runs} bf16 runs of fla's Triton kernels:"]
        lines += [f"#   {walked(m)}{';' if i < len(parts) - 1 else ').'}" for i, m in enumerate(parts)]
        lines += ["# Only the entries that differ from the base section are listed (per-site entries; the base"]
    lines.append("# catch-alls still cover sites neither corpus measured). Every other dump is judged by the base "
                 "sections alone.")
    return "\n".join(lines)


def derive_kernel_sections(points: list[dict], rules: list[R.ProposedRule], bounds: list[B.Bound], bsafety: float,
                           rows: list[dict], kmeas: Measurement, kmeta: dict, safety: float) \
        -> tuple[list[tuple[str, str, str]], list[str]]:
    """The conditional sections of real-kernel bf16 dumps (KERNEL_WHEN): the base derivations on the base corpus
    pooled with the real-kernel corpus' bf16 runs, keeping the per-site entries that differ from the base ones (the
    pooled worst case is never below the base one, so these are where the real kernels are noisier). The bounds keep
    the base corpus' safety factor. Returns the sections and the lines to print."""
    kpts = [dict(p) for p in kmeas.points if p["corpus"].endswith("/bf16")]
    R.flag_after_flips(kpts, kmeas.routing)
    krows = [r for r in kmeas.rows]
    log = [f"real-kernel corpus: {len(kpts)} bf16 points, {len(krows)} exactness records, "
           f"{len({p['corpus'] for p in kpts})} runs"]
    base = {(r.cls, r.mode, r.dtype, r.compute): r for r in rules}
    pooled, _ = R.propose_rules(points + kpts, safety)
    changed = [r for r in pooled if r.cls != "catch-all" and (r.cls, r.mode, r.dtype, r.compute) in base
               and (r.fields != base[r.cls, r.mode, r.dtype, r.compute].fields
                    or r.sites != base[r.cls, r.mode, r.dtype, r.compute].sites)]
    # A changed layer-group entry has mode "*": listed before the base sections it would also shadow the base's free
    # and isolated entries of its sites, so every group of a changed class is listed (free and isolated first, as in
    # the base section); the unchanged ones repeat the base values (the pooled worst case of an unchanged group).
    classes = {r.cls for r in changed}
    listed = [r for r in pooled if r.cls in classes]
    for r in changed:
        old = base[r.cls, r.mode, r.dtype, r.compute].fields
        diff = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in r.fields.items() if old.get(k) != v)
        log.append(f"kda_chunk_bf16 rule {r.cls} · {r.mode} · {r.dtype} · {r.compute}: {diff}")
    bbase = {(b.cls, b.mode, b.dtype, b.compute): b for b in bounds}
    bpooled = B.derive_bounds(points + kpts, bsafety)
    bchanged = [b for b in bpooled if (b.cls, b.mode, b.dtype, b.compute) in bbase
                and b.bound_rms > bbase[b.cls, b.mode, b.dtype, b.compute].bound_rms]
    blisted = [b for b in bpooled if b.cls in {c.cls for c in bchanged}]  # every group of a changed class (above)
    for b in bchanged:
        log.append(f"kda_chunk_bf16 bound {b.cls} · {b.mode} · {b.dtype} · {b.compute}: bound_rms "
                   f"{bbase[b.cls, b.mode, b.dtype, b.compute].bound_rms:g} -> {b.bound_rms:g}")
    rates, scale = X.derive_rates(rows), X.derive_scale_noise(rows)
    prates, pscale = X.derive_rates(rows + krows), X.derive_scale_noise(rows + krows)
    rate_of = (lambda rs, c: None if rs.get(c, (None,))[0] is None else X.exactness.nice_rate(rs[c][0].rate))
    # only where the real-kernel dumps need more: a pooled rate below the base one (more rows, same inexactness)
    # would tighten the test for those dumps, and tightening is not what their own sections are for
    rchanged = {c: v for c, v in prates.items() if rate_of(prates, c) is not None and rate_of(rates, c) is not None
                and rate_of(prates, c) > rate_of(rates, c)}
    schanged = {site: v for site, v in pscale.items() if v[0] is not None and scale.get(site, (None,))[0] is not None
                and v[0] > scale[site][0]}
    for c in rchanged:
        log.append(f"kda_chunk_bf16 exactness rate {c}: {rate_of(rates, c)} -> {rate_of(prates, c)}")
    for site, (v, _) in schanged.items():
        log.append(f"kda_chunk_bf16 norm_scale_noise {site}: {scale.get(site, (None,))[0]} -> {v}")
    # a class whose rate is unchanged but whose sites' scale noise changed is listed too (entries are per site)
    rsub = {c: prates[c] for c in prates if c in rchanged or any(s in schanged for s in prates[c][1])}
    names = [KERNEL_PREFIX + R.SECTION, KERNEL_PREFIX + B.SECTION, KERNEL_PREFIX + X.SECTION]
    n_runs = len({p["corpus"] for p in kpts})
    sections = [
        (names[0], kernel_method(kmeta, n_runs, "Tolerance rules"), R.rules_entries(listed, names[0], last_resort=False)),
        (names[1], kernel_method(kmeta, n_runs, "Safety bounds"), B.bounds_entries(blisted, names[1], catch_alls=False)),
        (names[2], kernel_method(kmeta, n_runs, "Exactness rates and norm-scale noise"),
         X.rates_entries(rsub, {s: v for s, v in pscale.items() if s in schanged}, names[2],
                         teacher_forced=bool(schanged))),
    ]
    return sections, log


def derive_grad_section(points: list[dict], meta: dict, safety: float = G.SAFETY) \
        -> tuple[tuple[str, str, str], list[str]]:
    """The gradient rules' section (name, method comment, entries) from the gradient corpus, and the lines to print.
    Raises CalibrationError where the corpus holds a NaN/Inf mismatch or a point fails the rule derived from it."""
    try:
        rules = G.derive_grad_rules(points, safety)
    except ValueError as e:
        raise CalibrationError(f"gradient rules: {e}") from None
    bad = G.check_points(points, rules)
    if bad:
        raise CalibrationError(f"gradient rules: {len(bad)} corpus point(s) fail the rule derived from them, first "
                               f"{bad[0]}")
    log = [f"gradient corpus: {len(points)} points, {len({p['corpus'] for p in points})} runs; every point passes"]
    log += [f"gradient rule {r.cls} · {r.compute} ({r.n_points} points): floor_ulps {r.fields['floor_ulps']:g}, "
            f"allowed_fraction {r.fields['allowed_fraction']:g} — {r.basis}" for r in rules]
    return (G.SECTION, G.grad_method(meta, len(points), safety), G.grad_entries(rules, G.SECTION)), log


def derive(meas: Measurement, noise_meta: dict, ex_meta: dict, command: str, safety: float = R.SAFETY,
           bounds_safety: float | None = None, kernels: tuple[Measurement, dict] | None = None,
           grads: tuple[list[dict], dict] | None = None, precision: tuple[list[dict], dict] | None = None
           ) -> tuple[dict[Path, str], list[str]]:
    """Every generated file ({repository-relative path: text}) and the lines to print, from stored measurements.
    `command` is this derivation's command (recorded in the calibration file's header with each corpus' command).
    `kernels`: the real-kernel corpus (`load_kernels`), which adds the conditional sections of real-kernel bf16 dumps.
    `grads`: the gradient corpus (`load_grads`), which adds the gradient rules' section (first in lookup order).
    Raises CalibrationError when a corpus point is beyond the safety bound derived from it, or fails the gradient
    rule derived from it."""
    from parity.numerics.tolerances import parse_calibration

    noise = Provenance(noise_meta["command"], noise_meta["date"], noise_meta["machine"])
    ex = Provenance(ex_meta["command"], ex_meta["date"], ex_meta["machine"])
    spec = noise_spec(noise_meta)
    log: list[str] = []
    # tolerance rules
    points = [dict(p) for p in meas.points]  # flag_after_flips marks points: copies keep `meas` as stored
    n_flip = R.flag_after_flips(points, meas.routing)
    log.append(f"{n_flip} point(s) downstream of a non-benign routing flip left out of the rules (reported)")
    rules, floors = R.propose_rules(points, safety)
    aggs = R.aggregate(points, floors)
    routing = R.routing_summary(meas.routing)
    rules_text = R.rules_entries(rules, R.SECTION)
    summary = {k: v for k, v in noise_meta.items() if k not in ("groups", "routing", "runs", "excluded_after_nonbenign_flip")}
    summary.update({"corpus": asdict(spec), "safety": safety, "excluded_after_nonbenign_flip": n_flip,
                    "groups": [{"class": k[0], "mode": k[1], "dtype": k[2], "compute": k[3], **v}
                               for k, v in aggs.items()],
                    "routing": routing, "runs": meas.runs})
    # safety bounds
    growth = B.tail_growth(meas.points)
    bsafety = bounds_safety or B.safety_from_growth(growth)
    bounds = B.derive_bounds(meas.points, bsafety)
    lines, growth_text = growth_summary(bounds, growth)
    log += lines + [f"worst growth of a group's maximum from one seed half to the whole corpus: {growth_text}"]
    bounds_text = B.bounds_entries(bounds, B.SECTION)
    head = header(command, [("noise corpus", noise), ("exactness corpus", ex)])
    ratios = B.check_points(meas.points, parse_calibration(calibration_toml(head, [(B.SECTION, "", bounds_text)]),
                                                           "safety bounds")[B.SECTION])
    log.append(f"corpus check: largest measured/bound ratio {ratios[0][0]:.3f} at {ratios[0][1]} "
               f"({len(ratios)} points; > 1 would be a corpus point beyond its bound)")
    if ratios[0][0] > 1:
        raise CalibrationError(f"safety bounds: corpus point {ratios[0][1]} is {ratios[0][0]:.3f}× its bound")
    # exactness rates and norm-scale noise
    rates = X.derive_rates(meas.rows)
    scale = X.derive_scale_noise(meas.rows)
    rates_text = X.rates_entries(rates, scale, X.SECTION)
    for site, (c, why) in scale.items():
        log.append(f"{site:28s} norm_scale_noise {'off' if c is None else f'{c:g}'} ({why})")
    for cls, (d, _) in rates.items():
        log.append(f"{cls:14s} " + ("off" if d is None else f"rate {d.rate:.3g} (pooled {d.inexact}/{d.rows}, "
                                                           f"worst {d.worst_point} {d.worst_r}/{d.worst_rows})"))
    sections = [(R.SECTION, R.method_text(spec, safety), rules_text),
                (B.SECTION, bounds_method(bsafety, growth_text), bounds_text),
                (X.SECTION, exactness_method(len(meas.rows)), rates_text)]
    when = {}
    corpora = [("noise corpus", noise), ("exactness corpus", ex)]
    if kernels is not None:
        kmeas, kmeta = kernels
        ksections, klog = derive_kernel_sections(points, rules, bounds, bsafety, meas.rows, kmeas, kmeta, safety)
        log += klog
        sections = ksections + sections
        when = {name: KERNEL_WHEN for name, _, _ in ksections}
        corpora.append(("real-kernel corpus", Provenance(kmeta["command"], kmeta["date"], kmeta["machine"])))
        corpora += [("real-kernel corpus, merged walk", Provenance(m["command"], m["date"], m["machine"]))
                    for m in kmeta.get("merged", [])]
    if grads is not None:  # the backward phase's rules: their own sites (`backward/*`), first in lookup order
        gsection, glog = derive_grad_section(*grads, safety)
        log += glog
        sections = [gsection] + sections
        corpora.append(("gradient corpus", Provenance(grads[1]["command"], grads[1]["date"], grads[1]["machine"])))
        corpora += [("gradient corpus, merged walk", Provenance(m["command"], m["date"], m["machine"]))
                    for m in grads[1].get("merged", [])]
    if precision is not None:  # the three-way verdict's ratios: one field of their own, last in lookup order
        qsection, qlog = derive_precision_section(*precision)
        log += qlog
        sections = sections + [qsection]
        corpora.append(("precision corpus", Provenance(precision[1]["command"], precision[1]["date"],
                                                       precision[1]["machine"])))
    head = header(command, corpora, [name for name, _, _ in sections])
    text = calibration_toml(head, sections, when)
    parsed = parse_calibration(text, str(CALIBRATION))  # the file reads back as written
    if kernels is not None:  # every real-kernel bf16 point within the bound its dumps are judged by
        from parity.numerics.tolerances import flatten

        table = flatten(parsed).for_semantics(KERNEL_WHEN)
        kr = B.check_points([p for p in kernels[0].points if p["corpus"].endswith("/bf16")], table)
        log.append(f"real-kernel corpus check: largest measured/bound ratio {kr[0][0]:.3f} at {kr[0][1]}")
        if kr[0][0] > 1:
            raise CalibrationError(f"safety bounds: real-kernel point {kr[0][1]} is {kr[0][0]:.3f}× its bound")
    files = {
        CALIBRATION: text,
        MEASURED / "measurements.json": json.dumps(summary, indent=1, default=str),
        MEASURED / "calibration.md": R.markdown(aggs, routing, meas.runs, noise.command, noise.date, noise.machine,
                                                rules),
    }
    return files, log


def measured_files(meas: Measurement, noise_meta: dict, ex_meta: dict) -> dict[Path, bytes]:
    """The stored measurements as files ({repository-relative path: bytes}); measurements.json is written by
    `derive` (it also holds the aggregates)."""
    def gz(obj) -> bytes:
        return gzip.compress(json.dumps(obj).encode("utf-8"), mtime=0)

    return {MEASURED / "points.json.gz": gz(meas.points), MEASURED / "routing.json.gz": gz(meas.routing),
            MEASURED / "exactness_rows.json.gz": gz(meas.rows),
            MEASURED / "exactness_corpus.json": json.dumps(ex_meta, indent=1).encode("utf-8")}


__all__ = ["CALIBRATION", "CalibrationError", "MEASURED", "NUMERICS", "Provenance", "SECTIONS", "calibration_toml",
           "derive", "derive_grad_section", "grad_files", "header", "kernel_files", "load", "load_grads",
           "load_kernels", "measured_files", "noise_spec"]
