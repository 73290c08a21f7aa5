"""`isolated` replay (DESIGN §6): every sub-module of a layer fed the *dumped* tensors it consumed.

In `layer` mode a 1-ULP difference in `input_layernorm` reaches `q_proj` and shows up there as many ULPs at
cancellation-small elements; here `q_proj` is fed the dumped `input_layernorm`, so each record measures that one
module's own error and a bug is pinned to exactly the site that has it (its neighbours are fed the reference's
tensors, not the buggy ones).

What each site is fed (`feeds`) follows the dataflow graph of `parity.points` (`_KDA_INPUTS` / `_MLA_INPUTS` /
`MLP_INPUTS`), with these refinements:
- decode steps also get the dumped state of *earlier* steps (`Target.submodule(state=...)`): KDA conv histories and
  recurrent state of the previous step; MLA `attention.core` the dumped `kv_b_proj` / `kv_a_proj_with_mqa` of every
  earlier token (the reference caches expanded per-head K/V, facts §9), so decode `core` is isolated too;
- the routing sites are fed the reference's choice: `mlp.gate.topk_idx` ← dumped logits (+ the checkpoint's
  expert_bias), judged as a routing comparison (`replay.routing_records`, sets per token, near-ties benign);
  `mlp.gate.topk_weight` ← dumped logits + dumped ids; `mlp.routed` ← dumped ids and weights;
- `input`, `attention` (it *is* the `o_proj` / `dense` output) and a dense layer's `mlp` (it is `mlp.down_proj`)
  have no computation of their own: they are recorded as `skipped` with that reason (`PASS_THROUGH`), never
  compared against themselves.
Tolerances are looked up with mode "isolated" (`RulesTable.rule_for(site, "isolated", ...)`).
"""

from __future__ import annotations

import numpy as np

from parity.points import MLP_INPUTS, Point, sites_for_config

MODE = "isolated"

# Sites that are another site's tensor under a second name, or the fed input itself.
PASS_THROUGH = {
    "input": "the layer's input is what the layer is fed, not computed",
    "attention": "the attention block output is the `attention.o_proj` / `attention.dense` output itself",
    "mlp": "a dense layer's `mlp` output is the `mlp.down_proj` output itself",  # MoE `mlp` = routed + shared
}

_KDA_FEEDS = {
    "input_layernorm": ("input",),
    **{f"attention.{p}": ("input_layernorm",) for p in ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj")},
    "attention.q_conv1d": ("attention.q_proj",),
    "attention.k_conv1d": ("attention.k_proj",),
    "attention.v_conv1d": ("attention.v_proj",),
    "attention.conv_state": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "attention.gate": ("attention.f_proj",),
    "attention.beta": ("attention.b_proj",),
    "attention.core": ("attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.gate",
                       "attention.beta"),
    "attention.state": ("attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.gate",
                        "attention.beta"),
    "attention.o_norm": ("attention.core", "attention.g_proj"),
    "attention.o_proj": ("attention.o_norm",),
}
_MLA_FEEDS = {
    "input_layernorm": ("input",),
    "attention.q_a_proj": ("input_layernorm",),
    "attention.q_a_layernorm": ("attention.q_a_proj",),
    "attention.q_b_proj": ("attention.q_a_layernorm",),
    "attention.q_proj": ("input_layernorm",),
    "attention.kv_a_proj_with_mqa": ("input_layernorm",),
    "attention.kv_a_layernorm": ("attention.kv_a_proj_with_mqa",),
    "attention.kv_b_proj": ("attention.kv_a_layernorm",),
    "attention.g_proj": ("input_layernorm",),
    "attention.gate": ("attention.g_proj",),
    "attention.dense:in": ("attention.core", "attention.gate"),
    "attention.dense": ("attention.dense:in",),
}
_MLP_FEEDS = MLP_INPUTS  # the MLP sites are fed exactly what they are computed from
# Dumped tensors of earlier decode steps a site needs (see `Target.submodule`).
_KDA_STATE = {"attention.q_conv1d": ("attention.conv_state",), "attention.k_conv1d": ("attention.conv_state",),
              "attention.v_conv1d": ("attention.conv_state",), "attention.conv_state": ("attention.conv_state",),
              "attention.core": ("attention.state",), "attention.state": ("attention.state",)}
_MLA_HISTORY = ("attention.kv_b_proj", "attention.kv_a_proj_with_mqa")


def feeds(kind: str, moe: bool, q_lora: bool, site: str) -> tuple[str, ...] | None:
    """Dumped sites (same phase/step) `site` is fed in isolated mode; None for a pass-through site."""
    if site in PASS_THROUGH and not (site == "mlp" and moe):
        return None
    if site == "mlp":
        return ("mlp.routed", "mlp.shared_experts")
    if kind == "mla" and site == "attention.core":
        q = ("attention.q_b_proj",) if q_lora else ("attention.q_proj",)
        return q + _MLA_HISTORY
    table = _KDA_FEEDS if kind == "kda" else _MLA_FEEDS
    out = table.get(site) or _MLP_FEEDS.get(site)
    if out is None:
        raise KeyError(f"isolated replay: no feed defined for site {site!r} of a {kind} layer")
    return out


def isolated_sites(cfg, i: int) -> tuple[str, ...]:
    """Sites of layer i in execution order, as the layer replay lists them (MLA adds `attention.dense:in`)."""
    return sites_for_config(cfg, i) + (("attention.dense:in",) if cfg.layer_kind(i) == "mla" else ())


def replay_isolated(ctx, i: int) -> list[dict]:
    """Isolated replay of layer i over the dump's prefill and decode steps: one record per site per step, made by
    `replay.compare_point` (or `replay.routing_records` for the top-k ids), with `ctx.mode == "isolated"`."""
    from parity.replay import _steps, compare_point

    cfg = ctx.dump.config
    kind, moe = cfg.layer_kind(i), cfg.is_moe(i)
    hf = ctx.ckpt.hf_tensors(i)
    ctx.target.load_layer(i, hf)
    bias = hf.get(f"model.layers.{i}.mlp.gate.expert_bias")
    bias = None if bias is None else np.asarray(bias, np.float64)
    supported = "isolated" in getattr(ctx.target, "capabilities", ())
    P = int(ctx.dump.prompt_len)
    records: list[dict] = []
    prev: tuple[str, int] | None = None  # the previous (phase, step): whose dumped state a decode step continues
    history: list[tuple[str, int]] = []  # every earlier (phase, step): MLA K/V of all earlier tokens
    try:
        for phase, step in _steps(ctx.dump):
            T = _step_len(ctx.dump, phase, step, i)
            positions = np.arange(T) if phase == "prefill" else np.arange(P + step - 1, P + step - 1 + T)
            outs: dict[str, np.ndarray] = {}
            for site in isolated_sites(cfg, i):
                pt = Point(phase, step, i, site)
                need = feeds(kind, moe, cfg.q_lora, site)
                if need is None:
                    records.append(_skip(pt, f"isolated: {PASS_THROUGH[site]}"))
                    continue
                if not supported:
                    records.append(_skip(pt, f"target {ctx.target.name} has no isolated sub-modules"))
                    continue
                if not ctx.dump.has(pt):  # compare_point says skipped (declared unavailable) or missing
                    records.append(compare_point(ctx, pt, None))
                    continue
                inputs, why = _read(ctx.dump, [Point(phase, step, i, s) for s in need])
                state = None
                if why is None and phase == "decode":
                    state, why = _state(ctx.dump, kind, site, i, prev, history)
                if why is not None:
                    records.append(_skip(pt, f"isolated: {why}"))
                    continue
                if kind == "mla" and site == "attention.core":
                    inputs["positions"] = positions
                test = ctx.target.submodule(i, site, inputs, state)
                if test is not None:
                    outs[site] = np.asarray(test)
                if site == "mlp.gate.topk_idx" and test is not None and bias is not None:
                    from parity.replay import routing_records

                    rec, _ = routing_records(ctx, pt, test, outs.get("mlp.gate.logits"), bias, cfg)
                else:
                    rec = compare_point(ctx, pt, test)
                rec["isolated_inputs"] = list(need)
                records.append(rec)
            prev = (phase, step)
            history.append((phase, step))
    finally:
        ctx.target.unload_layer(i)
    return records


def _skip(pt: Point, reason: str) -> dict:
    return {"phase": pt.phase, "step": pt.step, "layer": pt.layer, "site": pt.site, "status": "skipped",
            "reason": reason}


def _step_len(dump, phase: str, step: int, i: int) -> int:
    p = Point(phase, step, i, "input")
    if dump.has(p):
        return int(dump.read(p).shape[1])
    return int(dump.prompt_len) if phase == "prefill" else 1


def _read(dump, points: list[Point]) -> tuple[dict[str, np.ndarray], str | None]:
    out = {}
    for p in points:
        if not dump.has(p):
            return out, f"its input {p.key()} is not in the dump"
        out[p.site] = dump.read(p)
    return out, None


def _state(dump, kind: str, site: str, i: int, prev, history) -> tuple[dict | None, str | None]:
    """Dumped tensors of earlier steps this decode-step site continues from (None when it needs none)."""
    if kind == "kda":
        names = _KDA_STATE.get(site)
        if not names:
            return None, None
        if prev is None:
            return None, "a decode step with no earlier step in the dump"
        return _read(dump, [Point(prev[0], prev[1], i, s) for s in names])
    if site != "attention.core":
        return None, None
    out = {}
    for s in _MLA_HISTORY:
        parts, why = [], None
        for ph, st in history:
            got, why = _read(dump, [Point(ph, st, i, s)])
            if why:
                return None, why
            parts.append(got[s])
        if not parts:
            return None, "a decode step with no earlier step in the dump"
        out[s] = np.concatenate(parts, axis=1)
    return out, None


# ------------------------------------------------------------------------------------------------ noise measurement
# Site classes for the isolated-mode noise table (the numbers the tolerance rules for mode "isolated" are set from).
SITE_CLASSES = {
    "norm": ("input_layernorm", "post_attention_layernorm", "attention.q_a_layernorm", "attention.kv_a_layernorm"),
    "proj": ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.f_proj", "attention.b_proj",
             "attention.g_proj", "attention.o_proj", "attention.q_a_proj", "attention.q_b_proj",
             "attention.kv_a_proj_with_mqa", "attention.kv_b_proj", "attention.dense", "mlp.gate_proj",
             "mlp.up_proj"),
    "conv": ("attention.q_conv1d", "attention.k_conv1d", "attention.v_conv1d", "attention.conv_state"),
    "kda_gate_beta": ("attention.gate", "attention.beta"),
    "kda_core_state": ("attention.core@kda", "attention.state"),
    "kda_o_norm": ("attention.o_norm",),
    "mla_core": ("attention.core@mla",),
    "mla_gate": ("attention.gate@mla", "attention.dense:in"),
    "swiglu_down": ("mlp.down_proj", "mlp.shared_experts", "mlp.routed"),
    "router": ("mlp.gate.logits", "mlp.gate.topk_weight"),
    "residual_add": ("mlp", "output"),
}


def site_class(site: str, kind: str) -> str:
    for name in (f"{site}@{kind}", site):  # kind-qualified entries first (MLA `attention.gate` is not KDA's)
        for cls, sites in SITE_CLASSES.items():
            if name in sites:
                return cls
    return "other"


def noise_table(records: list[dict], cfg) -> dict[str, dict]:
    """Per site class over compared records: n points, worst max ULP before / after the floor, worst fraction of
    elements not bit-exact (> 1/2 ULP) and > 1 ULP, worst min_passing_max_ulps / min_passing_hard_ulps, fails."""
    out: dict[str, dict] = {}
    for r in records:
        if r.get("layer") is None or r.get("max_ulp_raw") is None:
            continue
        cls = site_class(r["site"], cfg.layer_kind(r["layer"]))
        t = out.setdefault(cls, {"points": 0, "fail": 0, "max_ulp_raw": 0, "max_ulp": 0, "frac_not_exact": 0.0,
                                 "frac_gt1_ulp": 0.0, "min_passing_max_ulps": 0, "min_passing_hard_ulps": 0,
                                 "worst": None})
        t["points"] += 1
        t["fail"] += r["status"] == "fail"
        if (r["max_ulp"] or 0) > t["max_ulp"] or t["worst"] is None:
            t["worst"] = f"{r['phase']}/{r['step']}/L{r['layer']:02d}/{r['site']}"
        t["max_ulp_raw"] = max(t["max_ulp_raw"], r["max_ulp_raw"] or 0)
        t["max_ulp"] = max(t["max_ulp"], r["max_ulp"] or 0)
        t["frac_not_exact"] = max(t["frac_not_exact"], 1.0 - (r["frac_exact"] or 0.0))
        t["frac_gt1_ulp"] = max(t["frac_gt1_ulp"], 1.0 - (r["frac_le1_ulp"] or 0.0))
        for k in ("min_passing_max_ulps", "min_passing_hard_ulps"):
            t[k] = max(t[k], r.get(k) or 0)
    return out


def measurement_rules():
    """Default rules with every `isolated` lookup replaced by a measuring rule: floor 1 ULP of the row RMS, 1 ULP
    allowed on <= 0.1 % (so `min_passing_max_ulps` / `min_passing_hard_ulps` are the noise), fp32 tensors of bf16 runs
    on the bf16 grid, fp32 runs on the fp32 grid. For measuring only: it never becomes a default."""
    from parity.numerics.tolerances import default_rules, parse_override

    common = "floor_ulps=1,max_ulps=1,allowed_fraction=0.001,hard_ulps=off,rtol=off,atol=off"
    rules = default_rules()
    for text in (f"*:{MODE}:bfloat16:{common},compare_dtype=off",
                 f"*:{MODE}:float32:{common},compare_dtype=bfloat16",
                 f"*:{MODE}:float32:compute=float32,{common},compare_dtype=off"):  # merged last = looked up first
        rules = rules.merged(parse_override(text))
    return rules


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.isolated DUMP.h5 ...`: isolated replay of each dump, status counts and the noise table."""
    import argparse
    import collections

    from parity.dumpfile import DumpReader
    from parity.replay import run_replay

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--layers", default=None, help="e.g. 0,3")
    ap.add_argument("--measure", action="store_true", help="judge with `measurement_rules()` (floor 1 ULP)")
    a = ap.parse_args(argv)
    layers = None if a.layers is None else [int(x) for x in a.layers.split(",")]
    for path in a.dumps:
        with DumpReader(path) as d:
            cfg, dt = d.config, d.meta.get("compute_dtype")
        rep = run_replay(path, mode=MODE, layers=layers, rules=measurement_rules() if a.measure else None)
        counts = collections.Counter(r["status"] for r in rep["points"])
        print(f"{path} ({dt}): {dict(counts)}")
        print(f"  {'class':16s} {'pts':>4s} {'fail':>4s} {'rawmax':>7s} {'max':>5s} {'!exact':>8s} {'>1ulp':>8s} "
              f"{'mp_max':>6s} {'mp_hard':>7s}  worst")
        for cls, t in sorted(noise_table(rep["points"], cfg).items()):
            print(f"  {cls:16s} {t['points']:4d} {t['fail']:4d} {t['max_ulp_raw']:7d} {t['max_ulp']:5d} "
                  f"{t['frac_not_exact']:8.4f} {t['frac_gt1_ulp']:8.4f} {t['min_passing_max_ulps']:6d} "
                  f"{t['min_passing_hard_ulps']:7d}  {t['worst']}")
        for r in rep["points"]:
            if r["status"] in ("fail", "missing"):
                print(f"  {r['status'].upper()} {r['phase']}/{r['step']}/L{r['layer']}/{r['site']}: "
                      f"max {r.get('max_ulp')} ULP, worst {r.get('worst_index')} ref {r.get('worst_ref')} "
                      f"test {r.get('worst_test')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
