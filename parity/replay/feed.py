"""What isolated mode feeds a site: its dumped inputs, the tokens' positions, and the dumped state of earlier steps a
decode step continues from (`dumped_feed`). Used by the isolated strategy (parity.replay.strategies) and by the
layer-mode three-way verdict's site-local shadow (parity.replay.shadows `HighPrecision.local`); a module of its own
so that the shadows need not import the strategies (which import the shadows).
"""

from __future__ import annotations

import numpy as np

from parity.model.points import Point

# `s` below is a parity.replay.session.Session (not imported: the session imports the shadows, which import this)


def _positions(s: Session, phase: str, step: int, T: int) -> np.ndarray:
    """Absolute positions of a step's T tokens."""
    P = int(s.dump.prompt_len)
    return np.arange(T) if phase == "prefill" else np.arange(P + step - 1, P + step - 1 + T)


def _step_len(s: Session, phase: str, step: int, i: int) -> int:
    p = Point(phase, step, i, "input")
    if s.dump.has(p):
        return int(s.dump.read(p).shape[1])
    return int(s.dump.prompt_len) if phase == "prefill" else 1


def dumped_feed(s: Session, pt: Point, site, history: list[tuple[str, int]] | None = None
                ) -> tuple[dict | None, dict | None, str | None]:
    """What isolated mode feeds site `site` (a `parity.model.points.Site` of layer pt.layer) at pt's step: its dumped
    inputs (with the tokens' positions where it takes them), the dumped earlier-step state a decode step continues
    from (`history`: the earlier (phase, step)s, default the dump's steps before pt's), or why it cannot be fed ->
    (inputs, state, why). `observe_isolated` feeds this; the layer-mode three-way verdict uses it for the dump's own
    departure at a site (`HighPrecision.local`)."""
    i, phase, step = pt.layer, pt.phase, pt.step
    inputs, why = _read_all(s, [Point(phase, step, i, n) for n in site.inputs])
    if why is not None:
        return None, None, why
    state = None
    if phase == "decode":
        if history is None:
            steps = s.steps()
            history = steps[:steps.index((phase, step))] if (phase, step) in steps else []
        state, why = _earlier_state(s, site, i, history)
        if why is not None:
            return None, None, why
    if site.positions:
        inputs["positions"] = _positions(s, phase, step, _step_len(s, phase, step, i))
    return inputs, state, None


def _read_all(s: Session, points: list[Point]) -> tuple[dict[str, np.ndarray], str | None]:
    out = {}
    for p in points:
        if not s.dump.has(p):
            return out, f"its input {p.key()} is not in the dump"
        out[p.site] = s.dump.read(p)
    return out, None


def _earlier_state(s: Session, site, i: int, history: list[tuple[str, int]]) -> tuple[dict | None, str | None]:
    """Dumped tensors of earlier steps a decode-step site continues from (None when it needs none)."""
    if not (site.carry or site.history):
        return None, None
    if not history:
        return None, "a decode step with no earlier step in the dump"
    if site.carry:
        ph, st = history[-1]
        return _read_all(s, [Point(ph, st, i, n) for n in site.carry])
    out = {}
    for n in site.history:
        parts = []
        for ph, st in history:
            got, why = _read_all(s, [Point(ph, st, i, n)])
            if why:
                return None, why
            parts.append(got[n])
        out[n] = np.concatenate(parts, axis=1)
    return out, None
