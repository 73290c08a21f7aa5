"""The dot-precision shadow (issue 31): the reference whose dots run one bf16 pass (`parity.targets.mutants` plant
`dots_one_bf16_pass`: on CPU every fp32 dot operand rounded to bf16 before an fp32-accumulating dot), run on the same
dumped inputs as the target where the target's points fail. A failing point that matches it within the point's own
tolerance rule is marked `dot_precision.matches`: the diagnosis is then **dot precision**
(`parity.replay.matmul_policy.FIX`), not a semantic or precision error.

Interface (a shadow in the sense of issue 31 item 7: a reference configuration run beside the target, and the
status a match with it confers): `shadow_points(session, unit) -> {Point: array}`,
`recognise(session, unit, records) -> records`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.model.points import Point

SHADOW = "dots_one_bf16_pass"


# ------------------------------------------------------------------------------------------------ the shadow
def shadow_target(s) -> Any:
    """The built reference with one-bf16-pass dots, following the dump's semantics; one per session."""
    from parity.targets.mutants import PlantedTpuDefaultPrecision

    # one of the session's shadow configurations (parity.replay.shadows.ShadowPool), released with the session
    return s.shadows.target(f"dot-precision:{SHADOW}",
                            lambda: PlantedTpuDefaultPrecision(SHADOW, **s.fork_options("dump")))


def shadow_points(s, unit: int | None, phases: tuple[str, ...] = ("forward", "backward")) -> dict[Point, np.ndarray]:
    """The shadow's forward points of layer `unit` (teacher-forced over the dump's steps: each step fed the dumped
    layer input, the shadow's own state carried, routing forced to the dumped experts in `forced` mode), or of the
    model head (`unit` None: fed the dumped last-layer output); a layer's backward points too (its VJP at the dumped
    prefill input, fed the dumped `output` cotangent, routing forced to the dumped prefill experts, as the replay's
    backward phase). The model-level backward points are not shadowed (the LM head's VJP runs outside the layers).
    `phases`: which of "forward" / "backward" to run."""
    t = shadow_target(s)
    out: dict[Point, np.ndarray] = {}
    if unit is None:
        s.call("load_globals (dot-precision shadow)", t.load_globals, s.ckpt.hf_global_tensors())
        last = s.config.num_hidden_layers - 1
        for phase, step in s.steps():
            p = Point(phase, step, last, "output")
            if s.dump.has(p):
                head = s.call(f"model {phase} step {step}: head (dot-precision shadow)", t.head, s.dump.read(p))
                out.update({Point(phase, step, None, k): v for k, v in head.items()})
        return out
    i = unit
    s.call(f"layer {i}: load_layer (dot-precision shadow)", t.load_layer, i, s.ckpt.hf_tensors(i))
    state = None
    try:
        for phase, step in s.steps() if "forward" in phases else ():
            inp = Point(phase, step, i, "input")
            if not s.dump.has(inp):
                continue
            hidden = s.dump.read(inp)
            T = hidden.shape[1]
            P = int(s.dump.prompt_len)
            positions = np.arange(T) if phase == "prefill" else np.arange(P + step - 1, P + step - 1 + T)
            topk = Point(phase, step, i, "mlp.gate.topk_idx")
            forced = (s.dump.read(topk).astype(np.int32) if s.mode == "forced" and s.dump.has(topk) else None)
            r = s.call(f"layer {i} {phase} step {step}: layer_forward (dot-precision shadow)", t.layer_forward, i,
                       hidden, positions, state, forced_topk=forced)
            state = r.state
            pts = dict(r.points)
            pts.setdefault("output", r.output)
            out.update({Point(phase, step, i, k): v for k, v in pts.items()})
        if "backward" in phases:
            out.update(_backward_points(s, t, i))
    finally:
        t.unload_layer(i)
    return out


def _backward_points(s, t, i: int) -> dict[Point, np.ndarray]:
    feeds = [Point("prefill", 0, i, "input"), Point("backward", 0, i, "output")]
    if not all(s.dump.has(p) for p in feeds):
        return {}
    hidden, cot = s.dump.read(feeds[0]), s.dump.read(feeds[1])
    topk = Point("prefill", 0, i, "mlp.gate.topk_idx")
    forced = s.dump.read(topk).astype(np.int32) if s.dump.has(topk) else None
    res = s.call(f"layer {i} backward: layer_backward (dot-precision shadow)", t.layer_backward, i, hidden,
                 np.arange(hidden.shape[1]), cot, forced_topk=forced)
    pts = dict(res.points)
    pts["input"] = res.input_grad
    pts.update({f"grad.{k}": v for k, v in res.param_grads.items()})
    return {Point("backward", 0, i, k): v for k, v in pts.items()}


def recognise(s, unit: int | str | None, records: list) -> list:
    """Mark the failing forward points of one replay unit that the dot-precision shadow explains: the target's array
    passes the point's own rule against the shadow's. Sets `stats["dot_precision"]` = {matches, max_ulp, rel_l2}
    (vs the shadow; routing: the same experts per token) on each failing point it compared; statuses are unchanged
    (the point still fails: the target is not what the reference computes under the policy). Runs the shadow only
    where a point fails (the phases that fail), and no more in a session once a failing unit had none explained;
    layer / forced modes, main layers (forward and backward) and the model head (not MTP layers, not the re-run
    forced to the dump's experts beside a plain run whose routing differed: the shadow runs unforced there)."""
    from parity.numerics.compare import compare
    from parity.replay.judge import compare_gradient, rule_site
    from parity.replay.records import Status

    if s.mode not in ("layer", "forced") or isinstance(unit, str) or getattr(s, "_dot_precision_off", False):
        return records
    failing = [r for r in records if r.status == Status.FAIL and r.observation is not None
               and r.observation.test is not None and not r.forced_routing]
    if not failing:
        return records
    phases = tuple(sorted({"backward" if r.point.phase == "backward" else "forward" for r in failing}))
    shadow = shadow_points(s, unit, phases)
    explained = False
    for r in failing:
        sh = shadow.get(r.point)
        test = np.asarray(r.observation.test)
        if sh is None or np.shape(sh) != test.shape or r.observation.transform is not None:
            continue
        if r.point.site.endswith("topk_idx"):  # routing: the same experts per token as the shadow chose
            same = bool((np.sort(np.asarray(sh), -1) == np.sort(test, -1)).all())
            r.stats["dot_precision"] = {"matches": same, "max_ulp": None, "rel_l2": None}
            explained |= same
            continue
        rule = s.rules.rule_for(rule_site(r.point), s.mode, s.dump.dtype(r.point), s.dtype)
        cmp = compare_gradient if r.point.phase == "backward" else compare
        if r.observation.ref is not None and cmp(np.asarray(r.observation.ref), test, rule).passed:
            # its ULP rule passes against the dump: another check failed it (e.g. the RMSNorm rounding check), which
            # no dot precision explains
            r.stats["dot_precision"] = {"matches": False, "max_ulp": None, "rel_l2": None}
            continue
        v = cmp(np.asarray(sh), test, rule, name=r.point.key())
        d = v.to_dict()
        r.stats["dot_precision"] = {"matches": bool(v.passed), "max_ulp": d.get("max_ulp"),
                                    "rel_l2": d.get("rel_l2")}
        explained |= bool(v.passed)
    if not explained:
        # dot precision differs in every layer alike: a first failing unit it explains nothing of says it is not
        # the cause, and the session's later units are not shadowed (one extra layer run per replay at most)
        s._dot_precision_off = True
    return records


__all__ = ["SHADOW", "recognise", "shadow_points", "shadow_target"]
