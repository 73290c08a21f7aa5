"""The judge: observations in, typed `PointRecord`s out — numerics (`parity.numerics.compare`), the tolerance rules
of the session's mode, and the routing analysis (`routing`) for the top-k expert ids of MoE layers."""

from __future__ import annotations

from itertools import groupby
from typing import Iterable, Iterator

import numpy as np

from parity.points import Point
from parity.replay.records import Observation, PointRecord, Status, skipped
from parity.replay.routing import routing_record, shape_mismatch
from parity.replay.strategies import ROUTER_DOWNSTREAM


def unavailable_reason(dump, point: Point) -> str | None:
    """The reason the dump declares `point` unavailable (by layer/site, full key or site pattern), else None."""
    un = dump.unavailable()
    lay = "model" if point.layer is None else f"L{point.layer:02d}"
    for key in (f"{lay}/{point.site}", point.key(), point.site):
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
        return PointRecord(point, Status.MISSING, reason="the target produces this point but the dump lacks it")
    if obs.test is None:
        why = f" ({obs.why_absent})" if obs.why_absent else ""
        return skipped(point, f"target {session.target.name} does not produce this point{why}")
    ref, test = obs.ref, np.asarray(obs.test)
    if obs.transform is not None:  # protocol v2: the dump's array in the form the target computed
        ref, test = obs.transform.apply(ref, test)
    if test.shape != ref.shape:
        return shape_mismatch(point, ref.shape, test.shape)
    rule = session.rules.rule_for(point.site, session.mode, dump.dtype(point), session.dtype)
    v = compare(ref, test, rule, name=point.key())
    stats = v.to_dict()
    if obs.transform is not None:
        stats["transform"] = obs.transform.note
    return PointRecord(point, Status.PASS if v.passed else Status.FAIL, stats=stats,
                       message=None if v.passed else v.message())


def _with(rec: PointRecord, obs: Observation) -> PointRecord:
    """Link a record to the observation it judges (which run it came from, what an isolated site was fed)."""
    rec.observation, rec.forced_routing, rec.feeds = obs, obs.forced, obs.feeds
    return rec


def judge_step(session, observations: list[Observation]) -> list[PointRecord]:
    """The observations of one (phase, step, layer): routing judged as expert sets, and where the routing differs
    only benignly the router's downstream points judged on the run forced to the reference's experts."""
    plain = {o.point.site: o for o in observations if not o.forced}
    forced = {o.point.site: o for o in observations if o.forced}
    recs: dict[str, PointRecord] = {}
    ids = plain.get("mlp.gate.topk_idx")
    layer = observations[0].point.layer
    routing = None
    if (layer is not None and session.dump.config.is_moe(layer) and ids is not None and ids.skip is None
            and ids.ref is not None and ids.test is not None and ids.expert_bias is not None):
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
    for _, group in groupby(observations, key=lambda o: (o.point.phase, o.point.step, o.point.layer)):
        yield from judge_step(session, list(group))
