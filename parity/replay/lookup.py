"""How a point is looked up in the tolerance rules and how a gradient is compared: pure functions the judge
(parity.replay.judge) and the shadows (parity.replay.shadows) both use — a module of its own so that the shadows need
not import the judge (which imports the shadows)."""

from __future__ import annotations

import numpy as np

from parity.model.points import Point, mtp_site


def _base(site: str) -> str:
    """The site within its layer, also what the tolerance rules are looked up by: an MTP layer's block sites are the same computations as a
    main layer's (its `attention.*`, `mlp.*`, norms); its own sites (enorm, hnorm, eh_proj, final_layernorm) have no
    entry of their own and take the tier's catch-all (the loosest calibrated class)."""
    m = mtp_site(site)
    return site if m is None else m[1]


def compare_gradient(ref: np.ndarray, test: np.ndarray, rule, name: str = ""):
    """`compare` for a backward point (issue 26): the whole tensor is one row, so the absolute floor is in ULPs of
    the *tensor's* RMS, not of each row's. Why: a gradient is a sum over tokens (weights) or over downstream paths
    (cotangents) of terms of both signs; its rounding error scales with the terms, i.e. with the tensor, and a row
    whose exact value cancels to ~0 (a saturated KDA gate's sigmoid, a token routed nowhere near an expert) carries
    the tensor's absolute error, not its own (measured: fp32 f_proj cotangent rows at 1.5e8 ULPs of their own RMS
    with rel-L2 ~1e-5; the gradient corpus, parity.calibration.gradients). Indices in the verdict are the tensor's
    own."""
    import dataclasses

    from parity.numerics.compare import compare

    v = compare(ref.reshape(1, -1), test.reshape(1, -1), rule, name=name)
    shape = ref.shape

    def unravel(ix):
        return None if ix is None else tuple(int(x) for x in np.unravel_index(int(ix[-1]), shape)) if shape else ()

    fixed = {f.name: unravel(getattr(v, f.name)) for f in dataclasses.fields(v) if f.name.endswith("_index")}
    return dataclasses.replace(v, shape=tuple(shape), **fixed)


def rule_site(point: Point) -> str:
    """The site name the tolerance rules are looked up by: `_base(site)`, and for the backward phase
    `backward/<site>` (gradients have their own rules, the `gradient_tolerances` section of calibration.toml,
    parity.calibration.gradients: gradient noise is not activation noise)."""
    base = _base(point.site)
    return f"backward/{base}" if point.phase == "backward" else base
