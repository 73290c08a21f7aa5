"""Routing analysis (DESIGN §6): top-k expert *sets* compared per token; a mismatch is **benign** when the reference's
own margin between the competing experts' biased scores is within what the observed router-score noise explains
(and the router logits themselves pass), otherwise a failure."""

from __future__ import annotations

import numpy as np

from parity.model.points import Point
from parity.replay.records import PointRecord, Status

# The sites a layer's routing feeds: where the top-k differs only benignly they are judged on the run forced to the
# reference's experts (judge_step), and free mode lets that run's output flow on (strategies.observe_free). An MTP
# layer's block output and its norm (`final_layernorm:in`, `final_layernorm`) follow its routing too.
ROUTER_DOWNSTREAM = ("mlp.gate.topk_weight", "mlp.routed", "mlp", "output", "final_layernorm:in", "final_layernorm")


def routing_record(dump, point: Point, test_idx: np.ndarray, test_logits: np.ndarray | None,
                   expert_bias: np.ndarray, cfg, logits_ok: bool = True) -> tuple[PointRecord, np.ndarray | None]:
    """Compare top-k expert sets per token of `point` (an `mlp.gate.topk_idx` the dump holds). Returns the record
    and a [B,T] bool mask of benign-flipped tokens (None when nothing was compared).

    `logits_ok`: whether the router logits themselves passed their comparison. A flip is only benign when they did:
    logits that are plainly wrong would otherwise "explain" any swap as noise."""
    ref_idx = dump.read(point).astype(np.int64)
    test_idx = np.asarray(test_idx)
    if test_idx.shape != ref_idx.shape:
        return shape_mismatch(point, ref_idx.shape, test_idx.shape), None
    test_idx = np.sort(test_idx.astype(np.int64), axis=-1)
    ref_sorted = np.sort(ref_idx, axis=-1)
    same = (ref_sorted == test_idx).all(-1)
    n_tok = same.size
    flips = np.argwhere(~same)
    benign = np.zeros(same.shape, bool)
    worst = None
    lp = Point(point.phase, point.step, point.layer, point.site.replace("mlp.gate.topk_idx", "mlp.gate.logits"))
    ref_logits = dump.read(lp).astype(np.float64) if dump.has(lp) else None
    if ref_logits is not None and test_logits is not None and np.shape(test_logits) != ref_logits.shape:
        test_logits = None  # the logits record reports the shape mismatch; no noise estimate from them
    for b, t in flips:
        ra, ta = set(ref_sorted[b, t].tolist()), set(test_idx[b, t].tolist())
        lost, gained = sorted(ra - ta), sorted(ta - ra)
        if ref_logits is None or test_logits is None:
            margin, noise = float("inf"), 0.0
        else:
            s_ref = 1 / (1 + np.exp(-ref_logits[b, t])) + expert_bias
            s_tst = 1 / (1 + np.exp(-np.asarray(test_logits, np.float64)[b, t])) + expert_bias
            # The reference's own margin between what it kept and what the target took instead, against the noise
            # the target's router scores show on exactly those experts (facts §5.2-3: selection uses biased scores).
            margin = float(min(s_ref[lost]) - max(s_ref[gained]))
            noise = float(np.abs(s_tst - s_ref)[lost + gained].max())
            # A negative margin (the target took an expert the reference scored *higher*) is no near-tie of the
            # experts: only the group limit (facts §5.3) explains it, so then (and whenever the target took experts
            # from a group the reference dropped) the group decision's own margin is what must be a near-tie
            # (group score = sum of two biased scores; noise taken over every expert).
            gm = _group_margin(s_ref, lost, gained, cfg)
            gnoise = float(np.abs(s_tst - s_ref).max())
            if margin < 0 or gm - 2 * gnoise < margin - 2 * noise:
                margin, noise = gm, gnoise
        ok = logits_ok and margin <= 2 * noise + 1e-12
        benign[b, t] = ok
        if worst is None or margin - 2 * noise > worst[0]:
            worst = (margin - 2 * noise, int(b), int(t), lost, gained, margin, noise)
    n_flip = int((~same).sum())
    n_benign = int(benign.sum())
    stats = {"tokens": int(n_tok), "flipped": n_flip, "benign_flips": n_benign, "max_ulp": None}
    if n_flip == 0:
        return PointRecord(point, Status.PASS, stats=stats), benign
    if n_benign == n_flip:
        return PointRecord(point, Status.BENIGN, stats=stats, reason=(
            f"{n_flip}/{n_tok} token(s) routed differently, all within the reference's own router margin")), benign
    _, b, t, lost, gained, margin, noise = worst
    why = "" if logits_ok else " (the router logits themselves fail, so no flip counts as a near-tie)"
    message = (f"{point.key()}: {n_flip - n_benign}/{n_tok} token(s) routed to other experts beyond the "
               f"reference's margin{why} (benign near-ties: {n_benign}); worst at (batch {b}, token {t}): "
               f"reference experts {lost} replaced by {gained}, reference margin {margin:.3e} vs "
               f"router-score noise {noise:.3e}")
    return PointRecord(point, Status.FAIL, stats={**stats, "worst_index": [b, t]}, message=message), benign


def shape_mismatch(point: Point, ref_shape, test_shape) -> PointRecord:
    """A target array of another shape than the dump's is a failure naming both shapes (never reshaped to fit)."""
    why = f"shape mismatch: dump {tuple(ref_shape)}, target {tuple(test_shape)}"
    return PointRecord(point, Status.FAIL, reason=why, message=f"{point.key()}: {why}")


def _group_margin(scores: np.ndarray, lost: list, gained: list, cfg) -> float:
    """Half the reference's group-score margin between its weakest kept group and the strongest dropped group the
    target took experts from (so the caller's `margin <= 2*noise` means `group margin <= 4*noise`); +inf when no
    group limit applies (then a negative expert margin is a plain selection error)."""
    G, k = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if G <= 1 or k >= G:
        return float("inf")
    E = scores.shape[-1]
    per = E // G
    gs = np.sort(scores.reshape(G, per), axis=-1)[:, -2:].sum(-1)
    kept = np.argsort(-gs, kind="stable")[:k]
    dropped_taken = sorted({e // per for e in gained} - set(kept.tolist()))
    if not dropped_taken:
        return float("inf")
    return float(gs[kept].min() - gs[dropped_taken].max()) / 2
