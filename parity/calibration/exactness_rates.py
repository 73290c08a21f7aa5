"""Exactness rates of the isolated-mode exactness test (parity.numerics.exactness) from the exactness corpus
(parity.calibration.corpus `exactness_runs`: correct replays of fresh random checkpoints, counting per point the rows
that are not bit-identical): one `inexact_row_rate` per site class; for RMSNorm sites also the row-scale noise their
rounding check must allow (parity.numerics.rounding), one `norm_scale_noise` per site.

Corpus (`python tools/calibrate.py corpus`): seeds alternate the presets as the no-false-alarm sweep does (odd: tiny, q-LoRA;
even: tiny-flash, clamp), each dumped by the twin in bf16 at every prompt length (≤ 64 tokens: the recurrent KDA
path, > 64: the chunked one) with decode steps, and replayed by the reference target in isolated mode. Only bf16
tensors of bf16 runs get a rate: fp32 tensors of those runs (KDA gate/beta/state, router logits) are compared on the
fp32 grid, where a correct implementation is rarely bit-identical at all.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable

from parity.numerics import exactness

SECTION = "exactness_rates"  # its section of the calibration file
MIN_POINTS = 20  # a class with fewer corpus points gets no rate (no criterion rather than a guessed one)
MAX_RATE = 0.5  # a class whose correct rows are inexact this often gains nothing from the test: left off
SCALE_MARGIN = 4.0  # norm_scale_noise = this × the largest a corpus point needed (two steps of the grid above it) ...
SCALE_FLOOR = 1.0  # ... and at least u·√n, an fp32 sum's typical relative error (a corpus that needed 0 proves little)
# RMSNorm sites whose input, under teacher forcing (layer/forced modes), is itself a dumped tensor: a layer's input
# norm (fed the dumped layer input), the model's final norm (fed the dumped last-layer output) and an MTP layer's
# enorm / hnorm (fed the dumped MTP embedding and the dumped final norm; facts §2)
TEACHER_FORCED_NORMS = ("input_layernorm", "final_norm", "enorm", "hnorm")


def derive_rates(records: Iterable[dict]) -> dict[str, tuple[exactness.RateDerivation | None, list[str]]]:
    """class -> (derivation or None when the class gets no rate, its sites)."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r["class"]].append(r)
    out = {}
    for cls, recs in sorted(by.items()):
        sites = sorted({r["site"] for r in recs})
        d = exactness.derive_rate((r["point"], r["rows"], r["inexact"]) for r in recs)
        out[cls] = (d if len(recs) >= MIN_POINTS and d.rate < MAX_RATE else None, sites)
    return out


def derive_scale_noise(records: Iterable[dict]) -> dict[str, tuple[float | None, str]]:
    """site -> (norm_scale_noise or None, why) for the RMSNorm sites of the corpus (records with `scale_need`): one
    value for all of them, pooled — it bounds the fp32 noise of one formula (facts §6), the same at every RMSNorm, and
    the row length is in rho already (the model's final norm alone has too few corpus points to say much). None when
    fewer than MIN_POINTS points or a correct replay that no grid value explains (no check rather than a wrong one)."""
    recs = [r for r in records if "scale_need" in r]
    needs = [r["scale_need"] for r in recs]
    classes = ", ".join(f"{c} {sum(r['class'] == c for r in recs)}" for c in sorted({r["class"] for r in recs}))
    if len(recs) < MIN_POINTS or any(n is None for n in needs):
        value, why = None, f"RMSNorm sites ({classes}): {len(recs)} points, {sum(n is None for n in needs)} beyond the grid"
    else:
        worst = max(needs)
        value = max(SCALE_MARGIN * worst, SCALE_FLOOR)
        why = (f"RMSNorm sites ({classes}): {len(recs)} points, {sum(n > 0 for n in needs)} needed more than 0, the "
               f"worst {worst:g} (×{SCALE_MARGIN:g}, at least {SCALE_FLOOR:g})")
    return {site: (value, why) for site in sorted({r["site"] for r in recs})}


def rates_toml(rates: dict, header: str, scale_noise: dict | None = None) -> str:
    """The rates as a stand-alone tolerance file ([[rule]] entries after `header`)."""
    return "\n".join([header.rstrip(), "", 'schema = "ling3-parity-tolerances"', "version = 1", "",
                      rates_entries(rates, scale_noise)])


def rates_entries(rates: dict, scale_noise: dict | None = None, table: str = "rule",
                  teacher_forced: bool = True) -> str:
    """`[[table]]` entries: one per site with its class's `inexact_row_rate` and, for RMSNorm sites, the
    `norm_scale_noise` of `derive_scale_noise`."""
    scale_noise = scale_noise or {}
    lines = []
    for cls, (d, sites) in rates.items():
        if d is None:
            lines.append(f"# {cls}: no rate (fewer than {MIN_POINTS} corpus points, or correct rows inexact at a "
                         f"rate ≥ {MAX_RATE}): {', '.join(sites)}")
            lines.append("")
            continue
        why = (f"pooled {d.inexact}/{d.rows} rows over {d.points} points, {exactness.CONFIDENCE:g} upper bound "
               f"{d.pooled_bound:.3g}")
        if d.worst_point:
            why += f"; raised so that {d.worst_point} ({d.worst_r} of {d.worst_rows} rows) has tail ≥ " \
                   f"{exactness.CORPUS_TAIL:g}"
        lines.append(f"# {cls}: {why}")
        for site in sites:
            c, why_c = scale_noise.get(site, (None, ""))
            lines += [f"# {site}: norm_scale_noise from {why_c}"] if c is not None else []
            lines += [f"[[{table}]]", f'site = "{site}"', 'mode = "isolated"', 'dtype = "bfloat16"',
                      'compute = "bfloat16"', f"inexact_row_rate = {exactness.nice_rate(d.rate):.2g}"]
            lines += [f"norm_scale_noise = {c:g}"] if c is not None else []
            lines += [f'note = "exactness rate: {cls}, isolated"', ""]
    # one pooled value for every RMSNorm (derive_scale_noise): MTP's enorm / hnorm, which isolated replays (the
    # corpus) never run, take it too — the same formula
    values = {c for c, _ in scale_noise.values() if c is not None}
    if len(values) == 1 and teacher_forced:
        c = values.pop()
        lines += ["# Teacher forcing (layer, forced modes) feeds these norms their dumped inputs as isolated mode does, so",
                  "# their rounding check holds there with the same value (the replay supplies it only where the input",
                  "# is the dump's: never in free mode). MTP's enorm / hnorm have no corpus points (isolated replays do",
                  "# not run MTP layers): the value pooled over every RMSNorm of the corpus, the same formula."]
        for site in TEACHER_FORCED_NORMS:
            lines += [f"[[{table}]]", f'site = "{site}"', 'mode = "*"', 'dtype = "bfloat16"', 'compute = "bfloat16"',
                      f"norm_scale_noise = {c:g}", 'note = "rounding check: teacher-forced input"', ""]
    return "\n".join(lines) + "\n"


def save_corpus(records: list[dict], path: Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(records, f)


def load_corpus(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)
