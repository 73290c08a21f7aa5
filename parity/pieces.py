"""Serving-path self-consistency (DESIGN §6): a target's prefill run in pieces against the dump of one prefill.

Serving ports split prompts (chunked prefill, prefix caching: the "extend" path) and carry the KDA recurrent + conv
state and the MLA cache between pieces. `replay_layer_pieces` feeds layer i the dumped prefill input in pieces
P1 + P2 + … (each call continuing the state the previous one returned, positions continuing), concatenates the
per-token points of the pieces and compares them — and the state after the last piece — with the dump's single
prefill over all T tokens. `pieces=[P, 1, 1, …]` is prefill(P) + decode(T − P). Needs no new dump, works for any
target that continues a state with T > 1 (protocol: `Target.layer_forward(..., state=...)`).
"""

from __future__ import annotations

import numpy as np

from parity.points import Point, sites_for_config

STATE_SITES = ("attention.state", "attention.conv_state")  # compared after the last piece, not concatenated


def parse_pieces(text: str, total: int) -> list[int]:
    """'40+60' -> [40, 60]; 'P+decode' -> [P, 1, 1, …] up to `total`; the pieces must add up to `total`."""
    parts = text.split("+")
    if len(parts) == 2 and parts[1] == "decode":
        P = int(parts[0])
        pieces = [P] + [1] * (total - P)
    else:
        pieces = [int(p) for p in parts]
    if sum(pieces) != total or any(p <= 0 for p in pieces):
        raise ValueError(f"pieces {text!r}: expected positive lengths adding up to the prompt length {total}")
    return pieces


def replay_layer_pieces(ctx, i: int, pieces: list[int], against: str = "dump") -> list[dict]:
    """Records for layer i's prefill points, computed piecewise; each record carries `pieces`.

    against="dump": compared with the dumped single prefill (the reference). against="self": compared with the
    target's own single prefill over all T tokens (same rules) — isolates the serving path (state carried between
    pieces) from any departure the target also has in one piece."""
    from parity.replay import compare_point

    if against not in ("dump", "self"):
        raise ValueError(f"against={against!r}: expected 'dump' or 'self'")
    dump, target = ctx.dump, ctx.target
    cfg = dump.config
    hidden = dump.read(Point("prefill", 0, i, "input"))
    T = hidden.shape[1]
    if sum(pieces) != T:
        raise ValueError(f"pieces {pieces} do not add up to the dumped prefill length {T}")
    target.load_layer(i, ctx.ckpt.hf_tensors(i))
    try:
        whole = None
        if against == "self":
            whole = target.layer_forward(i, hidden, np.arange(T), None)
        state, start = None, 0
        token_pts: dict[str, list[np.ndarray]] = {}
        last = None
        for n in pieces:
            res = target.layer_forward(i, hidden[:, start:start + n], np.arange(start, start + n), state)
            state, last = res.state, res
            pts = dict(res.points)
            pts.setdefault("output", res.output)
            for site, v in pts.items():
                if site not in STATE_SITES:
                    token_pts.setdefault(site, []).append(np.asarray(v))
            start += n
    finally:
        target.unload_layer(i)
    label = "+".join(str(p) for p in pieces) if len(set(pieces[1:])) != 1 or pieces[-1] != 1 else \
        f"{pieces[0]}+decode×{len(pieces) - 1}"
    out = []
    for site in sites_for_config(cfg, i):
        if site == "input":
            continue
        pt = Point("prefill", 0, i, site)
        if site in STATE_SITES:
            test = last.points.get(site)
        else:
            parts = token_pts.get(site)
            test = None if parts is None or len(parts) != len(pieces) else np.concatenate(parts, axis=1)
        if against == "dump":
            rec = compare_point(ctx, pt, test, last.transforms.get(site) if last else None,
                                (last.missing or {}).get(site) if last else None)
        else:
            rec = _compare_self(ctx, pt, test, whole)
        rec["pieces"] = label
        rec["against"] = against
        out.append(rec)
    return out


def _compare_self(ctx, pt: Point, test, whole) -> dict:
    """The pieces' value against the target's own one-shot value, with the rule of the point's dump dtype."""
    from parity.numerics.compare import compare

    rec = {"phase": pt.phase, "step": pt.step, "layer": pt.layer, "site": pt.site}
    ref = whole.points.get(pt.site, whole.output if pt.site == "output" else None)
    if test is None or ref is None:
        rec.update(status="skipped", reason=f"target {ctx.target.name} does not produce this point")
        return rec
    ref, test = np.asarray(ref), np.asarray(test)
    if ref.shape != test.shape:
        rec.update(status="fail", reason=f"shape {test.shape} in pieces vs {ref.shape} in one prefill")
        return rec
    dtype = ctx.dump.dtype(pt) if ctx.dump.has(pt) else str(ref.dtype)
    rule = ctx.rules.rule_for(pt.site, "layer", dtype, ctx.dtype)
    if np.issubdtype(ref.dtype, np.integer):
        rec["status"] = "pass" if np.array_equal(ref, test) else "fail"
        return rec
    v = compare(ref.astype(np.float32), test.astype(np.float32), rule, name=f"{pt.key()} (pieces vs one prefill)")
    rec.update(v.to_dict())
    rec["status"] = "pass" if v.passed else "fail"
    return rec


__all__ = ["replay_layer_pieces", "parse_pieces", "STATE_SITES"]
