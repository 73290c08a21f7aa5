"""Shadows: a reference configuration run beside the target, and the status a match with it confers.

A failing point is not always a bug. Where the dump's runtime departs from the intended semantics, where the target
computes a named implementation variant, the difference is explained by running *the reference configured that
way* on the same (teacher-forced) inputs: if that reference matches the target where the plain reference does not,
the point gets the status the configuration stands for instead of `fail`. Every such configuration is a shadow
kind here, with one interface:

- `ShadowPool` (one per session, `Session.shadows`) builds and caches the reference targets, one per configuration
  (`ShadowPool.target(key, make)`), and releases them with the session.
- `LayerShadows` (one per layer replayed in `layer` / `forced` mode) loads the layer into the shadows that concern
  it, runs them at each step beside the target (`step(...)`, which carries each shadow's own decode state and runs
  a forced re-run where the target's routing differed) and hands the strategy, per site, the payloads it attaches to
  the `Observation` (`Observation.shadows`: {kind name: payload}).
- A `Kind` is the judge's side: `explain(session, obs, ref, test, rule, stats)` returns the `PointRecord` a failing
  point gets when the shadow explains it, else None. `explain` (module function) asks each kind of `KINDS` in turn.

The kinds (in the order the judge asks them):
- `semantic` — the semantic-fork shadow (parity.model.semantics): two references, one following the dump's
  semantics and one the intended ones, for a layer a departing fork changes. Status `semantic` where the first
  matches the dump and the second matches the target. Both also run the layer's backward, lazily for a failing
  backward point (`ForkBackward`), so the layer's backward points are classified alike (issue 33).
- `variant` — the named-variant shadow (parity.numerics.variants): where the target's input norm (or final norm)
  matched a named variant, the reference computing that variant; points downstream in the layer (the logits for
  the final norm) that it matches are `variant` (inherited).
- `precision` — the high-precision shadow (the three-way verdict, parity_anchors §6b): the reference in fp32 on the
  same bf16 weights and teacher-forced inputs (`HighPrecision`, lazy: run only for a layer where a bf16 point fails).
  A failing bf16 point whose error against it is at most the rule's `precision_ratio` × the dump's own error against
  it is `variant` more-precise-than-reference (e.g. XLA's default excess precision); a target less precise than the
  dump still fails, its record saying by how much (`precision` entry). In `isolated` mode the shadow is the fp32
  reference's `submodule` fed the same dumped inputs (`HighPrecision.isolated`, payload from the strategy), judged by
  the isolated ratios; at an RMSNorm whose rounding check failed, one formula with fewer bf16 roundings must also give
  every element (`RmsNormCheck.fewer_roundings`: the L2 ratio cannot see an epsilon that flips a few elements).

Adding a kind (e.g. a dot-precision shadow: the reference whose dots run one bf16 pass): write its reference
configuration as a `ShadowPool.target` key and factory, run it from `LayerShadows` (or lazily, from the payload)
and put a `Kind` in `KINDS` whose `explain` compares the target with the shadow's array under the point's rule and
returns the record of the status it confers. Strategies and the judge need no change: the payload travels in
`Observation.shadows[kind.name]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from parity.model.points import Point, mtp_site
from parity.numerics.variants import HF_RMSNORM
from parity.replay.records import Observation, PointRecord, Status

SEMANTIC, VARIANT, PRECISION = "semantic", "variant", "precision"


# ------------------------------------------------------------------------------------------------ reference targets
class ShadowPool:
    """The session's shadow reference targets, built once per configuration and released with the session."""

    def __init__(self, session) -> None:
        self.session = session
        self._built: dict[str, Any] = {}

    def target(self, key: str, make: Callable[[], Any], dtype: str | None = None):
        """The built target of configuration `key`: `make()` (unbuilt) built for the dump's config and `dtype`
        (default: the session's compute dtype)."""
        if key not in self._built:
            t = make()
            t.build(self.session.config, dtype or self.session.dtype)
            self._built[key] = t
        return self._built[key]

    def semantic(self, which: str):
        """A reference following `which` semantics ("dump" | "intended"), for classifying differences a semantic
        fork explains; None when the session's target already is that reference (no second run)."""
        s = self.session
        opts = s.fork_options(which)
        if getattr(s.target, "follows_semantics", False) and type(s.target).__name__ == "ReferenceTarget" \
                and s.target.semantic_options() == opts:
            return None
        from parity.targets.reference import ReferenceTarget

        return self.target(which, lambda: ReferenceTarget(**opts))

    def variant(self, name: str):
        """A reference computing the named variant `name` (parity.numerics.variants), otherwise following the dump's
        semantics as the session's reference does; None where none is planted for it."""
        from parity.targets.mutants import PLANT_OF_VARIANT, MutantTarget

        plant = PLANT_OF_VARIANT.get(name)
        if plant is None:
            return None
        return self.target(f"variant:{name}", lambda: MutantTarget(plant, **self.session.fork_options("dump")))

    def forks_matter(self, i: int) -> bool:
        """Whether the dump departs from the intended semantics in a way that changes layer i (its statics differ
        between the two reference configurations; MTP layers and free/isolated modes are not shadowed)."""
        s = self.session
        if not s.departures() or s.mode not in ("layer", "forced"):
            return False
        from parity.jax_ling3.spec import layer_spec

        a, b = s.fork_options("dump"), s.fork_options("intended")
        return layer_spec(s.config, i, s.dtype, **a) != layer_spec(s.config, i, s.dtype, **b)

    def fork_backward(self) -> "ForkBackward":
        """The session's lazy backward of the semantic-fork shadow (kind `semantic`, issue 33)."""
        if getattr(self, "_fork_backward", None) is None:
            self._fork_backward = ForkBackward(self.session)
        return self._fork_backward

    def high_precision(self) -> "HighPrecision":
        """The session's lazy high-precision (fp32) shadow (kind `precision`)."""
        if getattr(self, "_precision", None) is None:
            self._precision = HighPrecision(self.session)
        return self._precision

    def targets(self) -> list:
        return list(self._built.values())

    def clear(self) -> None:
        if getattr(self, "_fork_backward", None) is not None:
            self._fork_backward.release()
            self._fork_backward = None
        if getattr(self, "_precision", None) is not None:
            self._precision.release()
            self._precision = None
        self._built.clear()


# ------------------------------------------------------------------------------------------------ running beside
def layer_points(res, hidden=None) -> dict:
    """A layer_forward result's points with its `output` (and the fed `input`)."""
    pts = dict(res.points)
    pts.setdefault("output", res.output)
    if hidden is not None:
        pts.setdefault("input", hidden)
    return pts


def backward_points(res, cotangent=None) -> dict:
    """A layer_backward result as backward points: the sub-module cotangents, dL/d input as `input`, each weight
    gradient as `grad.<HF name>` (and the fed `output` cotangent, where given)."""
    pts = dict(res.points)
    pts["input"] = res.input_grad
    if cotangent is not None:
        pts["output"] = cotangent
    pts.update({f"grad.{k}": v for k, v in res.param_grads.items()})
    return pts


class Runner:
    """A shadow reference run over one layer's steps beside the target, carrying its own decode state."""

    def __init__(self, session, target, i: int, hf: dict, label: str) -> None:
        self.s, self.t, self.i, self.label, self.state = session, target, i, label, None
        session.call(f"layer {i}: load_layer ({label})", target.load_layer, i, hf)

    def run(self, phase: str, step: int, hidden, positions, forced_topk, rerun: bool = False,
            state: Any = None) -> dict:
        """This step's points. A `rerun` (forced to the reference's experts beside a plain run) starts from `state`,
        the state before the step, and leaves the carried state alone (attention state does not depend on routing)."""
        what = f"layer {self.i} {phase} step {step}: layer_forward ({self.label}{', forced routing' if rerun else ''})"
        r = self.s.call(what, self.t.layer_forward, self.i, hidden, positions, state if rerun else self.state,
                        forced_topk=forced_topk)
        if not rerun:
            self.state = r.state
        return layer_points(r, hidden)

    def close(self) -> None:
        self.t.unload_layer(self.i)


@dataclass
class StepContext:
    """One step of a layer as the strategy ran it: what the shadows are fed and what the target gave."""

    phase: str
    step: int
    hidden: np.ndarray
    positions: np.ndarray
    forced_topk: Any  # the dumped top-k when the mode forces routing, else None
    ref_topk: Any  # the dumped top-k (a forced re-run's experts)
    pts: dict  # the target's points
    forced_pts: dict | None  # the target's points of its forced re-run (routing differed), else None
    rounding: dict  # {site: RmsNormCheck} of the norms fed a dumped tensor


class LayerShadows:
    """Every shadow of layer i in `layer` / `forced` mode: loaded on construction, run by `step`, unloaded by
    `close`. `step` returns the step's payloads: `.at(site, forced)` -> {kind name: payload}."""

    def __init__(self, session, i: int, hf: dict) -> None:
        self.s, self.i, self.hf = session, i, hf
        self.forks: dict[str, Runner | None] | None = None
        if session.shadows.forks_matter(i):
            self.forks = {}
            for which in ("dump", "intended"):
                t = session.shadows.semantic(which)
                self.forks[which] = None if t is None else Runner(session, t, i, hf, f"reference, {which} semantics")
        self.variant: tuple[Any, Runner, str] | None = None  # (Variant, its runner, the point it was matched at)
        self._first = True

    def step(self, c: StepContext) -> "_Views":
        if self._first:  # the input norm of the layer's first step decides the variant shadow of the whole layer
            self._first = False
            self.variant = self._match_variant(c)
        payloads: dict[str, dict[bool, Callable[[str], Any]]] = {}
        if self.forks is not None:
            payloads[SEMANTIC] = self._run_forks(c)
        if self.variant is not None:
            payloads[VARIANT] = self._run_variant(c)
        # lazy: the high-precision shadow runs only where the judge asks (a failing point of a bf16 run)
        at = lambda site: precision_payload(self.s, Point(c.phase, c.step, self.i, site)).get(PRECISION)  # noqa: E731
        payloads[PRECISION] = {forced: at for forced in ([False, True] if c.forced_pts is not None else [False])}
        out: dict[bool, dict] = {}
        for name, by_run in payloads.items():
            for forced, at in by_run.items():
                out.setdefault(forced, {})[name] = at
        return _Views(out)

    def _run_forks(self, c: StepContext) -> dict[bool, Callable[[str], Any]]:
        forks = [d["fork"] for d in self.s.departures()]
        before = {w: (r.state if r is not None else None) for w, r in self.forks.items()}
        plain = {w: (c.pts if r is None else r.run(c.phase, c.step, c.hidden, c.positions, c.forced_topk))
                 for w, r in self.forks.items()}
        runs = {False: plain}
        # where the plain run's routing differed, the router's downstream points are judged on the forced run: their
        # semantic shadows must be forced to the same experts (else a near-tie the shadows break the other way turns
        # a semantic difference into a failure)
        if c.forced_pts is not None:
            runs[True] = {w: (c.forced_pts if r is None else r.run(c.phase, c.step, c.hidden, c.positions, c.ref_topk,
                                                                   rerun=True, state=before[w]))
                          for w, r in self.forks.items()}
        return {forced: (lambda site, p=p: {"dump": p["dump"].get(site), "intended": p["intended"].get(site),
                                            "forks": forks})
                for forced, p in runs.items()}

    def backward(self, target_points: dict) -> Callable[[str], dict]:
        """The shadow payloads of the layer's backward points: site -> {kind name: payload}. Only the semantic-fork
        shadow has a backward (issue 33): where a departing fork changes this layer, a backward point's payload
        gives both references' VJP of the layer on the same teacher-forced inputs as the target (`ForkBackward`,
        run only if the judge asks: a failing point; `target_points`, the target's backward points, stand in for
        the shadow that is the target itself), so a fork layer's cotangents and weight gradients get `semantic`
        under the same two conditions as its forward points. (The variant shadow is matched at a forward norm and
        has no backward; the precision shadow's backward payload is `precision_payload`'s.)"""
        if self.forks is None:
            return lambda site: {}
        forks = [d["fork"] for d in self.s.departures()]
        is_target = {w: r is None for w, r in self.forks.items()}
        lazy = self.s.shadows.fork_backward()
        return lambda site: {SEMANTIC: ForkBackwardPayload(lazy, self.i, site, forks, is_target, target_points)}

    def _match_variant(self, c: StepContext):
        check = c.rounding.get("input_layernorm")
        pt = Point(c.phase, c.step, self.i, "input_layernorm")
        v = matched_variant(self.s, pt, check, c.pts.get("input_layernorm"))
        t = None if v is None else self.s.shadows.variant(v.name)
        if t is None:
            return None
        return v, Runner(self.s, t, self.i, self.hf, f"reference with variant {v.name}"), pt.key()

    def _run_variant(self, c: StepContext) -> dict[bool, Callable[[str], Any]]:
        v, runner, at = self.variant
        before = runner.state
        runs = {False: runner.run(c.phase, c.step, c.hidden, c.positions, c.forced_topk)}
        if c.forced_pts is not None:  # the router's downstream points are judged on the forced run
            runs[True] = runner.run(c.phase, c.step, c.hidden, c.positions, c.ref_topk, rerun=True, state=before)
        return {forced: (lambda site, p=p: None if p.get(site) is None else
                         {"variant": v.to_dict(), "at": at, "array": p[site]})
                for forced, p in runs.items()}

    def close(self) -> None:
        for r in [*(self.forks or {}).values(), None if self.variant is None else self.variant[1]]:
            if r is not None:
                r.close()


class ForkBackward:
    """The semantic-fork shadow's backward phase (lazy; kind `semantic`): the reference following the dump's or the
    intended semantics, its VJP of layer i fed exactly what the target's was (`strategies.observe_backward_layer`:
    the dumped prefill `input`, `output` cotangent and top-k). Run when the judge first asks for a point of the layer
    (a failing backward point of a fork layer); one layer held at a time (a replay judges layers in order). Its own
    reference instances (`<which>:backward` in the pool): the judge may ask after the layer's forward shadows were
    unloaded, and must never unload a layer they still hold. The jitted VJP is shared per layer function, so they
    compile nothing new."""

    def __init__(self, session) -> None:
        self.s = session
        self.layer: int | None = None
        self.points: dict[str, dict] = {}

    def point(self, i: int, which: str, site: str) -> Any:
        if self.layer != i:
            self.layer, self.points = i, {}
        if which not in self.points:
            self.points[which] = self._run(i, which)
        return self.points[which].get(site)

    def _target(self, which: str):
        from parity.targets.reference import ReferenceTarget

        opts = self.s.fork_options(which)
        return self.s.shadows.target(f"{which}:backward", lambda: ReferenceTarget(**opts))

    def _run(self, i: int, which: str) -> dict:
        s, dump = self.s, self.s.dump
        feeds = [Point("prefill", 0, i, "input"), Point("backward", 0, i, "output")]
        if not all(dump.has(p) for p in feeds):
            return {}
        hidden, cot = dump.read(feeds[0]), dump.read(feeds[1])
        t, label = self._target(which), f"reference, {which} semantics"
        s.call(f"layer {i}: load_layer ({label}, backward)", t.load_layer, i, s.ckpt.hf_tensors(i))
        try:
            r = s.call(f"layer {i} backward: layer_backward ({label})", t.layer_backward, i, hidden,
                       np.arange(hidden.shape[1]), cot,
                       forced_topk=_dumped_topk(s, Point("prefill", 0, i, "mlp.gate.topk_idx")))
        finally:
            t.unload_layer(i)
        return backward_points(r)

    def release(self) -> None:
        self.layer, self.points = None, {}


class ForkBackwardPayload:
    """A backward point's `semantic` payload: `get("dump" | "intended")` -> that reference's array at the point (the
    target's own where the target is that reference), `get("forks")` -> the departing forks; the shadows run on the
    first `get` of an array (`ForkBackward`)."""

    def __init__(self, lazy: ForkBackward, i: int, site: str, forks: list[str], is_target: dict[str, bool],
                 target_points: dict) -> None:
        self.lazy, self.i, self.site, self.forks = lazy, i, site, forks
        self.is_target, self.target_points = is_target, target_points

    def get(self, key: str) -> Any:
        if key == "forks":
            return self.forks
        if self.is_target[key]:
            return self.target_points.get(self.site)
        return self.lazy.point(self.i, key, self.site)


class _Views:
    """A step's shadow payloads: `at(site, forced)` -> {kind name: payload} (payloads that are None left out)."""

    def __init__(self, by_run: dict[bool, dict[str, Callable[[str], Any]]]) -> None:
        self.by_run = by_run

    def at(self, site: str, forced: bool = False) -> dict:
        got = {name: f(site) for name, f in self.by_run.get(forced, {}).items()}
        return {k: v for k, v in got.items() if v is not None}


def matched_variant(s, pt: Point, check, test):
    """The named variant (parity.numerics.variants) the target's output at the RMSNorm point `pt` matches where it
    fails the rounding check, else None (also under --parity-strict-variants: no shadow then)."""
    if check is None or test is None or s.strict_variants or not s.dump.has(pt):
        return None
    rule = s.rules.rule_for(pt.site, s.mode, s.dump.dtype(pt), s.dtype)
    test = np.asarray(test)
    if rule.norm_scale_noise is None or test.dtype.name != "bfloat16":
        return None
    entry = check.check(s.dump.read(pt), test, rule.norm_scale_noise)
    if not entry.get("applied") or not entry.get("outside"):
        return None
    return check.variant(test, rule.norm_scale_noise)


def head_variant(s, hf: dict, pt: Point, check, x, test) -> dict | None:
    """Where the target's final norm is a named variant: the `variant` payload of the logits — what the reference's
    LM head gives on that variant's final norm (the judge compares the target's logits with it, as a layer's variant
    shadow does downstream of its input norm)."""
    v = matched_variant(s, pt, check, test)
    t = None if v is None else s.shadows.variant(v.name)
    if t is None:
        return None
    if getattr(t, "globals", None) is None:
        s.call(f"load_globals (reference with variant {v.name})", t.load_globals, hf)
    from parity.numerics.variants import row_scale

    x32 = np.asarray(x).astype(np.float32)
    w32 = np.asarray(hf["model.norm.weight"]).astype(np.float32)
    normed = v.fns[0](x32, w32, row_scale(x32, s.config.rms_norm_eps).astype(np.float32))
    logits = s.call(f"model {pt.phase} step {pt.step}: logits (reference with variant {v.name})", t.logits_of,
                    normed.astype(np.asarray(test).dtype))
    return {"variant": v.to_dict(), "at": pt.key(), "array": logits}


# ------------------------------------------------------------------------------------------------ the judge's side
@dataclass(frozen=True)
class Kind:
    """A shadow kind as the judge sees it: `explain(session, obs, ref, test, rule, stats)` -> the record of a failing
    point its shadow explains, else None. `stats` is the point's verdict statistics (the record's; may be added to)."""

    name: str
    explain: Callable[..., PointRecord | None]


def _explain_semantic(session, obs: Observation, ref: np.ndarray, test: np.ndarray, rule, stats: dict):
    """`semantic` where both hold, each under the point's own rule: the reference following the dump's semantics
    matches the dump here (the fork accounts for the difference), and the target matches the reference following
    the intended semantics (it implements the intended behaviour)."""
    from parity.numerics.compare import compare

    sh = obs.shadows.get(SEMANTIC)
    if not sh or obs.transform is not None:
        return None
    sd, si = sh.get("dump"), sh.get("intended")
    if sd is None or si is None:
        return None
    sd, si = np.asarray(sd), np.asarray(si)
    if sd.shape != ref.shape or si.shape != ref.shape:
        return None
    if obs.point.phase == "backward":  # a gradient is judged as one tensor (its own rule, judge.compare_gradient)
        from parity.replay.lookup import compare_gradient as compare
    if not (compare(ref, sd, rule).passed and compare(si, test, rule).passed):
        return None
    forks = ", ".join(sh.get("forks") or ["?"])
    why = (f"differs from the dump where the dump's runtime departs from the intended semantics ({forks}): the "
           "reference with the dump's semantics matches the dump here, and the target matches the reference with "
           "the intended semantics")
    return PointRecord(obs.point, Status.SEMANTIC, stats=stats, reason=why, message=f"{obs.point.key()}: {why}")


def _explain_variant(session, obs: Observation, ref: np.ndarray, test: np.ndarray, rule, stats: dict):
    """`variant` (inherited) downstream of a named variant the target matched in its layer: where the reference
    computing that variant matches the target under the point's own rule (a real error downstream still fails)."""
    from parity.numerics.compare import compare

    vs = obs.shadows.get(VARIANT)
    if vs is None or obs.rounding is not None:
        return None
    arr = np.asarray(vs["array"])
    if obs.transform is not None:  # the shadow is a reference: its array takes the dump's transform (taps.Transform)
        arr, _ = obs.transform.apply(arr, test)
    if arr.shape != test.shape or not compare(arr, test, rule).passed:
        return None
    inherited = {**vs["variant"], "inherited_from": vs["at"]}
    stats["variant"] = inherited
    why = (f"inherits the named variant {inherited['name']} ({inherited['formula']}) the target computes at "
           f"{inherited['inherited_from']}: the reference computing that variant matches the target here "
           "(counted as passing; --parity-strict-variants fails it)")
    return PointRecord(obs.point, Status.VARIANT, stats=stats, reason=why, message=f"{obs.point.key()}: {why}")




def explain(session, obs: Observation, ref: np.ndarray, test: np.ndarray, rule, stats: dict) -> PointRecord | None:
    """The record of a failing point the first shadow kind (`KINDS`) explains, else None."""
    if not obs.shadows:
        return None
    for kind in KINDS:
        rec = kind.explain(session, obs, ref, test, rule, stats)
        if rec is not None:
            return rec
    return None


def rmsnorm_variant_record(point: Point, variant, stats: dict, strict: bool) -> PointRecord | None:
    """A norm point matching a named variant directly (the rounding check's bracket): `variant`, unless strict."""
    stats["variant"] = variant.to_dict()
    if strict:
        return None
    why = (f"named variant {variant.name}: the target computes {variant.formula} where the reference "
           f"computes {HF_RMSNORM} (every element inside that formula's rounding bracket; "
           f"{variant.seen}); counted as passing (--parity-strict-variants fails it)")
    return PointRecord(point, Status.VARIANT, stats=stats, reason=why, message=f"{point.key()}: {why}")


# ------------------------------------------------------------------------------------------------ high precision
MORE_PRECISE = "more-precise-than-reference"
PRECISION_SHADOW_DTYPE = "float32"


class HighPrecision:
    """The high-precision shadow (kind `precision`, parity_anchors §6b): the reference computing in fp32 on the same
    bf16 weights (upcast exactly) and the same teacher-forced inputs as the replay — a layer fed its dumped `input` at
    every step (its own fp32 decode state carried from the dumped prefill), routing forced to the dumped top-k; its
    backward phase fed the dumped input and output cotangent; the head fed the dumped last-layer output; an MTP layer
    fed the dumped `MTP{j}/embed` and `final_norm`. Lazy: a unit (layer, MTP layer, head) is run only when one of its
    points fails (`point`), and one unit is held at a time (a replay visits them in order)."""

    def __init__(self, session) -> None:
        self.s = session
        self.unit: tuple | None = None
        self.steps: dict[tuple[str, int], dict] = {}
        self.state: Any = None
        self.grads: dict | None = None

    def _target(self):
        from parity.targets.reference import ReferenceTarget

        return self.s.shadows.target("high-precision", lambda: ReferenceTarget(**self.s.fork_options("dump")),
                                     dtype=PRECISION_SHADOW_DTYPE)

    def _hold(self, unit: tuple) -> None:
        if self.unit == unit:
            return
        t = self._target()
        self.release()
        kind, n = unit
        if kind in ("model", "mtp") and getattr(t, "globals", None) is None:
            self.s.call("load_globals (fp32 shadow)", t.load_globals, self.s.ckpt.hf_global_tensors())
        if kind == "layer":
            self.s.call(f"layer {n}: load_layer (fp32 shadow)", t.load_layer, n, self.s.ckpt.hf_tensors(n))
        elif kind == "mtp":
            self.s.call(f"MTP{n}: load_mtp (fp32 shadow)", t.load_mtp, n, self.s.ckpt.mtp_hf_tensors(n))
        self.unit = unit

    def point(self, pt: Point) -> np.ndarray | None:
        """The shadow's array at a point (None where it has none: embed, a step whose dumped inputs are absent)."""
        m = mtp_site(pt.site)
        if m is not None:
            unit, site = ("mtp", m[0]), m[1]
        elif pt.layer is None:
            unit, site = ("model", None), pt.site
        else:
            unit, site = ("layer", pt.layer), pt.site
        self._hold(unit)
        if pt.phase == "backward":
            return self._backward().get(site) if unit[0] == "layer" else None
        key = (pt.phase, pt.step)
        if unit[0] == "model":
            if key not in self.steps:
                self.steps[key] = self._head(*key)
            return self.steps[key].get(site)
        for ph, st in self.s.steps():  # a layer's steps in order: each carries the previous step's state
            if key in self.steps:
                break
            if (ph, st) not in self.steps and not self._forward(ph, st):
                return None
        return self.steps.get(key, {}).get(site)

    def isolated(self, pt: Point, inputs: dict, state: dict | None) -> np.ndarray | None:
        """The shadow's array at an isolated site (`--parity-mode isolated`): the fp32 reference's `submodule` fed the
        same dumped inputs (and dumped earlier-step state) as the target, upcast exactly to fp32 — so the shadow is
        the site's own formula without any of its internal bf16 roundings, on exactly the target's inputs."""
        n = pt.layer
        self._hold(("layer", n))
        x = {k: _upcast(v) for k, v in inputs.items()}
        st = None if state is None else {k: _upcast(v) for k, v in state.items()}
        out = self.s.call(f"layer {n} {pt.phase} step {pt.step}: submodule {pt.site} (fp32 shadow)",
                          self._target().submodule, n, pt.site, x, st)
        return None if out is None else np.asarray(out)

    def local(self, pt: Point) -> np.ndarray | None:
        """The fp32 shadow of a layer-mode point's *own* computation: the site's `submodule` fed the dump's own
        dumped inputs (as isolated mode feeds it; an alias site, e.g. `attention`, is its aliased site's tensor) —
        what the dump's value should be, up to the site's internal bf16 roundings, if the dump follows the reference's
        formula there. None where the site has no isolated form (the layer's `input`, model / MTP / backward points,
        a site whose inputs the dump lacks, a site the shadow's `submodule` does not compute)."""
        if pt.layer is None or pt.phase == "backward" or mtp_site(pt.site) is not None:
            return None
        from parity.model.points import site_of
        from parity.replay.feed import dumped_feed

        try:
            site = site_of(self.s.config, pt.layer, pt.site)
            if site.alias:
                if len(site.inputs) != 1:
                    return None
                pt = Point(pt.phase, pt.step, pt.layer, site.inputs[0])
                site = site_of(self.s.config, pt.layer, pt.site)
        except KeyError:
            return None
        if site.alias:
            return None
        inputs, state, why = dumped_feed(self.s, pt, site)
        if why is not None:
            return None
        return self.isolated(pt, inputs, state)

    def _positions(self, phase: str, step: int, T: int) -> np.ndarray:
        P = int(self.s.dump.prompt_len)
        return np.arange(T) if phase == "prefill" else np.arange(P + step - 1, P + step - 1 + T)

    def _forward(self, phase: str, step: int) -> bool:
        kind, n = self.unit
        dump, t = self.s.dump, self._target()
        if kind == "layer":
            inp = Point(phase, step, n, "input")
            if not dump.has(inp):
                return False
            hidden = dump.read(inp)
            r = self.s.call(f"layer {n} {phase} step {step}: layer_forward (fp32 shadow)", t.layer_forward, n, hidden,
                            self._positions(phase, step, hidden.shape[1]), self.state,
                            forced_topk=_dumped_topk(self.s, Point(phase, step, n, "mlp.gate.topk_idx")))
            self.state = r.state
            self.steps[(phase, step)] = layer_points(r, hidden)
            return True
        feeds = [Point(phase, step, None, f"MTP{n}/embed"), Point(phase, step, None, "final_norm")]
        if not all(dump.has(p) for p in feeds):
            return False
        emb, hidden = dump.read(feeds[0]), dump.read(feeds[1])
        r = self.s.call(f"MTP{n} {phase} step {step}: mtp_forward (fp32 shadow)", t.mtp_forward, n, emb, hidden,
                        self._positions(phase, step, hidden.shape[1]), self.state,
                        forced_topk=_dumped_topk(self.s, Point(phase, step, None, f"MTP{n}/mlp.gate.topk_idx")))
        self.state = r.state
        pts = dict(r.points)
        pts.setdefault("final_layernorm", r.output)
        out = Point(phase, step, None, f"MTP{n}/final_layernorm")
        if dump.has(out):
            pts["logits"] = self.s.call(f"MTP{n} {phase} step {step}: mtp_head (fp32 shadow)", t.mtp_head,
                                        dump.read(out))
        self.steps[(phase, step)] = pts
        return True

    def _head(self, phase: str, step: int) -> dict:
        last = Point(phase, step, self.s.config.num_hidden_layers - 1, "output")
        if not self.s.dump.has(last):
            return {}
        return dict(self.s.call(f"model {phase} step {step}: head (fp32 shadow)", self._target().head,
                                self.s.dump.read(last)))

    def _backward(self) -> dict:
        if self.grads is None:
            n, dump = self.unit[1], self.s.dump
            feeds = [Point("prefill", 0, n, "input"), Point("backward", 0, n, "output")]
            if not all(dump.has(p) for p in feeds):
                self.grads = {}
                return self.grads
            hidden, cot = dump.read(feeds[0]), dump.read(feeds[1])
            res = self.s.call(f"layer {n} backward: layer_backward (fp32 shadow)", self._target().layer_backward, n,
                              hidden, np.arange(hidden.shape[1]), cot.astype(np.float32),
                              forced_topk=_dumped_topk(self.s, Point("prefill", 0, n, "mlp.gate.topk_idx")))
            self.grads = backward_points(res)
        return self.grads

    def release(self) -> None:
        """Unload the held unit (the shadow's target stays built)."""
        if self.unit is not None:
            t = self._target()
            kind, n = self.unit
            if kind == "layer":
                t.unload_layer(n)
            elif kind == "mtp":
                t.unload_mtp(n)
        self.unit, self.steps, self.state, self.grads = None, {}, None, None


def _dumped_topk(s, p: Point):
    return s.dump.read(p).astype(np.int32) if s.dump.has(p) else None


def _upcast(a: Any) -> Any:
    """A floating array (bf16 or fp32) as fp32, exactly; anything else (token positions, expert ids) unchanged."""
    arr = np.asarray(a)
    return arr.astype(np.float32) if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else a


class IsolatedPrecisionPayload:
    """What an isolated observation carries for the `precision` kind: the point, what it was fed, and the session's
    lazy shadow (run only if the judge asks: a failing point)."""

    def __init__(self, shadow: "HighPrecision", point: Point, inputs: dict, state: dict | None) -> None:
        self.shadow, self.point, self.inputs, self.state = shadow, point, inputs, state

    def array(self) -> np.ndarray | None:
        return self.shadow.isolated(self.point, self.inputs, self.state)

    def local(self) -> np.ndarray | None:
        """The site's own fp32 computation on the dump's inputs: in isolated mode that is `array` itself (its dump
        peak is already local), so None here."""
        return None


def isolated_precision_payload(session, point: Point, inputs: dict, state: dict | None) -> dict:
    """The `precision` payload of a layer site in `isolated` mode ({} for a dump not computed in bf16)."""
    if session.mode != "isolated" or session.dtype != "bfloat16":
        return {}
    return {PRECISION: IsolatedPrecisionPayload(session.shadows.high_precision(), point, inputs, state)}


class PrecisionPayload:
    """What an observation carries for the `precision` kind: the point, and the session's lazy shadow."""

    def __init__(self, shadow: HighPrecision, point: Point) -> None:
        self.shadow, self.point = shadow, point

    def array(self) -> np.ndarray | None:
        return self.shadow.point(self.point)

    def local(self) -> np.ndarray | None:
        """The fp32 shadow of the point's own computation on the dump's inputs (`HighPrecision.local`): the dump-peak
        guard's reference in layer mode where the site has one."""
        return self.shadow.local(self.point)


def precision_payload(session, point: Point) -> dict:
    """The `precision` payload of a point in `layer` / `forced` mode, and of the model points (`final_norm`,
    `logits`: the head fed the dumped last-layer output, as in those modes) in `isolated` mode ({} elsewhere, and
    for a dump not computed in bf16): the shadow is run only if the judge asks (a point that fails)."""
    if session.dtype != "bfloat16":
        return {}
    if session.mode not in ("layer", "forced") and not (session.mode == "isolated" and point.layer is None
                                                         and mtp_site(point.site) is None):
        return {}
    return {PRECISION: PrecisionPayload(session.shadows.high_precision(), point)}


def l2_error(a: np.ndarray, shadow: np.ndarray) -> float:
    """||a − shadow||₂ in float64 over the elements where the shadow is finite (a non-finite `a` there: inf)."""
    h = np.asarray(shadow).astype(np.float64)
    x = np.asarray(a).astype(np.float32).astype(np.float64)
    fin = np.isfinite(h)
    d = x[fin] - h[fin]
    return float(np.sqrt(np.sum(d * d))) if np.isfinite(d).all() else float("inf")


def dump_peak(ref: np.ndarray, shadow: np.ndarray) -> float:
    """The dump's peak error against the shadow, in units of the shadow's row RMS (rows: the last axis):
    max |dump − shadow| / RMS(shadow row) over the elements where the shadow is finite (a non-finite dump there: inf).
    Rounding spreads a small error over every element; an edited or wrong dump concentrates a large one somewhere
    (a 15 % edit of three channels: 0.3 of the row RMS where bf16 rounding gives ~0.01) — which the L2 norm of the
    ratio dilutes."""
    h = np.asarray(shadow).astype(np.float64)
    d = np.asarray(ref).astype(np.float32).astype(np.float64)
    if h.ndim == 0:
        h, d = h.reshape(1), d.reshape(1)
    fin = np.isfinite(h)
    hz = np.where(fin, h, 0.0)
    rms = np.sqrt(np.mean(hz * hz, axis=-1, keepdims=True))
    rms = np.where(rms > 0, rms, 1.0)  # an all-zero row: absolute error
    err = np.abs(np.where(fin, d - hz, 0.0)) / rms
    if not np.isfinite(err).all():
        return float("inf")
    return float(err.max()) if err.size else 0.0


def _bf16_fraction(a: np.ndarray) -> float:
    """The fraction of the finite non-zero elements that are exactly bf16 values."""
    import ml_dtypes

    x = np.asarray(a).astype(np.float32)
    x = x[np.isfinite(x) & (x != 0)]
    if x.size == 0:
        return 0.0
    return float(np.mean(x.astype(ml_dtypes.bfloat16).astype(np.float32) == x))


def on_coarser_grid(ref: np.ndarray, test: np.ndarray) -> bool:
    """Whether the target's values lie on the bf16 grid at a point the dump keeps in fp32 (HF's fp32 KDA gate, beta,
    state of a bf16 run, facts §3.5): a target that rounded there to bf16 lost precision, whatever its L2 ratio —
    it cannot be more precise than the reference. (An fp32 value is a bf16 value by chance with probability
    2^-16; ≥ 99 % of the target's elements on that grid where < 50 % of the dump's are is a rounding.)"""
    if np.asarray(ref).dtype != np.float32:
        return False
    return _bf16_fraction(test) >= 0.99 and _bf16_fraction(ref) < 0.5


def precision_entry(ref: np.ndarray, test: np.ndarray, shadow: np.ndarray, allowed: float | None,
                    allowed_peak: float | None = None, local: np.ndarray | None = None,
                    allowed_local_peak: float | None = None) -> dict:
    """The report entry of the three-way verdict: the target's and the dump's error against the shadow (rel-L2 to
    the shadow's norm), their ratio and the allowed ratio; the dump's peak error against the shadow (`dump_peak`,
    in row RMS) and its ceiling; whether the target rounded to a coarser grid than the dump's (`coarser_grid`).
    `more_precise` where ratio ≤ allowed, the dump's own error looks like rounding (peak ≤ its ceiling: a dump
    edited or computed by another formula is the disagreement, not a more precise target) and the target kept the
    dump's grid.

    `local` (layer mode, where the site has an isolated form): the fp32 shadow of the site's own computation on the
    dump's own inputs (`HighPrecision.local`). The guard then asks whether the dump departs from the formula *at
    this site* — `local_dump_peak` = dump_peak(dump, local) ≤ `allowed_local_peak` (the site's isolated-mode ceiling,
    calibrated on exactly that quantity) — instead of bounding `dump_peak`, which in layer mode also holds every
    error the dump inherited from earlier sites: a near-cancelling row (a KDA core row at 0.5 % of the tensor's RMS)
    carries an inherited rounding error of 2.7× its own RMS, and the per-head o_norm scales it up to 3.4× (the
    tiny-flash goldens under XLA's defaults). `dump_peak` stays in the entry for the record."""
    e_t, e_d = l2_error(test, shadow), l2_error(ref, shadow)
    norm = l2_error(np.zeros_like(np.asarray(shadow, np.float32)), shadow) or 1.0
    ratio = 0.0 if e_t == 0 else (float("inf") if e_d == 0 else e_t / e_d)
    peak = dump_peak(ref, shadow)
    coarser = on_coarser_grid(np.asarray(ref), np.asarray(test))
    entry = {"shadow": PRECISION_SHADOW_DTYPE, "error": e_t / norm, "dump_error": e_d / norm, "ratio": ratio,
             "allowed_ratio": allowed, "dump_peak": peak, "allowed_dump_peak": allowed_peak, "coarser_grid": coarser}
    peak_ok = allowed_peak is None or peak <= allowed_peak
    if local is not None and np.shape(local) == np.shape(ref) and allowed_local_peak is not None:
        lp = dump_peak(ref, local)
        entry.update(local_dump_peak=lp, allowed_local_dump_peak=allowed_local_peak)
        peak_ok = lp <= allowed_local_peak
    entry["more_precise"] = allowed is not None and ratio <= allowed and not coarser and peak_ok
    return entry


def refusal(entry: dict) -> str:
    """Why the three-way verdict refused a point (the report's words), '' where it accepted it."""
    if entry["more_precise"]:
        return ""
    if entry["coarser_grid"]:
        return "the target rounds to bf16 where the dump keeps fp32: less precise"
    if "rounding_formula" in entry and entry["rounding_formula"] is None:
        return ("its elements leave the bracket of every RMSNorm formula with fewer bf16 roundings (HF's or the "
                "single-rounding one, on the bf16 or the unrounded input): not a rounding difference")
    if "local_dump_peak" in entry:
        if entry["local_dump_peak"] > entry["allowed_local_dump_peak"]:
            return (f"the dump departs from the reference's formula at this site: its error against the fp32 site "
                    f"fed the dump's own inputs peaks at {entry['local_dump_peak']:.3g}× the row RMS, beyond "
                    f"rounding (≤ {entry['allowed_local_dump_peak']:g}): the disagreement is not precision")
    elif entry["allowed_dump_peak"] is not None and entry["dump_peak"] > entry["allowed_dump_peak"]:
        return (f"the dump's own error against the fp32 shadow peaks at {entry['dump_peak']:.3g}× the row RMS, beyond "
                f"rounding (≤ {entry['allowed_dump_peak']:g}): the disagreement is not precision")
    if entry["allowed_ratio"] is None:
        return "no precision ratio for this site"
    return (f"less precise: error vs the fp32 shadow {entry['ratio']:.3g}× the dump's, allowed ≤ "
            f"{entry['allowed_ratio']:g}")


def _local_shadow(session, obs: Observation, payload, test: np.ndarray) -> tuple[np.ndarray | None, float | None]:
    """Layer mode: the fp32 shadow of the point's own computation on the dump's inputs (`PrecisionPayload.local`,
    in the dump's transform like the shadow) and its ceiling — the site's isolated-mode `precision_dump_peak`
    (calibrated on that very quantity: the isolated walk of the precision corpus); (None, None) where the site has
    no isolated form or no isolated ceiling (the guard then bounds the layer shadow's peak, as before)."""
    get = getattr(payload, "local", None)
    if get is None or session.mode == "isolated":
        return None, None
    from parity.replay.lookup import rule_site

    pt = obs.point
    if not session.dump.has(pt):
        return None, None
    allowed = session.rules.value_for("precision_dump_peak", rule_site(pt), "isolated", session.dump.dtype(pt),
                                      session.dtype)
    if allowed is None:
        return None, None
    arr = get()
    if arr is None:
        return None, None
    arr = np.asarray(arr)
    if obs.transform is not None:
        arr, _ = obs.transform.apply(arr, test)
    return (arr, float(allowed)) if arr.shape == test.shape else (None, None)


def _explain_precision(session, obs: Observation, ref: np.ndarray, test: np.ndarray, rule, stats: dict):
    """`variant` more-precise-than-reference (the three-way verdict, parity_anchors §6b): a bf16 point that fails
    against the dump (HF bf16) but whose error against the fp32 shadow is no worse than `precision_ratio` × the dump's
    own error against it — the target keeps more precision than the reference (e.g. XLA's default excess precision
    skipping f32→bf16→f32 round trips). A target less precise than the dump still fails, the entry saying by how
    much. Off under --parity-strict-variants and where the rule sets no ratio."""
    h = obs.shadows.get(PRECISION)
    if h is None or ref.dtype.kind != "f" and ref.dtype.name != "bfloat16" or rule.precision_ratio is None:
        return None
    if getattr(session, "strict_variants", False):
        return None
    arr = h.array()
    if arr is None:
        return None
    arr = np.asarray(arr)
    if obs.transform is not None:  # the shadow is a reference: its array takes the dump's transform
        arr, _ = obs.transform.apply(arr, test)
    if arr.shape != test.shape:
        return None
    local, local_peak = _local_shadow(session, obs, h, test)
    entry = precision_entry(ref, test, arr, rule.precision_ratio, rule.precision_dump_peak, local, local_peak)
    rounding = stats.get("rounding") or {}
    if rounding.get("applied") and rounding.get("outside") and obs.rounding is not None:
        # an RMSNorm fed dumped rows whose rounding check failed: more precise only if one formula with fewer bf16
        # roundings gives every element (guard `rounding_formula`); the L2 ratio cannot see an epsilon that flips 3
        # of 768 elements (ratio ~1, as a correct port's), the bracket can
        entry["rounding_formula"] = obs.rounding.fewer_roundings(test, rule.norm_scale_noise)
        entry["more_precise"] = entry["more_precise"] and entry["rounding_formula"] is not None
    stats["precision"] = entry
    if not entry["more_precise"]:
        return None
    stats["variant"] = PRECISION_VARIANT
    why = (f"more precise than the reference: fails against the dump, but its error against the fp32 shadow "
           f"(rel-L2 {entry['error']:.3g}) is {entry['ratio']:.3g}× the dump's own ({entry['dump_error']:.3g}), "
           f"allowed ≤ {rule.precision_ratio:g} (counted as passing; --parity-strict-variants fails it)")
    return PointRecord(obs.point, Status.VARIANT, stats=stats, reason=why, message=f"{obs.point.key()}: {why}")


PRECISION_VARIANT = {"name": MORE_PRECISE, "formula": "the reference's formula with fewer bf16 roundings",
                     "seen": "XLA's default xla_allow_excess_precision=true (skips f32→bf16→f32 round trips); "
                             "kernels keeping fp32 intermediates"}


KINDS: tuple[Kind, ...] = (Kind(SEMANTIC, _explain_semantic), Kind(VARIANT, _explain_variant),
                           Kind(PRECISION, _explain_precision))
