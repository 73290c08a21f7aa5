"""One replay pipeline for every entry point (DESIGN §2, §6): the pytest plugin, `run_replay`, calibration, bench.

    Session (session.py)      dump, checkpoint, target, rules, mode — opened and validated once
      -> strategies.py        layer / forced / free / isolated walks yield `Observation`s (point, ref, test, context)
      -> judge.py, routing.py numerics + tolerance rules + routing analysis -> typed `PointRecord`s (`Status`)
      -> consumers            report.json (`PointRecord.to_json`), the pytest face, calibration (observations)

`run_replay(dump, ckpt, mode=...)` replays a whole dump and returns the report dict.
"""

from __future__ import annotations

from typing import Callable, Iterator

from parity.replay.judge import judge, judge_point, judge_step
from parity.replay.records import Observation, PointRecord, Status
from parity.replay.session import (MODES, ModeError, Session, check_mode, dump_identity, dump_steps, find_checkpoint,
                                   target_info)
from parity.replay.strategies import (mtp_units, observe, observe_free, observe_isolated, observe_layer,
                                      observe_model_points)


def replay_records(session: Session, layers=None, progress: Callable[[str], None] | None = None
                   ) -> Iterator[PointRecord]:
    """Every record of a whole replay in the session's mode: the given layers (default: all the dump holds) and the
    model-level points (free mode: the whole model from token ids)."""
    if session.mode == "free":
        yield from judge(session, observe_free(session, progress))
    else:
        held = set(session.layers())
        for i in range(session.config.num_hidden_layers) if layers is None else layers:
            if i in held:
                yield from unit_records(session, i)
                if progress:
                    progress(f"layer {i}")
        yield from unit_records(session, None)
    if layers is None:  # the MTP layers (a main-layer selection does not name them)
        for j in mtp_units(session):
            yield from unit_records(session, j)


def unit_records(session: Session, unit) -> list[PointRecord]:
    """The judged records of one replay unit (a layer, None: the model points, "MTP{j}"), its failing points
    compared with the dot-precision shadow (`parity.replay.dot_precision`: recognised, not re-judged)."""
    from parity.replay.dot_precision import recognise

    return recognise(session, unit, list(judge(session, observe(session, unit))))


def run_replay(dump_path, ckpt_dir=None, *, target=None, mode: str = "layer", rules=None,
               layers=None, progress: Callable[[str], None] | None = None, mesh=None,
               stall_timeout: float | None = None, semantics: str = "dump", strict_variants: bool = False,
               matmul_precision: str | None = None, backward: bool = True) -> dict:
    """Programmatic replay of a whole dump: returns the report dict (`parity.reporting.report.build_report`).

    ckpt_dir defaults to the bundled checkpoint with the dump's fingerprint; target defaults to the reference target
    (a name, class or built instance); rules to the default tolerance table; mesh (a jax Mesh or a `--parity-mesh`
    string such as "4x2") is handed to the target's build; stall_timeout (seconds, default
    `watchdog.DEFAULT_LIMIT_S`; 0 = none) bounds every target call (`parity.replay.watchdog`); semantics ("dump" or
    "intended", `--parity-semantics`) is the behaviour on the semantic forks a reference the replay constructs
    follows (parity/model/semantics.py); strict_variants (`--parity-strict-variants`) fails a point that matches a named
    implementation variant (parity.numerics.variants) instead of reporting it as `variant`; matmul_precision
    (`--parity-matmul-precision`, None: the default "highest") is the policy every target call runs under
    (parity.replay.matmul_policy); backward False leaves a `--grads` dump's backward phase uncomputed (its points are
    reported skipped, saying so: `Session.backward_off`), as `pytest parity -k "not backward"` does. `pytest parity`
    does the same thing point by point.
    """
    from parity.replay.watchdog import DEFAULT_LIMIT_S, Watchdog

    from parity.reporting.report import build_report

    wd = Watchdog(DEFAULT_LIMIT_S if stall_timeout is None else stall_timeout)
    from parity.model.semantics import report_section

    try:
        with Session.open(dump_path, ckpt_dir, target=target, mode=mode, rules=rules, mesh=mesh,
                          layers=None if layers is None else list(layers), watchdog=wd, semantics=semantics,
                          strict_variants=strict_variants, matmul_precision=matmul_precision) as s:
            if not backward:
                s.backward_off = "not asked for (run_replay(backward=False)): the backward phase is not computed"
            records = [r.to_json() for r in replay_records(s, layers, progress)]
            from parity.targets.base import mark_provenance

            mark_provenance(s.target, records)  # a composed target: which points the port computed (issue 32)
            from parity.replay.independent import annotate

            for i in sorted({r["layer"] for r in records if isinstance(r.get("layer"), int)}):
                annotate(s, i, [r for r in records if r.get("layer") == i])  # every independent source (issue 32)
            from parity.reporting.repro import run_context

            # `target` is the display name here (a Target instance has no command-line spelling): `target_class` is
            # what tools/repro.py builds; a rules object is not recorded (`tolerances.custom`: the repro uses the
            # defaults)
            rep = build_report(s.config, records, dump=str(dump_path), target=getattr(s.target, "name", "?"),
                               mode=mode, extra={"semantics": report_section(s.dump.semantics, semantics, records),
                                                 **dump_identity(s.dump),
                                                 **run_context(s.dump, ckpt_dir, None, None, None),
                                                 **({} if rules is None else {"tolerances": {"custom": True}}),
                                                 "target_class": f"{type(s.target).__module__}:"
                                                                 f"{type(s.target).__qualname__}"})
            rep["target_info"] = target_info(s.target)  # protocol v2: what actually ran
            from parity.targets.base import target_environment

            if env := target_environment(s.target):  # what the reproduce line and repro bundles set (issue 32)
                rep["target_environment"] = env
            from parity.replay.environment import collect

            rep["replay_env"] = collect(s.policy)  # where it ran (issue 31)
    finally:
        wd.close()  # its thread ends; closing the session released the target's weights (steady memory, issue 25)
    return rep


__all__ = ["MODES", "ModeError", "Observation", "PointRecord", "Session", "Status", "check_mode", "dump_steps",
           "find_checkpoint", "judge", "judge_point", "judge_step", "observe", "observe_free", "observe_isolated",
           "observe_layer", "observe_model_points", "replay_records", "run_replay", "unit_records"]
