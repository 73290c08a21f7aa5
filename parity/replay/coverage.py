"""The coverage rule (DESIGN §8): which points a replay of a dump owes, so that nothing goes untested silently.

Every point of the dump's model — each step the dump was made with (prefill + `decode_steps`), the model-level
sites, every site of every layer — is either compared, or listed: `missing` (a failure) when the dump should hold it
and does not (a deleted layer, a lost decode step), `not-tested` when someone chose not to compare it (the dump was
made with `--layers` / `--sites`, the run selected `--parity-layers`, `-k`, `--deselect`, or stopped early). A point
the dump holds that no replay compares (an unknown site name) is owed too: its test fails naming it. MTP layers'
points (their own groups) are owed like the main layers'; a target without the `mtp` capability skips them, saying so.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from parity.model.points import MODEL_SITES_AFTER, MODEL_SITES_BEFORE, Point, sites_for_config

MODEL_SITES = MODEL_SITES_BEFORE + MODEL_SITES_AFTER


@dataclass(frozen=True)
class Owed:
    """One point a replay of the dump owes, and why it might not be compared (None: it must be)."""

    point: Point
    not_tested: str | None = None  # the reason it is not compared by choice
    unknown: bool = False  # the dump holds it, but it is not a canonical point of the model


def expected_steps(dump) -> list[tuple[str, int]]:
    """(phase, step) pairs the dump was made with: prefill, then decode 1..`decode_steps` (root attr; dumps that do
    not record it: the steps they hold)."""
    n = dump.meta.get("decode_steps")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return [("prefill", 0)] + [("decode", k) for k in range(1, n + 1)]
    out = [("prefill", 0)]
    if "decode" in dump.phases():
        out += [("decode", k) for k in sorted(dump.steps("decode"))]
    return out


def dumped_layers(dump) -> list[int]:
    """Layers the dump was made to hold (root attr `layers_dumped`, a `--layers` selection), else all."""
    n = dump.config.num_hidden_layers
    sel = dump.meta.get("layers_dumped")
    if isinstance(sel, list) and all(isinstance(i, int) for i in sel):
        return sorted({i for i in sel if 0 <= i < n})
    return list(range(n))


def _site_filter(dump) -> list[str]:
    f = dump.meta.get("sites_filter")
    return [str(p) for p in f] if isinstance(f, list) else []


def _fmt_layers(layers) -> str:
    return ",".join(str(i) for i in layers)


def owed_points(dump, layers: set[int] | None = None) -> list[Owed]:
    """Every point a replay of `dump` owes, in dump order; `layers` is the run's layer selection (None: all)."""
    cfg = dump.config
    made = dumped_layers(dump)
    sites_f = _site_filter(dump)
    out: list[Owed] = []
    known: set[Point] = set()

    def add(p: Point, why: str | None) -> None:
        if p in known:
            return
        known.add(p)
        out.append(Owed(p, why))

    last = cfg.num_hidden_layers - 1
    for phase, step in expected_steps(dump):
        for site in MODEL_SITES:
            why = None
            if sites_f and not any(fnmatch.fnmatchcase(site, f) for f in sites_f):
                why = f"not in the dump: it was made with --sites {','.join(sites_f)}"
            elif site in MODEL_SITES_AFTER and last not in made:
                why = (f"the head is fed layer {last}'s output, not in the dump: it was made with "
                       f"--layers {_fmt_layers(made)}")
            add(Point(phase, step, None, site), why)
        for i in range(cfg.num_hidden_layers):
            for site in sites_for_config(cfg, i, recorded_inputs=True):
                why = None
                if i not in made:
                    why = f"not in the dump: it was made with --layers {_fmt_layers(made)}"
                elif sites_f and not any(fnmatch.fnmatchcase(site, f) for f in sites_f):
                    why = f"not in the dump: it was made with --sites {','.join(sites_f)}"
                elif layers is not None and i not in layers:
                    why = f"not selected (--parity-layers {_fmt_layers(sorted(layers))})"
                add(Point(phase, step, i, site), why)
    if has_backward(dump):
        for p, why in _owed_backward(dump, made, sites_f, layers):
            add(p, why)
    for p in dump.points():  # held, but not a point of the model: owed all the same (its test fails naming it)
        if p not in known:
            known.add(p)
            out.append(Owed(p, None, unknown=True))
    out += _owed_mtp(dump, made, sites_f, layers)
    return out


def _has_mtp_loss(dump) -> bool:
    """Whether the dump's backward pass includes the MTP loss (root attr `backward.mtp_loss`, issue 33)."""
    b = dump.meta.get("backward")
    return isinstance(b, dict) and isinstance(b.get("mtp_loss"), dict)


def has_backward(dump) -> bool:
    """Whether the dump was made with a backward pass (`--grads`: root attr `backward`, or backward points held)."""
    return isinstance(dump.meta.get("backward"), dict) or "backward" in dump.phases()


def _owed_backward(dump, made: list[int], sites_f: list[str], layers: set[int] | None) -> list[tuple[Point, str | None]]:
    """The backward phase's points (issue 26): per layer its cotangents and weight gradients
    (`parity.model.points.backward_sites`), the model-level ones (`BACKWARD_MODEL_SITES`). A `--sites` filter of the
    dump applies to the forward site a cotangent is of (a weight gradient: to the site of its module)."""
    from parity.model.points import BACKWARD_MODEL_SITES, backward_sites, grad_param_site

    cfg = dump.config
    last = cfg.num_hidden_layers - 1
    out = []

    def filtered(site: str) -> bool:
        return bool(sites_f) and not any(fnmatch.fnmatchcase(site, f) for f in sites_f)

    for site in BACKWARD_MODEL_SITES:
        why = None
        if site in ("final_norm:in",) and last not in made:
            why = f"the head's backward feeds layer {last}'s output cotangent: it was made with --layers {_fmt_layers(made)}"
        out.append((Point("backward", 0, None, site), why))
    for i in range(cfg.num_hidden_layers):
        for site in backward_sites(cfg, i):
            base = grad_param_site(cfg, i, site[len("grad."):]) if site.startswith("grad.") else site
            why = None
            if i not in made:
                why = f"not in the dump: it was made with --layers {_fmt_layers(made)}"
            elif sites_f and filtered(base or site):
                why = f"not in the dump: it was made with --sites {','.join(sites_f)}"
            elif layers is not None and i not in layers:
                why = f"not selected (--parity-layers {_fmt_layers(sorted(layers))})"
            out.append((Point("backward", 0, i, site), why))
    return out


def _owed_mtp(dump, made: list[int], sites_f: list[str], layers: set[int] | None) -> list[Owed]:
    """The MTP layers' points (`Point(phase, step, None, "MTP{j}/<site>")`, parity.model.points.mtp_site): every site of
    every MTP layer at every step. The dumper captures them only when every main layer is dumped (parity.torch_ref.
    dump); a `--parity-layers` selection does not name them, so it leaves them untested."""
    from parity.model.mtp_points import mtp_sites

    cfg = dump.config
    n = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    held = {Point(m.phase, m.step, None, f"MTP{m.mtp}/{m.site}") for m in dump.mtp_points()}
    captured = dump.meta.get("mtp_captured")  # root attr since MTP capture (parity.torch_ref.dump)
    if not isinstance(captured, int) or isinstance(captured, bool):
        captured = None
    out, seen = [], set()
    for phase, step in expected_steps(dump):
        for j in range(n):
            for site in mtp_sites(cfg, recorded_inputs=True):
                p = Point(phase, step, None, f"MTP{j}/{site}")
                why = None
                if captured is None and not held:
                    why = "not in the dump: it records no MTP capture (made before the suite captured MTP layers)"
                elif captured is not None and j >= captured:
                    why = ("not in the dump: MTP layers are dumped only with every main layer (--layers "
                           f"{_fmt_layers(made)})" if len(made) < cfg.num_hidden_layers else
                           "not in the dump: it was made without its MTP layers")
                elif sites_f and not any(fnmatch.fnmatchcase(site, f) for f in sites_f):
                    why = f"not in the dump: it was made with --sites {','.join(sites_f)}"
                elif layers is not None:
                    why = f"not selected (--parity-layers {_fmt_layers(sorted(layers))} names main layers only)"
                seen.add(p)
                out.append(Owed(p, why))
    if _has_mtp_loss(dump):  # issue 33: the MTP layers' backward points (`--grads --mtp-loss-scale F`)
        from parity.model.mtp_points import mtp_backward_sites
        from parity.model.points import grad_param_site

        for j in range(n):
            for site in mtp_backward_sites(cfg):
                p = Point("backward", 0, None, f"MTP{j}/{site}")
                param = site[len("grad."):] if site.startswith("grad.") else None
                base = site if param is None else (grad_param_site(cfg, cfg.num_hidden_layers, param)
                                                   or param.removesuffix(".weight"))
                why = None
                if captured is not None and j >= captured:
                    why = "not in the dump: it was made without its MTP layers"
                elif sites_f and not any(fnmatch.fnmatchcase(base, f) for f in sites_f):
                    why = f"not in the dump: it was made with --sites {','.join(sites_f)}"
                elif layers is not None:
                    why = f"not selected (--parity-layers {_fmt_layers(sorted(layers))} names main layers only)"
                seen.add(p)
                out.append(Owed(p, why))
    for p in sorted(held - seen, key=lambda p: (p.phase != "prefill", p.step, p.site)):
        out.append(Owed(p, None, unknown=True))  # an MTP group the model does not have (or an unknown site)
    return out


def not_tested_records(dump, recorded: set[tuple], layers: set[int] | None = None) -> list[dict]:
    """report.json records (status `not-tested`) for the owed points the run produced no record for. `recorded`:
    (phase, step, layer, site) of the records the run has."""
    out = []
    for o in owed_points(dump, layers):
        p = o.point
        if (p.phase, p.step, p.layer, p.site) in recorded:
            continue
        why = o.not_tested or "not run (deselected with -k / --deselect, or the run stopped early)"
        out.append({"phase": p.phase, "step": p.step, "layer": p.layer, "site": p.site, "status": "not-tested",
                    "reason": why})
    return out
