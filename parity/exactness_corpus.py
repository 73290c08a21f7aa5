"""Corpus of the isolated-mode exactness test (parity.numerics.exactness): correct replays of fresh random checkpoints,
counting per point the rows that are not bit-identical, then one `inexact_row_rate` per site class; for RMSNorm sites
also the row-scale noise their rounding check must allow (parity.numerics.rounding), one `norm_scale_noise` per site.

Corpus (tools/exactness.py): seeds alternate the presets as the no-false-alarm sweep does (odd: tiny, q-LoRA;
even: tiny-flash, clamp), each dumped by the twin in bf16 at every prompt length (≤ 64 tokens: the recurrent KDA
path, > 64: the chunked one) with decode steps, and replayed by the reference target in isolated mode. Only bf16
tensors of bf16 runs get a rate: fp32 tensors of those runs (KDA gate/beta/state, router logits) are compared on the
fp32 grid, where a correct implementation is rarely bit-identical at all.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

from parity.numerics import exactness, rounding
from parity.numerics.compare import compare
from parity.numerics.tolerances import ToleranceRule
from parity.points import site_class

MIN_POINTS = 20  # a class with fewer corpus points gets no rate (no criterion rather than a guessed one)
MAX_RATE = 0.5  # a class whose correct rows are inexact this often gains nothing from the test: left off
SCALE_MARGIN = 4.0  # norm_scale_noise = this × the largest a corpus point needed (two steps of the grid above it) ...
SCALE_FLOOR = 1.0  # ... and at least u·√n, an fp32 sum's typical relative error (a corpus that needed 0 proves little)
# RMSNorm sites whose input, under teacher forcing (layer/forced modes), is itself a dumped tensor: a layer's input
# norm (fed the dumped layer input), the model's final norm (fed the dumped last-layer output) and an MTP layer's
# enorm / hnorm (fed the dumped MTP embedding and the dumped final norm; facts §2)
TEACHER_FORCED_NORMS = ("input_layernorm", "final_norm", "enorm", "hnorm")
ROW_COUNT_RULE = ToleranceRule(floor_ulps=0, max_ulps=0, allowed_fraction=1.0, hard_ulps=None)  # only the row counts


def preset_of(seed: int) -> str:
    return "tiny" if seed % 2 else "tiny-flash"


def replay_rows(dump: Path, ckpt: Path, label: str) -> list[dict]:
    """One record per bf16 point of an isolated replay of `dump` by the reference target: label, site, class, rows,
    inexact rows."""
    import numpy as np

    from parity.replay.session import Session
    from parity.replay.strategies import observe

    out = []
    with Session.open(dump, ckpt, mode="isolated") as s:
        for layer in [None] + list(s.layers()):
            for ob in observe(s, layer):
                if ob.ref is None or ob.test is None or ob.skip or np.asarray(ob.ref).dtype.name != "bfloat16":
                    continue
                ref, test = np.asarray(ob.ref), np.asarray(ob.test)
                if ref.shape != test.shape or not ref.size:
                    continue
                v = compare(ref, test, ROW_COUNT_RULE)  # counts the rows as the exactness test will
                rec = {"point": f"{label}:{ob.point.key()}", "site": ob.point.site,
                       "class": site_class(ob.point.site), "rows": v.rows, "inexact": v.inexact_rows}
                if ob.rounding is not None:  # what the RMSNorm rounding check must allow for dump and target alike
                    c = rounding.needed_scale_noise(ob.rounding.x, ob.rounding.w, ob.rounding.eps, ref, test)
                    rec["scale_need"] = c if math.isfinite(c) else None
                out.append(rec)
    return out


def build_corpus(workdir: Path, seeds: Sequence[int], prompt_lens: Sequence[int], decode_steps: int,
                 log: Callable[[str], None] = print) -> list[dict]:
    from parity.config import Ling3Config
    from parity.torch_ref.ckpt import make_checkpoint
    from parity.torch_ref.dump import DumpOptions, dump_checkpoint
    from parity.torch_ref.prompts import builtin_ids

    records: list[dict] = []
    for seed in seeds:
        preset = preset_of(seed)
        ckpt = make_checkpoint(workdir / f"{preset}-s{seed}", preset, seed=seed, dtype="bfloat16", force=True)
        cfg = Ling3Config.from_pretrained_dir(ckpt, strict=False)
        for T in prompt_lens:
            dump = workdir / f"{preset}-s{seed}-T{T}-bf16.h5"
            if dump.exists():
                dump.unlink()
            dump_checkpoint(ckpt, dump, builtin_ids(cfg.vocab_size, T, seed),
                            DumpOptions(dtype="bfloat16", decode_steps=decode_steps, progress=False, seed=seed))
            recs = replay_rows(dump, ckpt, f"{preset}/s{seed}/T{T}")
            log(f"{preset} seed {seed} T={T}: {len(recs)} points, {sum(r['inexact'] for r in recs)} inexact rows of "
                f"{sum(r['rows'] for r in recs)}")
            records += recs
    return records


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
    """The generated file: one rule per site with its class's `inexact_row_rate` and, for RMSNorm sites, the
    `norm_scale_noise` of `derive_scale_noise`."""
    scale_noise = scale_noise or {}
    lines = [header.rstrip(), "", 'schema = "ling3-parity-tolerances"', "version = 1", ""]
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
            lines += ["[[rule]]", f'site = "{site}"', 'mode = "isolated"', 'dtype = "bfloat16"',
                      'compute = "bfloat16"', f"inexact_row_rate = {exactness.nice_rate(d.rate):.2g}"]
            lines += [f"norm_scale_noise = {c:g}"] if c is not None else []
            lines += [f'note = "exactness rate: {cls}, isolated"', ""]
    # one pooled value for every RMSNorm (derive_scale_noise): MTP's enorm / hnorm, which isolated replays (the
    # corpus) never run, take it too — the same formula
    values = {c for c, _ in scale_noise.values() if c is not None}
    if len(values) == 1:
        c = values.pop()
        lines += ["# Teacher forcing (layer, forced modes) feeds these norms their dumped inputs as isolated mode does, so",
                  "# their rounding check holds there with the same value (the replay supplies it only where the input",
                  "# is the dump's: never in free mode). MTP's enorm / hnorm have no corpus points (isolated replays do",
                  "# not run MTP layers): the value pooled over every RMSNorm of the corpus, the same formula."]
        for site in TEACHER_FORCED_NORMS:
            lines += ["[[rule]]", f'site = "{site}"', 'mode = "*"', 'dtype = "bfloat16"', 'compute = "bfloat16"',
                      f"norm_scale_noise = {c:g}", 'note = "rounding check: teacher-forced input"', ""]
    return "\n".join(lines) + "\n"


def save_corpus(records: list[dict], path: Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(records, f)


def load_corpus(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)
