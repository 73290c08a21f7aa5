"""Zero-valued additive probes: the sub-module cotangents of a backward pass (issue 26).

`x = tap(pts, site, x)` records the point as before and, while a probe dict is active, returns `x + probes[site]`.
The gradient of the layer output with respect to `probes[site]` is then dL/d(site) — the cotangent of that
intermediate tensor — without changing any other part of the computation. Probes are filled with **-0.0**:
x + (-0.0) == x bit for bit for every x (including x = -0.0, which +0.0 would turn into +0.0), so a forward with
probes gives exactly the forward without them (tests/test_backward_replay.py checks it on the compiled layers).

The dict is active only while `decoder_layer(..., probes=...)` is being traced (`probing`): a trace-time setting like
the mutation catalogue's patches. The probes are an explicit argument of `decoder_layer`, so a jit cache entry of a
call without probes is never reused for one with them. Not thread-safe (one trace at a time per process).
"""

from __future__ import annotations

import contextlib

_ACTIVE: dict | None = None


@contextlib.contextmanager
def probing(probes: dict | None):
    """Make `probes` ({site: array}) the active probes while the body traces (None: no probes)."""
    global _ACTIVE
    saved = _ACTIVE
    _ACTIVE = probes
    try:
        yield
    finally:
        _ACTIVE = saved


def differentiating() -> bool:
    """Whether a probed (backward) trace is running: code with a form reverse-mode AD cannot go through can take a
    differentiable form then (the reference needs none: its blocked routed-expert loop has its own VJP, moe.py)."""
    return _ACTIVE is not None


def tap(pts: dict, site: str, x):
    """pts[site] = x (+ the active probe of `site`, if any); returns the tapped value, which the caller must use
    downstream in place of x (so the probe's gradient is the site's cotangent)."""
    if _ACTIVE is not None and site in _ACTIVE:
        x = x + _ACTIVE[site]
    pts[site] = x
    return x
