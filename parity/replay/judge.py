"""The judge: observations in, typed `PointRecord`s out — numerics (`parity.numerics.compare`), the tolerance rules
of the session's mode, and the routing analysis (`routing`) for the top-k expert ids of MoE layers."""

from __future__ import annotations

from itertools import groupby
from typing import Iterable, Iterator

import numpy as np

from parity.model.points import Point, mtp_site
from parity.replay.lookup import _base, compare_gradient, rule_site  # noqa: F401  (re-exported)
from parity.replay.records import Observation, PointRecord, Status, skipped
from parity.replay.routing import ROUTER_DOWNSTREAM, routing_record, shape_mismatch
from parity.replay.shadows import explain, rmsnorm_variant_record


def unavailable_reason(dump, point: Point) -> str | None:
    """The reason the dump declares `point` unavailable (by layer/site, full key or site pattern), else None."""
    un = dump.unavailable()
    lay = "model" if point.layer is None else f"L{point.layer:02d}"
    keys = [f"{lay}/{point.site}", point.key(), point.site]
    if (m := mtp_site(point.site)) is not None:  # MTP layers: "MTP0/<site>" or the whole layer "MTP0/*"
        keys.append(f"MTP{m[0]}/*")
    for key in keys:
        if key in un:
            return un[key]
    return None


def judge_point(session, obs: Observation) -> PointRecord:
    """One observation judged on its own: skipped / missing / shape failure / the tolerance rule's verdict."""
    return _with(_judge(session, obs), obs)


def _judge(session, obs: Observation) -> PointRecord:
    from parity.numerics.compare import compare

    point, dump = obs.point, session.dump
    if obs.skip is not None:
        return skipped(point, obs.skip)
    if obs.ref is None:
        reason = unavailable_reason(dump, point)
        if reason:
            return skipped(point, reason)
        why = "the target produces this point but the dump lacks it" if obs.test is not None else \
            "the dump lacks this point"
        return PointRecord(point, Status.MISSING, reason=why)
    if obs.transform is not None and getattr(obs.transform, "structural", None):  # issue 32: no exact mapping
        why = f"structural difference: {obs.transform.structural} (no exact mapping; not compared)"
        return PointRecord(point, Status.SEMANTIC, stats={"transform": obs.transform.note, "structural": True},
                           reason=why, message=f"{point.key()}: {why}")
    if obs.test is None:
        why = f" ({obs.why_absent})" if obs.why_absent else ""
        return skipped(point, f"target {session.target.name} does not produce this point{why}")
    ref, test = obs.ref, np.asarray(obs.test)
    if obs.transform is not None:  # protocol v2: the dump's array in the form the target computed
        ref, test = obs.transform.apply(ref, test)
    if test.shape != ref.shape:
        return shape_mismatch(point, ref.shape, test.shape)
    from parity.numerics.ulp import dtype_name

    # a backward model point may be read from another point (`final_norm:in` is the last layer's `output` cotangent)
    dt = dump.dtype(point) if point.phase != "backward" or dump.has(point) else dtype_name(ref.dtype)
    rule = session.rules.rule_for(rule_site(point), session.mode, dt, session.dtype)
    if point.phase == "backward":
        v = compare_gradient(ref, test, rule, name=point.key())
    else:
        v = compare(ref, test, rule, name=point.key())
    stats = v.to_dict()
    if obs.transform is not None:
        stats["transform"] = obs.transform.note
    if (note := dtype_note(ref, test, rule)) is not None:
        stats["dtype_note"] = note
    passed, message = v.passed, None if v.passed else v.message()
    rounding = _rounding_check(obs, ref, test, rule)
    if rounding is not None:
        stats["rounding"] = rounding
        if rounding.get("outside"):
            from parity.numerics.rounding import message as rounding_message

            line = rounding_message(point.key(), rounding)
            # a named variant (e.g. an RMSNorm that rounds once) explains it only where the ULP rule passes too; the
            # exactness test (isolated mode) is left out there: a variant's one rounding leaves about a quarter of the
            # elements 1 ULP off and most rows inexact, and its bracket pins every element far more tightly
            variant = obs.rounding.variant(test, rule.norm_scale_noise) if _passes_but_exactness(v, ref, test, rule) \
                else None
            if variant is not None:
                rec = rmsnorm_variant_record(point, variant, stats, getattr(session, "strict_variants", False))
                if rec is not None:
                    return rec
                line += (f"\n{point.key()}: matches the named variant {variant.name} ({variant.formula}), a failure "
                         "under --parity-strict-variants")
            passed, message = False, line if message is None else f"{message}\n{line}"
            stats["passed"] = False  # the compare's own verdict passed; the point's does not
    if not passed and (rec := explain(session, obs, ref, test, rule, stats)) is not None:
        return rec  # a shadow explains it (parity.replay.shadows)
    if not passed and (pe := stats.get("precision")) is not None:  # the three-way verdict refused it: say why
        from parity.replay.shadows import refusal

        message = f"{message}\n{point.key()}: not more precise than the reference: {refusal(pe)}"
    return PointRecord(point, Status.PASS if passed else Status.FAIL, stats=stats, message=message)


def dtype_note(ref: np.ndarray, test: np.ndarray, rule) -> str | None:
    """A note where the target returned a float tensor in another dtype than the dump's: which dtypes, and the rounding
    the comparison applied (both sides are rounded RNE to the comparison grid, `compare.comparison_grid`); None where
    the dtypes agree or a side is not a float tensor."""
    from parity.numerics.compare import comparison_grid
    from parity.numerics.ulp import DTYPE_NAMES

    rd, td = ref.dtype.name, test.dtype.name
    if rd == td or rd not in DTYPE_NAMES or not (test.dtype.kind == "f" or td == "bfloat16"):
        return None
    grid = comparison_grid(ref.dtype, rule)
    if grid == td:
        how = f"the dump's {rd} values are exact on it, the target's are not rounded"
    else:
        how = f"the target's {td} values rounded (round-to-nearest-even) to {grid} before comparing"
    return f"target returned {td} where the dump holds {rd}: compared on the {grid} grid, {how}"


def _rounding_check(obs: Observation, ref: np.ndarray, test: np.ndarray, rule) -> dict | None:
    """The RMSNorm rounding check's report entry (parity.numerics.rounding) where the strategy supplied its inputs,
    the rule sets `norm_scale_noise` and both tensors are bf16 as the dump holds them; else None."""
    if obs.rounding is None or rule.norm_scale_noise is None or obs.transform is not None:
        return None
    if ref.dtype.name != "bfloat16" or test.dtype.name != "bfloat16":
        return None
    return obs.rounding.check(ref, test, rule.norm_scale_noise)


def _passes_but_exactness(v, ref: np.ndarray, test: np.ndarray, rule) -> bool:
    """The verdict `v` passes, or would without the rule's exactness test (`inexact_row_rate`)."""
    from dataclasses import replace

    from parity.numerics.compare import compare

    if v.passed or rule.inexact_row_rate is None:
        return v.passed
    return compare(ref, test, replace(rule, inexact_row_rate=None)).passed


def _with(rec: PointRecord, obs: Observation) -> PointRecord:
    """Link a record to the observation it judges (which run it came from, what an isolated site was fed)."""
    rec.observation, rec.forced_routing, rec.feeds = obs, obs.forced, obs.feeds
    return rec


def routing_verdict(session, observations: list[Observation]) -> dict[str, PointRecord]:
    """The routing records of one (phase, step, layer): {"mlp.gate.topk_idx": the expert sets judged against the
    dump (BENIGN where every flip is within the reference's own router margin and the router logits pass), and
    "mlp.gate.logits": the logits' record}; {} where the step has no comparable routing. Used by `judge_step` and,
    before propagating a layer's output, by free mode (`strategies.observe_free`)."""
    plain = {_base(o.point.site): o for o in observations if not o.forced}
    recs: dict[str, PointRecord] = {}
    ids = plain.get("mlp.gate.topk_idx")
    if ids is None:
        return recs
    first = observations[0].point
    layer = first.layer
    moe = (layer is not None and session.dump.config.is_moe(layer)) or mtp_site(first.site) is not None  # MTP: MoE
    if (moe and ids.skip is None and ids.ref is not None and ids.test is not None and ids.expert_bias is not None):
        lg = plain.get("mlp.gate.logits")
        logits_rec = judge_point(session, lg) if lg is not None else None
        logits_ok = logits_rec is None or logits_rec.status in (Status.PASS, Status.SKIPPED)
        test_logits = None if lg is None else lg.test
        if lg is not None and lg.transform is not None and lg.transform.name == "router_scores" \
                and test_logits is not None:
            from parity.targets.taps import scores_to_logits

            test_logits = scores_to_logits(test_logits)  # routing margins are estimated on logits
        routing, _ = routing_record(session.dump, ids.point, ids.test, test_logits,
                                    ids.expert_bias, session.dump.config, logits_ok=logits_ok)
        recs["mlp.gate.topk_idx"] = _with(routing, ids)
        if logits_rec is not None:
            recs["mlp.gate.logits"] = logits_rec
    return recs


def judge_step(session, observations: list[Observation]) -> list[PointRecord]:
    """The observations of one (phase, step, layer): routing judged as expert sets, and where the routing differs
    only benignly the router's downstream points judged on the run forced to the reference's experts."""
    # keyed by the site within its layer (an MTP layer's `MTP0/mlp` is its `mlp`)
    plain = {_base(o.point.site): o for o in observations if not o.forced}
    forced = {_base(o.point.site): o for o in observations if o.forced}
    recs = routing_verdict(session, observations)
    routing = recs.get("mlp.gate.topk_idx")
    use_forced = routing is not None and routing.status == Status.BENIGN and bool(forced)
    out = []
    for site, obs in plain.items():
        if site in recs:
            out.append(recs[site])
            continue
        if use_forced and site in ROUTER_DOWNSTREAM and site in forced:
            obs = forced[site]  # expert maths compared on the reference's experts
        out.append(judge_point(session, obs))
    return out


def judge(session, observations: Iterable[Observation]) -> Iterator[PointRecord]:
    """Judge a stream of observations; consecutive observations of one (phase, step, layer) are judged together."""
    def unit(o: Observation):
        m = mtp_site(o.point.site)
        return o.point.phase, o.point.step, o.point.layer, None if m is None else m[0]

    for _, group in groupby(observations, key=unit):
        yield from judge_step(session, list(group))
