"""Rounding check of RMSNorm sites on bf16 runs (issue 15): which bf16 values a correct implementation can output.

Why. Fed its own dumped input, a correct bf16 RMSNorm differs from the dump only where its fp32 row scale
r = rsqrt(mean(x²) + eps) differs from the reference's by fp32 rounding (another summation order, another rsqrt) and an
element lies that close to a bf16 rounding boundary. A bug that moves r by far less than a bf16 ULP — an epsilon
1e-6 → 1e-5 moves r by ~1e-5 relative, 1/400 of a bf16 ULP — flips only a few elements per tensor, as rarely as a
correct implementation's rounding noise does (the row-count exactness test, parity.numerics.exactness, cannot tell the
two apart on a small tensor). But the two flip *different* elements: fp32 noise can only flip an element whose exact
value lies within ~1e-7 relative of a boundary, the bug any element within ~1e-5. So: recompute the exact row scale
in float64 from the dumped input, and ask for every element which bf16 values the Llama-convention formula (facts §6:
`y = bf16(w · bf16(x_f32 · r))`) can give when r is anywhere within a relative `rho` of exact. An output outside that
bracket cannot come from fp32 rounding of the right formula.

The map r ↦ y is monotone per element (each step — an fp32 product, a round to bf16, a product with the fixed weight, a
round — is monotone), so the values reachable over [r·(1-rho), r·(1+rho)] lie between the outputs at its two ends:
two evaluations give the bracket. The check is only sound where the dump itself lies inside the bracket (the same
formula, weight and eps made the dump): the judge verifies that first and does not apply the check otherwise.

`rho` is `scale_noise · u · √n` (u = 2^-24, n the row length: fp32 summation error grows about as √n), with
`scale_noise` calibrated per site class from correct replays (tools/calibrate.py; `needed_scale_noise`).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

U32 = 2.0 ** -24  # unit roundoff of fp32
BF16 = ml_dtypes.bfloat16


def rho_for(scale_noise: float, n: int) -> float:
    """Relative tolerance of the row scale for a row of n elements."""
    return scale_noise * U32 * math.sqrt(max(n, 1))


def rms_norm_bracket(x: np.ndarray, w: np.ndarray, eps: float, rho: float) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), float32 arrays of x's shape: the bf16 outputs of `bf16(w · bf16(x_f32 · r'))` over every row scale r'
    within relative `rho` of the exact rsqrt(mean(x²) + eps) (float64 from the bf16 input x). w: the norm weight [n]
    (the model holds it in bf16; bf16 × bf16 is exact in fp32, then one rounding)."""
    from parity.numerics.variants import _hf, bracket

    return bracket(_hf, x, w, eps, rho)


def outside(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Boolean mask of the elements of `values` (any float dtype) outside [lo, hi]; non-finite elements are never
    'outside' (NaN/Inf are the compare's business)."""
    v = np.asarray(values).astype(np.float32)
    fin = np.isfinite(v) & np.isfinite(lo) & np.isfinite(hi)
    return fin & ((v < lo) | (v > hi))


SCALE_NOISE_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


def needed_scale_noise(x: np.ndarray, w: np.ndarray, eps: float, *outputs: np.ndarray) -> float:
    """The smallest `scale_noise` of SCALE_NOISE_GRID under which every element of every output lies in its bracket
    (inf if none does): what a correct implementation needs, recorded per corpus point by tools/calibrate.py."""
    n = np.asarray(x).shape[-1]
    for c in SCALE_NOISE_GRID:
        lo, hi = rms_norm_bracket(x, w, eps, rho_for(c, n))
        if not any(outside(o, lo, hi).any() for o in outputs):
            return c
    return math.inf


class RmsNormCheck:
    """What the rounding check of one RMSNorm point needs: its bf16 input rows, the norm weight, eps. The replay
    strategy that fed the site builds it (it knows the dumped inputs and the layer's weights); the judge applies it
    with the tolerance rule's `norm_scale_noise` (`check`)."""

    def __init__(self, x: np.ndarray, w: np.ndarray, eps: float, x_unrounded: np.ndarray | None = None):
        """x_unrounded: the norm's input before HF rounds it to bf16, where HF computes it in the same module and a
        port may keep it in fp32 (the post-attention norm's residual sum input + attention, facts §8); None where
        the norm is fed a tensor the dump holds as such (its rounding is the dump's, not the port's to skip)."""
        self.x, self.w, self.eps = np.asarray(x), np.asarray(w), float(eps)
        self.x_unrounded = None if x_unrounded is None else np.asarray(x_unrounded, np.float32)

    def rho(self, scale_noise: float) -> float:
        return rho_for(scale_noise, self.x.shape[-1])

    def variant(self, test: np.ndarray, scale_noise: float):
        """The named RMSNorm variant (parity.numerics.variants) whose bracket holds every element of `test` under the
        same row-scale tolerance, else None."""
        from parity.numerics.variants import matching_variant

        return matching_variant(self.x, self.w, self.eps, self.rho(scale_noise), test)

    def fewer_roundings(self, test: np.ndarray, scale_noise: float) -> str | None:
        """The formula with fewer bf16 roundings than HF's that gives *every* element of `test` (same row-scale
        tolerance as the check), else None — the rounding check's side of the three-way verdict
        (parity.replay.shadows, guard `precision.rounding_formula`). The family: HF's formula and the single-rounding
        one (parity.numerics.variants), each on the bf16 input the dump holds and, where HF rounds the input inside
        the module (`x_unrounded`), on the unrounded input — the round trips XLA's default excess precision elides.
        One formula must hold for the whole point: an epsilon or a bf16 statistic leaves every bracket, and mixing
        formulas per element would let a flipped element borrow a neighbouring formula's bracket."""
        from parity.numerics.variants import HF_RMSNORM, RMSNORM_VARIANTS, _hf, bracket, variant_bracket, within

        rho = self.rho(scale_noise)
        inputs = [("bf16 input", self.x)] + ([] if self.x_unrounded is None else [("unrounded input",
                                                                                   self.x_unrounded)])
        for label, x in inputs:
            if label != "bf16 input" and within(test, *bracket(_hf, x, self.w, self.eps, rho)):
                return f"{HF_RMSNORM} on the {label}"
            for v in RMSNORM_VARIANTS:
                if within(test, *variant_bracket(v, x, self.w, self.eps, rho)):
                    return f"{v.formula} on the {label}"
        return None

    def check(self, ref: np.ndarray, test: np.ndarray, scale_noise: float) -> dict:
        """The report entry: `applied` False (with `why`) where the dump itself lies outside the bracket — the check
        would not be sound — else `outside` (how many target elements no row scale within rho gives) and, if any,
        the first such element (index, target, dump, reachable bracket)."""
        rho = self.rho(scale_noise)
        lo, hi = rms_norm_bracket(self.x, self.w, self.eps, rho)
        out = {"scale_noise": scale_noise, "rho": rho, "eps": self.eps}
        if np.shape(ref) != lo.shape or np.shape(test) != lo.shape:
            return {**out, "applied": False, "why": f"input rows {self.x.shape} do not match the output {np.shape(ref)}"}
        ref_out = outside(ref, lo, hi)
        if ref_out.any():
            return {**out, "applied": False,
                    "why": f"the dump itself lies outside the bracket at {int(ref_out.sum())} of {ref_out.size} "
                           "elements (not made by this formula, weight and eps)"}
        bad = outside(test, lo, hi)
        out.update(applied=True, outside=int(bad.sum()), elements=int(bad.size))
        if bad.any():
            i = tuple(int(k) for k in np.argwhere(bad)[0])
            out.update(index=list(i), test=float(np.asarray(test).astype(np.float32)[i]),
                       ref=float(np.asarray(ref).astype(np.float32)[i]), reachable=[float(lo[i]), float(hi[i])])
        return out


def message(name: str, entry: dict) -> str:
    """One failure line for a rounding-check entry with outside > 0."""
    lo, hi = entry["reachable"]
    where = ", ".join(map(str, entry["index"]))
    return (f"{name}: {entry['outside']} of {entry['elements']} elements are outside what fp32 rounding of the RMSNorm "
            f"formula gives (facts §6: bf16(w·bf16(x·r)), eps {entry['eps']:g}, row scale r within "
            f"{entry['rho']:.2g} relative of exact); first at index ({where}): target {entry['test']:.6g}, dump "
            f"{entry['ref']:.6g}, reachable [{lo:.6g}, {hi:.6g}]. Hint: an epsilon, a norm weight multiplied in "
            "another precision or statistics not in fp32 move elements off the reference's rounding")
