"""Every independent source of a layer in one run (issue 32 item 2).

Teacher forcing (`layer` / `forced` mode) feeds each layer its dumped input, so a second bug later in the same layer
shows only as one more failure among those inheriting the first. After a layer fails, its sub-modules are re-run on
their own dumped inputs (isolated mode, `strategies.observe_isolated`, where the target has the `isolated`
capability): a failing site that also fails there is an *independent source* — it is wrong on correct inputs; one
that passes there only inherits. The first divergence is unchanged; the layer's failing records are annotated.
"""

from __future__ import annotations

import dataclasses

from parity.replay.records import Status

FAILING = ("fail",)


def isolated_verdicts(s, i: int, failing: set[tuple[str, int, str]]) -> tuple[dict, str | None]:
    """{(phase, step, site): fails on its own dumped inputs} for the given failing points of layer i, and None; or
    ({}, why not) where the target cannot run its sub-modules in isolation."""
    from parity.replay.judge import judge
    from parity.replay.strategies import observe_isolated

    if "isolated" not in getattr(s.target, "capabilities", ()):
        return {}, (f"not checked: target {s.target.name} lacks capability isolated (sub-modules on their own dumped "
                    "inputs), so later failures of a layer may hide an independent second bug; implement "
                    "`submodule` to get them")
    iso = dataclasses.replace(s, mode="isolated")  # same dump, checkpoint, target, rules and watchdog
    out = {}
    for rec in judge(iso, observe_isolated(iso, i, backward=False)):  # forward points only are re-judged
        key = (rec.point.phase, rec.point.step, rec.point.site)
        if key in failing:
            out[key] = rec.status == Status.FAIL
    return out, None


def annotate(s, i, records: list[dict]) -> None:
    """Mark the failing forward records of layer i (report.json dicts) with `independent_source` (True: fails on its
    own dumped inputs; False: passes there, so it inherits; absent: not re-run, e.g. an alias site) or, where the
    target cannot run them, `independent_source_note`. Only for layer / forced mode."""
    if not isinstance(i, int) or s.mode not in ("layer", "forced"):
        return
    failing = {(r["phase"], r["step"], r["site"]) for r in records
               if r.get("status") in FAILING and r.get("phase") != "backward"}
    if not failing:
        return
    from parity.errors import ParityError

    try:
        verdicts, why = isolated_verdicts(s, i, failing)
    except ParityError as e:  # the re-run is extra information: its failure must not cost the layer's report
        verdicts, why = {}, f"not checked: the isolated re-run failed ({e})"
    for r in records:
        key = (r["phase"], r["step"], r["site"])
        if key not in failing:
            continue
        if why is not None:
            r["independent_source_note"] = why
        elif key in verdicts:
            r["independent_source"] = verdicts[key]
