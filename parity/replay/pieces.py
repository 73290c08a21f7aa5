"""Serving-path self-consistency (DESIGN §6) as a replay strategy: a target's prefill run in pieces.

Serving ports split prompts (chunked prefill, prefix caching: the "extend" path) and carry the KDA recurrent + conv
state and the MLA cache between pieces. `observe_pieces` feeds layer i the dumped prefill input in pieces
P1 + P2 + … (each call continuing the state the previous one returned, positions continuing), concatenates the
per-token points of the pieces and yields them — and the state after the last piece — as observations of the
prefill points, against the dump's single prefill over all T tokens (`against="dump"`) or against the target's own
single prefill (`against="self"`, which isolates the serving path from a departure the target also has in one
piece). `pieces=[P, 1, 1, …]` is prefill(P) + decode(T − P). Needs no new dump; works for any target that continues
a state with T > 1 (`Target.layer_forward(..., state=...)`). The judge applies the session's rules as for `layer`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from parity.model.points import Point, sites_for_config
from parity.replay.records import Observation
from parity.replay.session import Session

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


def observe_pieces(s: Session, i: int, pieces: list[int], against: str = "dump") -> Iterator[Observation]:
    if against not in ("dump", "self"):
        raise ValueError(f"against={against!r}: expected 'dump' or 'self'")
    hidden = s.dump.read(Point("prefill", 0, i, "input"))
    T = hidden.shape[1]
    if sum(pieces) != T:
        raise ValueError(f"pieces {pieces} do not add up to the dumped prefill length {T}")
    hf = s.ckpt.hf_tensors(i)
    s.target.load_layer(i, hf)
    try:
        whole = s.target.layer_forward(i, hidden, np.arange(T), None) if against == "self" else None
        state, start, last = None, 0, None
        token_pts: dict[str, list[np.ndarray]] = {}
        for n in pieces:
            last = s.target.layer_forward(i, hidden[:, start:start + n], np.arange(start, start + n), state)
            state = last.state
            pts = dict(last.points)
            pts.setdefault("output", last.output)
            for site, v in pts.items():
                if site not in STATE_SITES:
                    token_pts.setdefault(site, []).append(np.asarray(v))
            start += n
    finally:
        s.target.unload_layer(i)
    bias = hf.get(f"model.layers.{i}.mlp.gate.expert_bias")
    bias = None if bias is None or against == "self" else np.asarray(bias, np.float64)
    positions = np.arange(T)
    for site in sites_for_config(s.config, i):
        if site == "input":
            continue
        pt = Point("prefill", 0, i, site)
        if site in STATE_SITES:
            test = last.points.get(site)
        else:
            parts = token_pts.get(site)
            test = None if parts is None or len(parts) != len(pieces) else np.concatenate(parts, axis=1)
        if against == "dump":
            ref, tf = (s.dump.read(pt) if s.dump.has(pt) else None), last.transforms.get(site)
        else:  # the target's own one-shot value, already in the target's form (no transform)
            own = dict(whole.points)
            own.setdefault("output", whole.output)
            ref, tf = own.get(site), None
            ref = None if ref is None else np.asarray(ref)
        why = (last.missing or {}).get(site)
        skip = None
        if against == "self" and ref is None and test is None:
            skip = f"target {s.target.name} does not produce this point" + (f" ({why})" if why else "")
        yield Observation(pt, ref, test, s.mode, positions=positions, expert_bias=bias, transform=tf,
                          why_absent=why, skip=skip)


def replay_layer_pieces(s: Session, i: int, pieces: list[int], against: str = "dump") -> list[dict]:
    """Judged report records of layer i's prefill points computed piecewise; each carries `pieces` and `against`."""
    from parity.replay.judge import judge

    label = "+".join(str(p) for p in pieces)
    if len(pieces) > 2 and set(pieces[1:]) == {1}:
        label = f"{pieces[0]}+decode×{len(pieces) - 1}"
    out = []
    for r in judge(s, observe_pieces(s, i, pieces, against)):
        d = r.to_json()
        d.update(pieces=label, against=against)
        out.append(d)
    return out


__all__ = ["observe_pieces", "parse_pieces", "replay_layer_pieces", "STATE_SITES"]
