"""The precision ratios of the three-way verdict (issue 31, parity_anchors §6b; `precision_ratio`, the
`precision_ratios` section of calibration.toml; the judge's side is parity.replay.shadows, kind `precision`).

A bf16 point that fails against the dump (HF bf16) is `variant` more-precise-than-reference where its error against
the fp32 shadow (the reference in fp32 on the same bf16 weights and teacher-forced inputs) is at most R × the dump's
own error against that shadow (L2 norms). R is calibrated per site class (parity.model.points.site_class; the
backward phase: the gradient classes of parity.calibration.gradients) from two corpora of bf16 replays:

- correct but different (R must accept them): the reference compiled under XLA's default flags
  (`LING3_REFERENCE_XLA_DEFAULTS=1`, a subprocess: the option is read at import), the reference keeping fp32
  intermediates (`Fp32IntermediatesTarget`: computes in fp32, rounds each point to the dtype the bf16 reference
  gives it) and the single-rounding RMSNorm variant (parity.targets.mutants `rmsnorm_fused_scale`);
- real precision losses (R must refuse them at their own site): the catalogue's `precision` and `sub-tolerance`
  mutants (among them the KDA beta sigmoid in bf16 while HF keeps it fp32, the KDA q/k L2 norm taken in the
  activation dtype before the fp32 upcast), each replayed on the layer its catalogue entry expects the error in.
  (Porting mutants move their site by far more than a rounding: they are checked by tests/test_mutations.py under
  XLA's defaults instead.)

Measured per point: every floating point of a bf16 run (bf16 points and the fp32 ones — KDA gate, beta, state —
that inherit bf16 inputs; layer, head and MTP points; forward and backward phases) whose compare against the dump
fails and that no other shadow explains (status `fail`: the only points the three-way verdict is asked about),
ratio = ||target − shadow|| / ||dump − shadow||.
Derivation per class: R = worst correct ratio × SAFETY, rounded up to the next 1/8 (never below 1: a
target as precise as the dump, differing from it, is accepted) — unless that reaches the smallest ratio at a bug's own
catalogue site in the class (where the bug must stay failing: `pinned`), then R is the geometric mean of the two; a
class whose worst correct ratio reaches that is printed as an overlap (not separable by this rule). Points downstream
of a bug (its error inherited) may lie below R: the bug still fails at its own site, which stays the source. A class
the correct corpus never asked about gets the catch-all `*` (the worst over every class, as the tolerance rules give
an unknown site the loosest calibrated class). The margins (worst correct vs best bug, per class) go into the
section's comments and docs/numerics.md.

`precision_dump_peak` (per class and mode, `peak_ceiling`): the worst dump peak over the class's points × 2. The
isolated entries bound the dump against the fp32 site fed the dump's own inputs; the judge uses them in layer mode
too, for the guard's question at a site with an isolated form (`HighPrecision.local`: does the dump depart from the
formula *here*?), since the layer shadow's peak also holds what the dump inherited (docs/numerics.md, "The dump peak
in layer mode"). The layer entries' ceilings bound the layer peak where no local shadow exists (head, MTP, backward).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SECTION = "precision_ratios"
SAFETY = 1.25
PEAK_SAFETY = 2.0
PEAK_MIN_POINTS = 10
CORRECT = "correct"
BUG = "bug"


def ratio_class(site: str, phase: str) -> str:
    """The class a point's ratio is calibrated in: its numerics class (forward) or gradient class (backward)."""
    if phase == "backward":
        from parity.calibration.gradients import grad_class

        return grad_class(site)
    from parity.model.points import site_class

    return site_class(site)


def _base(site: str) -> str:
    from parity.model.points import mtp_site

    m = mtp_site(site)
    return site if m is None else m[1]


def class_glob(cls: str) -> list[str]:
    """The rule-table site patterns of a class: the sites of the site graph (and the model / MTP sites) in it; a
    gradient class's glob."""
    from parity.calibration.gradients import CLASSES
    from parity.model.mtp_points import MTP_SITES_AFTER, MTP_SITES_BEFORE
    from parity.model.points import MODEL_SITE_CLASSES, SITE_GRAPH, site_class

    grads = dict(CLASSES)
    if cls in grads:
        return [grads[cls]]
    names = {s.name for s in SITE_GRAPH} | set(MODEL_SITE_CLASSES) | set(MTP_SITES_BEFORE) | set(MTP_SITES_AFTER)
    return sorted(n for n in names if site_class(n) == cls)


def _order(cls: str) -> tuple:
    """Lookup order of the section's entries: forward classes (exact site names), then the gradient classes most
    specific first (their globs nest), then the catch-all."""
    from parity.calibration.gradients import CLASSES

    grads = [c for c, _ in CLASSES]
    if cls == "*":
        return (2, 0, cls)
    return (1, grads.index(cls), cls) if cls in grads else (0, 0, cls)


# ------------------------------------------------------------------------------------------------ targets
def fp32_intermediates_target():
    """The reference keeping fp32 intermediates: computes each layer in fp32 (bf16 weights and inputs upcast) and
    rounds each point to the dtype the bf16 reference gives it (a port whose kernels keep fp32 inside a layer)."""
    from parity.targets.reference import ReferenceTarget

    class Fp32IntermediatesTarget(ReferenceTarget):
        name = "reference-fp32-intermediates"

        def build(self, config, dtype: str, mesh=None) -> None:
            super().build(config, "float32")
            self._low = ReferenceTarget(**self.semantic_options())
            self._low.build(config, dtype)
            self._dtypes: dict = {}

        def load_layer(self, i: int, hf: dict) -> None:
            super().load_layer(i, hf)
            self._low.load_layer(i, hf)

        def unload_layer(self, i: int) -> None:
            super().unload_layer(i)
            self._low.unload_layer(i)

        def _cast(self, pts: dict, dtypes: dict) -> dict:
            return {k: (np.asarray(v).astype(dtypes[k]) if k in dtypes and v is not None else v)
                    for k, v in pts.items()}

        def layer_forward(self, i, hidden, positions, state=None, forced_topk=None):
            r = super().layer_forward(i, hidden, positions, state, forced_topk=forced_topk)
            if i not in self._dtypes:  # the first call of a layer is its prefill: no state needed
                low = self._low.layer_forward(i, hidden, positions, None, forced_topk=forced_topk)
                self._dtypes[i] = {**{k: np.asarray(v).dtype for k, v in low.points.items() if v is not None},
                                   "__out": np.asarray(low.output).dtype}
            d = self._dtypes[i]
            return replace(r, points=self._cast(dict(r.points), d), output=np.asarray(r.output).astype(d["__out"]))

        def submodule(self, i, site, inputs, state=None):
            """Isolated mode: the site in fp32 on the dumped inputs upcast exactly, rounded to the dtype the bf16
            reference gives it."""
            def up(d):
                return None if d is None else {k: (np.asarray(v).astype(np.float32)
                                                   if np.asarray(v).dtype.kind == "f"
                                                   or np.asarray(v).dtype.name == "bfloat16" else v)
                                               for k, v in d.items()}

            r = super().submodule(i, site, up(inputs), up(state))
            low = self._low.submodule(i, site, inputs, state)
            return None if r is None or low is None else np.asarray(r).astype(np.asarray(low).dtype)

        def layer_backward(self, i, hidden, positions, cotangent, forced_topk=None):
            r = super().layer_backward(i, hidden, positions, cotangent, forced_topk=forced_topk)
            low = self._low.layer_backward(i, hidden, positions, cotangent, forced_topk=forced_topk)
            pd = {k: np.asarray(v).dtype for k, v in low.points.items() if v is not None}
            gd = {k: np.asarray(v).dtype for k, v in low.param_grads.items()}
            return replace(r, points=self._cast(dict(r.points), pd), param_grads=self._cast(dict(r.param_grads), gd),
                           input_grad=np.asarray(r.input_grad).astype(np.asarray(low.input_grad).dtype))

    return Fp32IntermediatesTarget


def corpus_targets() -> dict[str, tuple[str, str]]:
    """name -> (kind, target spelling for `measure`): the correct-but-different targets and the bugs."""
    from parity.targets.mutants import MUTATIONS

    out = {"xla-defaults": (CORRECT, "reference"), "fp32-intermediates": (CORRECT, "fp32-intermediates"),
           "rmsnorm-single-rounding": (CORRECT, "variant:rmsnorm_fused_scale")}
    for n, m in MUTATIONS.items():
        if m.cls == "precision" or m.cls == "sub-tolerance":
            out[n] = (BUG, f"mutant:{n}")
    return out


def _target(spec: str, ckpt: str):
    if spec == "reference":
        return None
    if spec == "fp32-intermediates":
        return fp32_intermediates_target()
    from parity.targets.mutants import MutantTarget

    kind, name = spec.split(":", 1)
    return MutantTarget(name, ckpt_dir=ckpt) if kind == "mutant" else MutantTarget(name)


# ------------------------------------------------------------------------------------------------ measuring
def measure(dump: str, ckpt: str | None, target: str, layers: Sequence[int] | None = None,
            mode: str = "layer") -> list[dict]:
    """Every floating point of a bf16 replay in `mode` (layer or isolated) that has a shadow, with its ratio to the
    fp32 shadow and the dump's own peak error against it: [{"site", "phase", "step", "layer", "class", "ratio",
    "error", "dump_error", "dump_peak", "coarser_grid", "status", "mode"}]. The ratio is asked about only where the
    compare fails (status `fail`); the dump peak is a sample of a correct dump's own error at every point (the shadow
    is run for every unit)."""
    from parity.replay import replay_records
    from parity.replay.session import Session
    from parity.replay.shadows import PRECISION, precision_entry

    from parity.numerics.tolerances import default_rules, parse_override

    # the verdict itself off: the corpus must see every failing point, not those the shipped ratios already accept
    rules = default_rules().merged(parse_override("*:*:*:precision_ratio=off", "the precision corpus"))
    out = []
    with Session.open(dump, ckpt, target=_target(target, ckpt), rules=rules, mode=mode) as s:
        for r in replay_records(s, layers):
            o = r.observation
            if o is None or o.ref is None or o.test is None:
                continue
            dt = np.asarray(o.ref).dtype
            if (dt.kind != "f" and dt.name != "bfloat16") or "max_ulp" not in r.stats:
                continue
            h = o.shadows.get(PRECISION)
            arr = None if h is None else h.array()
            test = np.asarray(o.test)
            if arr is None or np.shape(arr) != test.shape:
                continue
            e = precision_entry(o.ref, test, np.asarray(arr), None)
            p = r.point
            out.append({"phase": p.phase, "step": p.step, "layer": p.layer, "site": p.site,
                        "class": ratio_class(_base(p.site), p.phase), "ratio": e["ratio"], "error": e["error"],
                        "dump_error": e["dump_error"], "dump_peak": e["dump_peak"],
                        "coarser_grid": e["coarser_grid"], "status": r.status.value, "dtype": dt.name,
                        "mode": mode})
    return out


def measure_in_subprocess(dump: str, ckpt: str | None, target: str, layers: Sequence[int] | None,
                          xla_defaults: bool, mode: str = "layer") -> list[dict]:
    """`measure` in a fresh process (the reference's compiler options are read at import: XLA's defaults need one)."""
    env = dict(os.environ)
    env.pop("LING3_REFERENCE_XLA_DEFAULTS", None)
    if xla_defaults:
        env["LING3_REFERENCE_XLA_DEFAULTS"] = "1"
    args = [sys.executable, "-m", "parity.calibration.precision", dump, "--target", target, "--mode", mode]
    if ckpt:
        args += ["--ckpt", ckpt]
    if layers is not None:
        args += ["--layers", ",".join(map(str, layers))]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measure {target} on {dump}: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the corpus walk
@dataclass(frozen=True)
class PrecisionSpec:
    """The precision corpus: fresh bf16 twin dumps (with --grads) of the bundled checkpoints, one (seed, prompt
    length) per preset — different from the golden dumps' (which stay out of sample: the acceptance replays them)."""

    runs: tuple[tuple[str, int, int], ...] = (("tiny", 1, 40), ("tiny-flash", 2, 100))  # (preset, seed, prompt len)
    decode_steps: int = 2
    # replay modes the verdict runs in: isolated mode gets ratios of its own (a site fed its own dumped inputs
    # differs from the dump only by its internal roundings; a layer's points also inherit their inputs' errors)
    modes: tuple[str, ...] = ("layer", "isolated")


def _dump(ckpt: Path, out: Path, seed: int, T: int, decode_steps: int) -> Path:
    from parity.model.config import Ling3Config
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    if not out.exists():
        cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
        dump_checkpoint(ckpt, out, builtin_ids(cfg.vocab_size, T, seed),
                        DumpOptions(dtype="bfloat16", decode_steps=decode_steps, grads=True, progress=False))
    return out


def walk(workdir: Path, spec: PrecisionSpec = PrecisionSpec(), log=print) -> list[dict]:
    """Every corpus point: each run's dump replayed by each corpus target (`corpus_targets`): the correct ones over
    every layer, the bugs over the layer their catalogue entry expects the error in (on their own preset's dumps)."""
    from parity.model.config import Ling3Config
    from parity.replay.session import BUNDLED_CKPTS
    from parity.targets.mutants import MUTATIONS

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    points: list[dict] = []
    for preset, seed, T in spec.runs:
        ckpt = BUNDLED_CKPTS / preset
        dump = _dump(ckpt, workdir / f"{preset}-s{seed}-T{T}-bf16.h5", seed, T, spec.decode_steps)
        cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
        for mode, (name, (kind, target)) in ((m, t) for m in spec.modes for t in corpus_targets().items()):
            layers = None
            if kind == BUG:
                m = MUTATIONS[name]
                if m.preset != preset:
                    continue
                exp = m.expected(cfg)
                if exp.layer is None or exp.layer >= cfg.num_hidden_layers:
                    continue
                layers = [exp.layer]
            # isolated mode: a bug is measured under the reference's options and under XLA's defaults (its bf16
            # casts may be elided there: the verdict must refuse what is left of it either way)
            for xla in ([name == "xla-defaults"] if mode == "layer" or kind == CORRECT else [False, True]):
                got = measure_in_subprocess(str(dump), str(ckpt), target, layers, xla_defaults=xla, mode=mode)
                run = (f"{preset}/s{seed}/T{T}/{name}" + ("" if mode == "layer" else f"/{mode}")
                       + ("/xla-defaults" if xla and kind == BUG else ""))
                points += [{**p, "kind": kind, "run": run, "target": name} for p in got]
                fails = [p for p in got if p["status"] == "fail"]
                lo = min((p["ratio"] for p in fails), default=None)
                hi = max((p["ratio"] for p in fails), default=None)
                log(f"{run}: {len(fails)} failing point(s) of {len(got)}, ratios {_fmt(lo)}..{_fmt(hi)}")
    return points


# ------------------------------------------------------------------------------------------------ deriving
@dataclass(frozen=True)
class ClassRatio:
    cls: str
    ratio: float
    worst_correct: float | None
    worst_correct_at: str | None
    best_bug: float | None  # over every failing point of a bug run (downstream ones included)
    best_bug_at: str | None
    best_pinned: float | None  # over the points at a bug's own catalogue site (where it must stay failing)
    best_pinned_at: str | None
    n_correct: int
    n_bug: int
    overlap: bool
    dump_peak: float | None = None  # the ceiling on the dump's own peak error (precision_dump_peak)
    worst_peak: float | None = None
    worst_peak_at: str | None = None
    n_peak: int = 0
    mode: str = "layer"  # the replay mode the ratio is for ("layer": every mode but isolated, which has its own)


def _round_up(x: float) -> float:
    """Up to the next 1/8: a coarser grid (1, 1.5, 2, ...) let a bf16 short conv (ratio 1.45) through where the
    worst correct ratio was 0.98 (tests/test_triage.py's port)."""
    return math.ceil(x * 8 - 1e-9) / 8


def _where(p: dict) -> str:
    lay = "model" if p["layer"] is None else f"L{p['layer']:02d}"
    step = "" if p["phase"] != "decode" else f"S{p['step']:03d}/"
    return f"{p.get('run', '?')}:{p['phase']}/{step}{lay}/{p['site']}"


def pinned(p: dict) -> bool:
    """Whether a bug run's point is at the bug's own catalogue site (parity.targets.mutants `expected`)."""
    from parity.model.config import Ling3Config
    from parity.replay.session import BUNDLED_CKPTS
    from parity.targets.mutants import MUTATIONS

    m = MUTATIONS.get(p.get("target", ""))
    if m is None:
        return False
    exp = m.expected(Ling3Config.from_pretrained_dir(BUNDLED_CKPTS / m.preset, strict=False))
    return (p["phase"], p["step"], p["layer"]) == (exp.phase, exp.step, exp.layer) and p["site"] in exp.sites


def derive_class(cls: str, correct: Sequence[dict], bugs: Sequence[dict], safety: float = SAFETY) -> ClassRatio:
    """R of one class (module docstring): worst correct × safety on the grid, kept below the best ratio at a bug's
    own site (the geometric mean of the two where the grid value would reach it)."""
    wc = max(correct, key=lambda p: p["ratio"]) if correct else None
    bb = min(bugs, key=lambda p: p["ratio"]) if bugs else None
    pins = [p for p in bugs if p.get("pinned")]
    bp = min(pins, key=lambda p: p["ratio"]) if pins else None
    worst = wc["ratio"] if wc else 1.0
    r = max(1.0, _round_up(worst * safety))
    overlap = bp is not None and worst >= bp["ratio"]
    if bp is not None and r >= bp["ratio"] and not overlap:
        r = math.sqrt(worst * bp["ratio"])
    return ClassRatio(cls, r, wc and wc["ratio"], wc and _where(wc), bb and bb["ratio"], bb and _where(bb),
                      bp and bp["ratio"], bp and _where(bp), len(correct), len(bugs), overlap)


def _round_up_2(x: float) -> float:
    """Up to two significant digits (a ceiling written into the table)."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10 ** e - 1e-9) * 10 ** e


def peak_ceiling(peaks: Sequence[dict], fallback: Sequence[dict]) -> tuple[float | None, dict | None, int]:
    """`precision_dump_peak` of a class: the worst dump peak over its points × PEAK_SAFETY, two significant digits.
    Every corpus dump is a correct twin dump, so every point of every run (bug runs too) is a sample of a correct
    dump's own error; a class with fewer than PEAK_MIN_POINTS samples takes the worst over `fallback` (every class
    of its phase) instead of a ceiling fitted to a handful of rows."""
    use = peaks if len(peaks) >= PEAK_MIN_POINTS else fallback
    use = [p for p in use if p.get("dump_peak") is not None and math.isfinite(p["dump_peak"])]
    if not use:
        return None, None, 0
    w = max(use, key=lambda p: p["dump_peak"])
    return _round_up_2(w["dump_peak"] * PEAK_SAFETY), w, len(use)


def point_mode(p: dict) -> str:
    """The replay mode a corpus point was measured in (points stored before isolated mode was walked: layer)."""
    return p.get("mode", "layer")


def derive(points: Iterable[dict], safety: float = SAFETY) -> list[ClassRatio]:
    """Per replay mode of the corpus (isolated first: its entries are the more specific), one ratio per class the
    correct corpus holds points of, then the catch-all `*` (`derive_mode`)."""
    points = list(points)
    modes = sorted({point_mode(p) for p in points}, key=lambda m: (m != "isolated", m))
    return [c for m in modes for c in derive_mode([p for p in points if point_mode(p) == m], safety, m)]


def derive_mode(points: Sequence[dict], safety: float = SAFETY, mode: str = "layer") -> list[ClassRatio]:
    """One ratio per class the correct corpus holds points of, then the catch-all `*`. Only the points the verdict
    is asked about count: compare failed and no other shadow explained them (status `fail`). Each class also gets
    its ceiling on the dump's own peak error (`peak_ceiling`)."""
    points = list(points)
    pts = [dict(p, pinned=p["kind"] == BUG and pinned(p)) for p in points if p["status"] == "fail"]
    correct = [p for p in pts if p["kind"] == CORRECT and math.isfinite(p["ratio"])]
    bugs = [p for p in pts if p["kind"] == BUG]
    classes = sorted({p["class"] for p in correct}, key=_order)

    def with_peak(c: ClassRatio, members: list[dict], phase_pts: list[dict]) -> ClassRatio:
        ceil, w, n = peak_ceiling(members, phase_pts)
        return replace(c, dump_peak=ceil, worst_peak=w and w["dump_peak"], worst_peak_at=w and _where(w), n_peak=n)

    def phase_of(p: dict) -> bool:
        return p["phase"] == "backward"

    out = []
    for c in classes:  # the dump peaks: every point of the class, failing or not (a property of the dump)
        members = [p for p in points if p["class"] == c]
        back = any(phase_of(p) for p in members)
        out.append(with_peak(derive_class(c, [p for p in correct if p["class"] == c],
                                          [p for p in bugs if p["class"] == c], safety),
                             members, [p for p in points if phase_of(p) == back]))
    out.append(with_peak(derive_class("*", correct, bugs, safety), points, points))
    return [replace(c, mode=mode) for c in out]


def entries(ratios: Sequence[ClassRatio], table: str = SECTION) -> str:
    """The section's entries (the [[rule]] format of parity.numerics.tolerances), most specific first."""
    lines = []
    for c in ratios:
        mode = "" if c.mode == "layer" else f"[{c.mode}] "
        lines.append(f"# {mode}{c.cls}: worst correct ratio {_fmt(c.worst_correct)} ({c.n_correct} points) at "
                     f"{c.worst_correct_at or '-'}; best bug ratio {_fmt(c.best_bug)} ({c.n_bug} points) at "
                     f"{c.best_bug_at or '-'}; at a bug's own site {_fmt(c.best_pinned)} at {c.best_pinned_at or '-'}"
                     + ("; OVERLAP: not separable here" if c.overlap else ""))
        lines.append(f"#   dump peak (max |dump − shadow| / row RMS): worst {_fmt(c.worst_peak)} over {c.n_peak} points"
                     f"{'' if c.n_peak >= PEAK_MIN_POINTS or c.cls == '*' else ' (its phase: too few of its own)'}"
                     f" at {c.worst_peak_at or '-'}")
        peak = '"off"' if c.dump_peak is None else f"{c.dump_peak:.2g}"
        for glob in (["*"] if c.cls == "*" else class_glob(c.cls)):
            lines += [f"[[{table}]]", f'site = "{glob}"'] + ([] if c.mode == "layer" else [f'mode = "{c.mode}"']) + [
                      'compute = "bfloat16"', f"precision_ratio = {c.ratio:.4g}",
                      f"precision_dump_peak = {peak}",
                      f'note = "calibrated: {c.cls} (precision corpus)"', ""]
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def method_text(meta: dict, n: int, safety: float) -> str:
    return "\n".join([
        "# Three-way verdict of bf16 points (issue 31): `precision_ratio`, the allowed ratio of a failing point's",
        "# error against the fp32 shadow to the dump's own error against it (parity.replay.shadows, kind precision).",
        "# Reasoning and corpus: parity/calibration/precision.py. Corpus: " + meta.get("corpus", "?"),
        f"# {n} failing bf16 points. R = worst correct ratio × S = {safety:g}, rounded up to the next 1/8",
        "# (never below 1); where that reaches the best bug ratio of the class: their geometric mean.",
        f"# precision_dump_peak = worst dump peak (max |dump − shadow| / row RMS) over the class's points of every run ×"
        f" {PEAK_SAFETY:g},",
        f"# two significant digits (a class with < {PEAK_MIN_POINTS} points: the worst of its phase): the verdict applies"
        " only where the dump's own error looks like rounding.",
    ])


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.calibration.precision DUMP --target T [--ckpt DIR] [--layers 0,1]`: `measure`, one JSON
    line on stdout (what `measure_in_subprocess` reads)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m parity.calibration.precision")
    ap.add_argument("dump")
    ap.add_argument("--target", default="reference")
    ap.add_argument("--ckpt")
    ap.add_argument("--layers")
    ap.add_argument("--mode", default="layer", choices=("layer", "isolated"))
    a = ap.parse_args(argv)
    layers = None if not a.layers else [int(x) for x in a.layers.split(",")]
    print(json.dumps(measure(a.dump, a.ckpt, a.target, layers, a.mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CORRECT", "BUG", "ClassRatio", "SECTION", "corpus_targets", "derive", "derive_class", "entries",
           "fp32_intermediates_target", "measure", "measure_in_subprocess", "method_text", "ratio_class"]
