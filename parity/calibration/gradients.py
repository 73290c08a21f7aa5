"""The gradient rules (issue 26): the backward phase's tolerance rules from the gradient corpus — pure functions of the
stored gradient measurements (parity.calibration.corpus `grad_runs` / `measure_grad_replay`, statistic
parity.calibration.noise `grad_noise`), written as the `gradient_tolerances` section of the calibration file, first
in lookup order. Backward points are looked up by site `backward/<site>` (parity.replay.judge.rule_site), so these
entries match only gradients, and they set every rule field so no activation rule leaks into a gradient's.

Why gradients get rules of their own: gradient noise is not activation noise. A gradient is a sum over tokens
(weights) or over downstream paths (cotangents) of terms of both signs; torch's autograd and the JAX VJP round the
backward's intermediates at different points, so two correct implementations differ by far more than their forward
activations do (bf16: elements up to ~30000 raw ULP apart where a value cancels to ~0). The backward judge compares a
gradient as one row (parity.replay.judge.compare_gradient): the floor is in ULPs of the *tensor's* RMS.

Classes (site globs of the lookup, most specific first):
  grad_expert      `backward/grad.mlp.experts.*`: one routed expert's weight gradient sums the few tokens routed to
                   it — rank-few, heavy-tailed tensors, noisier than the other weights (measured: its own class);
  grad_weight      `backward/grad.*`: every other weight gradient (layer parameters, embedding, final norm, LM head);
  grad_activation  `backward/*`: the cotangents (dL/d a site's output, dL/d logits, ...).
Derivation, per class × compute dtype (the activation rules' convention, parity.calibration.rules: worst over the
corpus × safety factor S = 2, rounded up to 1, 1.5, 2, 3, 4, 6, 8, ...):
  fp32 runs   : the fp32 tier — |Δ| ≤ rtol·|ref| per element, rtol = 1e-5 (DESIGN §5), except elements within
                floor_ulps fp32 ULPs of the tensor's RMS; floor_ulps = nice(S · worst floor needed), at least
                FP32_MIN_FLOOR. Every element must pass, so the floor covers the worst corpus element needing it.
  bf16 runs   : every gradient compared on the bf16 grid (compare_dtype bfloat16: the backward's fp32 tensors carry
                bf16 noise from the bf16 activations they are computed from); floor_ulps = nice(S · worst p99.9 of
                |Δ|/ulp(tensor RMS)); max_ulps = 2; allowed_fraction = max(0.001, S · worst fraction of elements above
                2 raw ULP outside the floor, rounded up to the ladder in thousandths); hard_ulps off (the worst single
                element of a finite corpus grows with the corpus, as for the propagating activation modes);
                max_rel_l2 = ladder(S · worst rel-L2) — the per-tensor criterion (issue 33), below.
No bound_rms / exactness rate / rounding check for gradients (not measured for them: off).

The per-tensor criterion `max_rel_l2` (bf16 runs only). Two correct bf16 implementations' gradients differ by up to
~1× the tensor's RMS in a few elements (each rounds the backward's intermediates at other points), so the element
rule's floor must be ~1.5× RMS (192 bf16 ULPs of it): a bug that zeroes a small gradient (`A_log`: 4 elements, the
largest 1.44× RMS) passes it. The whole tensor's rel-L2 averages those few elements with the rest: a correct pair's is
≤ 0.14 in every class (experts) and ≤ 0.032 elsewhere, a detached (zeroed), doubled or negated gradient's is 1–2.
So bf16 gradients get both: the element rule (unchanged) and rel-L2 ≤ max_rel_l2, with the same headroom S = 2 over
the corpus worst and the same ladder (powers of two × 1, 1.5). fp32 runs keep the element tier alone: its rtol 1e-5
per element already bounds the error to fp32 rounding (the backward mutants fail it by ×700 or more), and the fp32
rel-L2 of a tensor of a few elements (A_log) is one element's rounding, which eight dumps cannot bound safely.
Every corpus point passes the rules derived from it (`check_points`; a failure is a CalibrationError).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

from parity.calibration.noise import RTOL_FP32
from parity.calibration.rules import nice

SECTION = "gradient_tolerances"  # its section of the calibration file (first in lookup order)
SAFETY = 2.0
BF16_MAX_ULPS = 2
BF16_MIN_FRACTION = 0.001
FP32_MIN_FLOOR = 16  # = the activation rules' fp32 minimum (parity.calibration.rules MINIMUMS)
# class -> site glob, most specific first (lookup: first match wins, per field)
CLASSES = (("grad_expert", "backward/grad.mlp.experts.*"), ("grad_weight", "backward/grad.*"),
           ("grad_activation", "backward/*"))
COMPUTES = ("float32", "bfloat16")


def grad_class(site: str) -> str:
    """The class of a backward point's site (without the `backward/` prefix)."""
    if site.startswith("grad.mlp.experts."):
        return "grad_expert"
    return "grad_weight" if site.startswith("grad.") else "grad_activation"


def pid(p: dict) -> str:
    """A gradient point's id in the corpus: `<corpus>:backward/<L03|model>/<site>`."""
    lay = "model" if p.get("layer") is None else f"L{p['layer']:02d}"
    return f"{p['corpus']}:backward/{lay}/{p['site']}"


def count_over(p: dict, floor: float, max_ulps: int) -> int:
    """Elements of point `p` outside `floor` (need > floor, as compare's `within` is |Δ| ≤ floor·ulp) whose raw ULP
    distance is above `max_ulps`. Exact for floor ≥ the point's p99.9 need: the stored tail holds every element above
    it (parity.calibration.noise.grad_noise)."""
    if floor < p["floor_needed_p999"]:
        raise ValueError(f"count_over: floor {floor} below the p99.9 need {p['floor_needed_p999']} of {pid(p)}: the "
                         "stored tail does not cover it")
    return sum(1 for need, raw in p["tail"] if need > floor and raw > max_ulps)


def allowed_count(fraction: float, n: int) -> int:
    """floor(fraction · n), exactly as parity.numerics.compare.allowed_over_count."""
    return int(math.floor(Fraction(repr(float(fraction))) * n))


@dataclass(frozen=True)
class GradRule:
    cls: str
    site: str  # the lookup glob
    compute: str
    fields: dict
    n_points: int
    basis: str  # the measured numbers the fields came from


def ladder(x: float) -> float:
    """Round x > 0 up to the rules' ladder 1, 1.5, 2, 3, 4, 6, ... × powers of two, below 1 too (`nice` stops at 1):
    0.0627 → 0.09375 (1.5 · 2^-4), 0.0576 → 0.0625 (2^-4). 0 stays 0."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return float(nice(x))
    k = math.floor(-math.log2(x)) + 1  # x · 2^k in (1, 2]: `nice` maps it to 1.5 or 2 (exact in binary)
    return float(nice(x * 2 ** k)) / 2 ** k


def _worst(points: Sequence[dict], value) -> tuple[float, str]:
    best = max(points, key=value)
    return value(best), pid(best)


def derive_rule(cls: str, compute: str, points: Sequence[dict], safety: float = SAFETY) -> GradRule:
    """The rule of one class × compute dtype from its corpus points (module docstring)."""
    site = dict(CLASSES)[cls]
    if compute == "float32":
        need, at = _worst(points, lambda p: p["rtol_floor_needed"])
        F = max(FP32_MIN_FLOOR, nice(safety * need))
        fields = {"floor_ulps": F, "max_ulps": "off", "allowed_fraction": 0.0, "hard_ulps": "off", "rtol": RTOL_FP32,
                  "atol": "off", "compare_dtype": "off", "max_rel_l2": "off"}
        rl, rl_at = _worst(points, lambda p: p["rel_l2"])
        basis = (f"floor needed with rtol {RTOL_FP32:g}: worst {need:.4g} fp32-ULP of tensor RMS at {at}; worst "
                 f"rel-L2 {rl:.3g} at {rl_at}")
    else:
        need, at = _worst(points, lambda p: p["floor_needed_p999"])
        F = max(1, nice(safety * need))
        over, over_at = _worst(points, lambda p: count_over(p, F, BF16_MAX_ULPS) / p["n"])
        allowed = min(1.0, max(BF16_MIN_FRACTION, float(nice(1000 * safety * over)) / 1000))
        mx, mx_at = _worst(points, lambda p: p["floor_needed"])
        rl, rl_at = _worst(points, lambda p: p["rel_l2"])
        fields = {"floor_ulps": F, "max_ulps": BF16_MAX_ULPS, "allowed_fraction": allowed, "hard_ulps": "off",
                  "rtol": "off", "atol": "off", "compare_dtype": "bfloat16", "max_rel_l2": ladder(safety * rl)}
        basis = (f"bf16 grid; worst p99.9 of |Δ|/ulp(tensor RMS) {need:.4g} at {at} (max {mx:.4g} at {mx_at}); at "
                 f"floor {F:g}: worst fraction above {BF16_MAX_ULPS} ULP {over:.3g}" + (f" at {over_at}" if over else "")
                 + f"; worst rel-L2 {rl:.4g} at {rl_at}")
    fields.update({"bound_rms": "off", "inexact_row_rate": "off", "norm_scale_noise": "off"})
    return GradRule(cls, site, compute, fields, len(points), basis)


def derive_grad_rules(points: Iterable[dict], safety: float = SAFETY) -> list[GradRule]:
    """One rule per class × compute dtype the corpus measured, in lookup order (fp32 first, most specific class
    first). Raises ValueError on a corpus point with a NaN/Inf mismatch (correct implementations never give one)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in points:
        if p["nonfinite_mismatches"]:
            raise ValueError(f"gradient corpus point {pid(p)}: {p['nonfinite_mismatches']} NaN/Inf mismatch(es)")
        groups.setdefault((grad_class(p["site"]), p["compute"]), []).append(p)
    return [derive_rule(cls, compute, groups[cls, compute], safety)
            for compute in COMPUTES for cls, _ in CLASSES if (cls, compute) in groups]


def check_points(points: Iterable[dict], rules: Sequence[GradRule]) -> list[str]:
    """Every corpus point against the rule of its class and compute dtype: the ids of points that would fail (the
    derivation guarantees none; kept as a check of the stored tail statistics and of this module)."""
    by = {(r.cls, r.compute): r.fields for r in rules}
    bad = []
    for p in points:
        f = by[grad_class(p["site"]), p["compute"]]
        if f["rtol"] != "off":
            fails = p["rtol_floor_needed"] > f["floor_ulps"]
        else:
            fails = count_over(p, f["floor_ulps"], f["max_ulps"]) > allowed_count(f["allowed_fraction"], p["n"])
        if f.get("max_rel_l2", "off") != "off" and p["rel_l2"] > f["max_rel_l2"]:
            fails = True
        if fails:
            bad.append(pid(p))
    return bad


def _toml_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float) and v.is_integer() and v != 0:
        return str(int(v))
    return repr(v)


def grad_entries(rules: Sequence[GradRule], table: str = SECTION) -> str:
    """The rules as `[[table]]` entries (format: parity.numerics.tolerances), each with every rule field set."""
    lines = []
    for r in rules:
        lines += [f"# {r.cls} · compute {r.compute} · {r.n_points} points: {r.basis}", f"[[{table}]]",
                  f'site = "{r.site}"', f'compute = "{r.compute}"']
        lines += [f"{k} = {_toml_value(v)}" for k, v in r.fields.items()]
        lines += [f'note = "calibrated: {r.cls}, {"fp32" if r.compute == "float32" else "bf16"} runs (gradient corpus)"',
                  ""]
    return "\n".join(lines)


def grad_method(meta: dict, n_points: int, safety: float) -> str:
    """How the gradient rules were derived (comment lines of their section of the calibration file)."""
    walks = []
    for c in [meta["corpus"]] + [m["corpus"] for m in meta.get("merged", [])]:
        who = " and ".join({"twin": "the twin", "official": "the official file"}[r] for r in c.get("runtimes", ["twin"]))
        kern = "fla's real kernels (Triton)" if c.get("kernels") == "fla" else "the CPU stand-ins"
        walks.append(f"presets {', '.join(c['presets'])} × seeds {', '.join(map(str, c['seeds']))} × prompts "
                     f"{', '.join(map(str, c['prompt_lens']))} × {', '.join(c['dtypes'])}, dumped by {who} on {kern}")
    return "\n".join("# " + s if s else "#" for s in [
        "Gradient rules of the backward phase (issue 26), looked up by site `backward/<site>` and complete (every field",
        "set: no activation rule leaks into a gradient's). A gradient is compared as one row: floors are in ULPs of the",
        "tensor's RMS (parity.replay.judge.compare_gradient). Reasoning: parity/calibration/gradients.py.",
        f"Corpus ({len(walks)} walk(s); prompts ≤ 64 tokens: recurrent KDA, > 64: chunked):",
        *[f"- {w}" for w in walks],
        "fresh checkpoints dumped with --grads, replayed in `layer` mode by the JAX",
        "reference (its VJP teacher-forced on each layer's dumped input and output cotangent, routing forced to the",
        f"dumped top-k): {n_points} gradient points. Classes: grad_expert (`backward/grad.mlp.experts.*`), grad_weight",
        "(`backward/grad.*`), grad_activation (`backward/*`, the cotangents).",
        f"Rule = worst over the corpus × S = {safety:g}, rounded up to 1, 1.5, 2, 3, 4, 6, 8, ...:",
        f"- fp32 runs: |Δ| ≤ rtol·|ref| per element, rtol = {RTOL_FP32:g}, except elements within floor_ulps fp32 ULPs of the",
        f"  tensor RMS; floor_ulps = S·worst floor needed (minimum {FP32_MIN_FLOOR}).",
        f"- bf16 runs (every gradient on the bf16 grid): floor_ulps = S·worst p99.9 of |Δ|/ulp(tensor RMS); max_ulps = "
        f"{BF16_MAX_ULPS},",
        f"  allowed_fraction = max({BF16_MIN_FRACTION}, S·worst fraction above {BF16_MAX_ULPS} ULP outside the floor); "
        "hard_ulps off;",
        "  and the per-tensor criterion (issue 33) max_rel_l2 = S·worst rel-L2 of the whole tensor, rounded up the same",
        "  ladder continued below 1 (× powers of two): a zeroed or doubled gradient has rel-L2 1, which the element",
        "  rule's ~1.5×RMS floor lets through for a tensor of a few elements. fp32 runs: max_rel_l2 off (the rtol tier).",
    ])


__all__ = ["CLASSES", "GradRule", "SECTION", "check_points", "count_over", "derive_grad_rules", "derive_rule",
           "grad_class", "grad_entries", "grad_method", "ladder"]
