"""First divergence and the reports (DESIGN §8): report.json (minimal contract), report.md, self-contained report.html.

A report covers one (dump, target, mode). Its input is a list of point records — one dict per compared point with
`phase, step, layer, site, status` (`pass|fail|missing|skipped|benign|semantic|not-tested`) and the verdict statistics of
`parity.numerics` (`max_ulp`, `p99_ulp`, `rel_l2`, `cosine`, `worst_index`, `worst_ref`, `worst_test`, ...).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Iterable

from parity.model.points import Point, mtp_site, point_inputs, sites_for_config
from parity.provenance import kernels_line, markdown_section
from parity.replay.environment import env_line, markdown_section as env_markdown
from parity.replay.matmul_policy import FIX as _DOT_FIX, summary as dot_precision_summary

SCHEMA = "ling3-parity-report"
VERSION = 1
FAILING = ("fail",)
_DOT_WHAT = "fails on fp32 like a reference whose fp32 dots run one bf16 pass"


def _site_rank(cfg, layer: int | None, site: str) -> int:
    if layer is None and (m := mtp_site(site)) is not None:  # an MTP layer's site: its execution order
        from parity.model.mtp_points import mtp_sites

        order = mtp_sites(cfg, recorded_inputs=True)
        return order.index(m[1]) if m[1] in order else len(order)
    if layer is None:
        return {"embed": 0, "final_norm": 1, "logits": 2}.get(site, 3)
    sites = sites_for_config(cfg, layer)
    base = site.removesuffix(":in")
    if base in sites:
        # a module's input comes just before the module's output
        return 2 * sites.index(base) + (0 if site.endswith(":in") else 1)
    return 2 * len(sites) + 1


def _family_graph(cfg):
    """A family's site graph given in place of a Ling3 config (`parity.model.kimi_family.KimiGraph`: `layer_rank`,
    `site_rank`, `backward_rank`, `point_inputs`), else None: Ling3's, read from its config and `parity.model.points`."""
    return cfg if all(hasattr(cfg, a) for a in ("layer_rank", "site_rank", "backward_rank", "point_inputs")) else None


def order_key(cfg, rec: dict) -> tuple:
    """Execution order (DESIGN §6): phase, step, layer (embed first, final_norm/logits last), site order of §3.
    `cfg`: a Ling3 config, or another family's site graph (`_family_graph`)."""
    layer = rec.get("layer")
    if (g := _family_graph(cfg)) is not None:
        if rec["phase"] == "backward":
            return (2, 0) + g.backward_rank(layer, rec["site"])
        return (0 if rec["phase"] == "prefill" else 1, rec.get("step", 0), g.layer_rank(layer, rec["site"]),
                g.site_rank(layer, rec["site"]))
    if layer is None and (m := mtp_site(rec["site"])) is not None:
        lay = 10**6 + 1 + m[0]  # MTP layers run after the main stack's head, in order
    elif layer is None:
        lay = -1 if rec["site"] == "embed" else 10**6
    else:
        lay = layer
    if rec["phase"] == "backward":
        return (2, 0) + _backward_rank(cfg, layer, rec["site"])
    return (0 if rec["phase"] == "prefill" else 1, rec.get("step", 0), lay, _site_rank(cfg, layer, rec["site"]))


def _backward_rank(cfg, layer: int | None, site: str) -> tuple:
    """Execution order of the backward pass (issue 26), after the forward: the loss's logits cotangent, the head, the
    layers last to first — each from its `output` cotangent back to its `input`, a weight gradient right after its
    module's output cotangent — then the embedding."""
    from parity.model.points import BACKWARD_MODEL_SITES, grad_param_site

    if layer is None and (m := mtp_site(site)) is not None:
        return _mtp_backward_rank(cfg, m[0], m[1])
    if layer is None:
        head = ("logits", "grad.lm_head.weight", "final_norm", "grad.model.norm.weight", "final_norm:in")
        if site in head:
            return (-10**6, head.index(site), 0)
        return (10**6, BACKWARD_MODEL_SITES.index(site) if site in BACKWARD_MODEL_SITES else 99, 0)
    if site.startswith("grad."):
        src = grad_param_site(cfg, layer, site[len("grad."):])
        return (-layer, -_site_rank(cfg, layer, src) if src else 1, 1)
    return (-layer, -_site_rank(cfg, layer, site), 0)


def _mtp_backward_rank(cfg, j: int, site: str) -> tuple:
    """An MTP layer's backward points (issue 33) come first: its loss term is the last computation of the forward
    (facts §2), and the main head's `final_norm` cotangent takes its `hnorm:in`. Within the layer, from its logits'
    cotangent back to `embed`, a weight gradient right after its module's output cotangent."""
    from parity.model.mtp_points import mtp_backward_sites
    from parity.model.points import grad_param_site

    order = [s for s in mtp_backward_sites(cfg) if not s.startswith("grad.")]
    if site.startswith("grad."):
        param = site[len("grad."):]
        src = grad_param_site(cfg, cfg.num_hidden_layers, param) or param.removesuffix(".weight")
        return (-2 * 10**6 - j, -order.index(src) if src in order else 1, 1)
    return (-2 * 10**6 - j, -order.index(site) if site in order else 1, 0)


def _pt(rec: dict) -> Point:
    return Point(rec["phase"], rec.get("step", 0), rec.get("layer"), rec["site"])


def first_divergence(cfg, records: list[dict]) -> dict | None:
    """The first failing point in execution order, with its *source*: the first failing point whose own inputs all
    pass (or were not compared). "The error starts at L03 attention.core; everything after it inherits it"."""
    ordered = sorted(records, key=lambda r: order_key(cfg, r))
    failing = [r for r in ordered if r.get("status") in FAILING]
    if not failing:
        return None
    status = {_pt(r): r.get("status") for r in records}
    source = None
    g = _family_graph(cfg)
    for r in failing:
        ins = g.point_inputs(_pt(r)) if g is not None else point_inputs(cfg, _pt(r))
        if not any(status.get(p) in FAILING for p in ins):
            source = r
            break
    source = source or failing[0]
    first = dict(failing[0])
    first["source"] = {k: source.get(k) for k in ("phase", "step", "layer", "site")}
    first["source"].update({k: source.get(k) for k in ("max_ulp", "p99_ulp", "rel_l2", "worst_index", "dtype")
                            if k in source})
    return first


def build_report(cfg, records: list[dict], *, dump: str, target: str, mode: str, extra: dict | None = None) -> dict:
    ordered = sorted(records, key=lambda r: order_key(cfg, r))
    fd = first_divergence(cfg, ordered)
    counts: dict[str, int] = {}
    for r in ordered:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    rep = {
        "schema": SCHEMA,
        "version": VERSION,
        "dump": dump,
        "target": target,
        "mode": mode,
        "passed": fd is None and counts.get("missing", 0) == 0,
        "counts": counts,
        "counts_by_phase": _phase_counts(ordered),
        "first_divergence": fd,
        "variants": variants_summary(ordered),
        # failing points the dot-precision shadow explains (parity.replay.dot_precision; None: none compared)
        "dot_precision": dot_precision_summary(ordered),
        "points": ordered,
        **(extra or {}),
    }
    rep.update(port_sections(ordered))
    if rep.get("target_errors"):  # a unit whose target call raised was not tested: no pass
        rep["passed"] = False
    return rep


def _phase_counts(records: list[dict]) -> dict[str, dict[str, int]]:
    """{phase: {status: n}}: the summary says how many backward points (issue 26) were compared."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        c = out.setdefault(r.get("phase", "?"), {})
        c[r.get("status", "?")] = c.get(r.get("status", "?"), 0) + 1
    return out


def phase_lines(report: dict) -> list[str]:
    """One line per phase with its status counts, e.g. `backward: 412 points {'pass': 400, 'skipped': 12}`."""
    by = report.get("counts_by_phase") or _phase_counts(report.get("points", []))
    if set(by) <= {"prefill"}:
        return []
    return [f"  {ph}: {sum(c.values())} points {c}" for ph, c in by.items()]


def layer_table(report: dict) -> list[dict]:
    """One row per (phase, step, layer): points, failures, the worst |Δ| in units of its reference row's RMS
    (`max_diff_rms`: grid-free, finite at sign crossings and near-zero values, where an fp32 point's ULP distance
    reaches ~2e9), the worst rel-L2, first failing site. `max_ulp` (the largest ULP distance of any point, whatever its
    grid) is kept for old readers; nothing shows it."""
    rows: dict[tuple, dict] = {}
    for r in report["points"]:
        key = (r["phase"], r.get("step", 0), r.get("layer"))
        row = rows.setdefault(key, {"phase": key[0], "step": key[1], "layer": key[2], "points": 0, "failed": 0,
                                    "benign": 0, "missing": 0, "max_ulp": 0, "max_diff_rms": 0.0,
                                    "max_rel_l2": 0.0, "first_fail": ""})
        row["points"] += 1
        st = r.get("status")
        if st == "fail":
            row["failed"] += 1
            row["first_fail"] = row["first_fail"] or r["site"]
        elif st in ("benign", "missing"):
            row[st] += 1
        if isinstance(r.get("max_ulp"), (int, float)) and r["max_ulp"] is not None:
            row["max_ulp"] = max(row["max_ulp"], r["max_ulp"])
        dr = _number(r.get("max_diff_rms"))
        if dr is not None and not math.isnan(dr):
            row["max_diff_rms"] = max(row["max_diff_rms"], dr)
        rl = r.get("rel_l2")
        if isinstance(rl, (int, float)) and math.isfinite(rl):
            row["max_rel_l2"] = max(row["max_rel_l2"], rl)
    return list(rows.values())


def _number(x) -> float | None:
    """A statistic as a float: report.json spells non-finite floats 'inf' / '-inf' / 'nan'."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if x in ("inf", "-inf", "nan"):
        return float(x)
    return None


GRIDS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def ulps(d: dict, key: str = "max_ulp") -> str:
    """A ULP figure with the grid it counts on, e.g. `10 bf16 ULP` (the point's `dtype`: the comparison grid)."""
    grid = GRIDS.get(d.get("dtype"), d.get("dtype"))
    return f"{d.get(key)} {grid} ULP" if grid else f"{d.get(key)} ULP"


def _loc(d: dict) -> str:
    lay = "model" if d.get("layer") is None else f"L{d['layer']:02d}"
    step = "" if d.get("phase") in ("prefill", "backward") else f"/S{d.get('step', 0):03d}"
    return f"{d.get('phase')}{step}/{lay}/{d.get('site')}"


def _fmt(x, spec=".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


# The terminal's per-layer table: header and alignment ("<" left, ">" right) of each column.
TABLE_HEADER = ("phase", "step", "layer", "points", "fail", "benign", "max |Δ|/RMS", "rel-L2", "first failing site")
TABLE_ALIGN = "<>>>>>>><"


def aligned_table(header: tuple[str, ...], rows: list[list[str]], align: str, gap: int = 2) -> list[str]:
    """Lines of a plain-text table whose columns are as wide as their widest cell and `gap` spaces apart, so no value,
    however wide (a max ULP of 2131735856, a rel-L2 of 1e+300), runs into its neighbour. The last column is not
    padded (no trailing spaces)."""
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    out = []
    for cells in (list(header), *rows):
        parts = [f"{c:{a}{w}}" for c, a, w in zip(cells[:-1], align, widths)] + [cells[-1]]
        out.append((" " * gap).join(parts).rstrip())
    return out


def summary_text(report: dict, *, max_rows: int = 60) -> str:
    """Terminal summary: verdict, first divergence and its source (with the commands that reproduce it),
    per-layer table."""
    from parity.reporting.repro import repro_commands

    lines = [f"ling3-parity: dump {report['dump']} | target {report['target']} | mode {report['mode']} -> "
             + ("PASSED" if report["passed"] else "FAILED") + f"  {report.get('counts', {})}"]
    lines += phase_lines(report)
    if "dump_provenance" in report:  # which kernels made the dump (None: not recorded in it)
        lines.append(f"  dump kernels: {kernels_line(report['dump_provenance'])}")
    if "replay_env" in report:  # where the target ran (issue 31)
        lines.append(f"  replay env: {env_line(report['replay_env'])}")
    lines += dot_precision_lines(report.get("dot_precision"))
    tri = report.get("triage")
    if tri and (tri.get("first_semantic") or tri.get("first_precision") or tri.get("first_dot_precision")
                or tri.get("variants")):
        lines += triage_lines(tri)  # an fp32 + bf16 pair: lead with the first semantic, then the first precision error
    fd = report.get("first_divergence")
    if fd:
        src = fd["source"]
        lines.append(f"  first divergence: {_loc(fd)}  max {ulps(fd)}, rel-L2 {_fmt(fd.get('rel_l2'))}, "
                     f"worst at {fd.get('worst_index')} (ref {_fmt(fd.get('worst_ref'), '.6g')}, "
                     f"test {_fmt(fd.get('worst_test'), '.6g')})")
        rnd = fd.get("rounding") or {}
        if rnd.get("outside"):  # failed by the RMSNorm rounding check, which its ULP statistics do not show
            lines.append(f"  rounding check: {rnd['outside']} element(s) outside what fp32 rounding of the RMSNorm "
                         f"formula gives, first at {rnd.get('index')} (test {_fmt(rnd.get('test'), '.6g')}, dump "
                         f"{_fmt(rnd.get('ref'), '.6g')})")
        lines.append(f"  source: {_loc(src)} — " + source_meaning(report))
        lines += repro_commands(report)
    lines += variant_lines(report)
    rows = layer_table(report)
    cells = []
    for row in rows[:max_rows]:
        here = "  <- HERE" if fd and (row["phase"], row["step"], row["layer"]) == (fd["phase"], fd.get("step", 0),
                                                                                  fd.get("layer")) else ""
        lay = "model" if row["layer"] is None else str(row["layer"])
        cells.append([row["phase"], str(row["step"]), lay, str(row["points"]), str(row["failed"]), str(row["benign"]),
                      f"{row['max_diff_rms']:.3g}", f"{row['max_rel_l2']:.2e}", f"{row['first_fail']}{here}"])
    lines += ["  " + line for line in aligned_table(TABLE_HEADER, cells, TABLE_ALIGN)]
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more rows in report.md")
    return "\n".join(lines)


def source_meaning(report: dict) -> str:
    """What the source line means in the report's mode: in isolated mode every site is fed its own dumped inputs, so
    a failing site fails on its own; in the other modes later failures inherit the source's error."""
    if report.get("mode") == "isolated":
        return "fails on its own dumped inputs (isolated: every failing site is independent)"
    return "the error starts there; later failures inherit it"


def triage_lines(tri: dict) -> list[str]:
    """Terminal lines of a triage, leading with the first semantic error, then the first precision error, then
    the variants."""
    out = [f"  triage (fp32 {tri.get('fp32_dump')} + bf16 {tri.get('bf16_dump')}):"]
    dp = tri.get("first_dot_precision")
    if dp is not None:  # issue 31: the fp32 dots of the target run at bf16 precision; said first, with the fix
        out.append(f"    first dot precision ({_DOT_WHAT}): {_loc(dp)}  max {ulps(dp)}, rel-L2 "
                   f"{_fmt(dp.get('rel_l2'))} — fix: {_DOT_FIX}")
    for key, what in (("first_semantic", "semantic  (fails on the fp32 dump: the formula differs)"),
                      ("first_precision", "precision (passes fp32, fails bf16: less precision than the reference)")):
        p = tri.get(key)
        out.append(f"    first {what}: " + ("none" if p is None else
                   f"{_loc(p)}  max {ulps(p)}, rel-L2 {_fmt(p.get('rel_l2'))}"))
    for v in tri.get("variants") or ():
        shown = ", ".join(v["sites"][:6]) + (f", ... ({len(v['sites'])} sites)" if len(v["sites"]) > 6 else "")
        more = len(v.get("inheriting_sites") or ())
        out.append(f"    variant {v['name']} ({v['formula']}): {v['points']} point(s) at {shown}"
                   + (f" (+{more} site(s) downstream inherit it)" if more else "") + " — counted as passing")
    return out


def triage_markdown(tri: dict) -> list[str]:
    """report.md section: the leading errors and the per-site table."""
    out = ["## Triage (fp32 + bf16)", "", f"fp32 dump `{tri.get('fp32_dump')}`, bf16 dump `{tri.get('bf16_dump')}`.", ""]
    dp = tri.get("first_dot_precision")
    if dp is not None:
        out.append(f"- First dot-precision error ({_DOT_WHAT}): `{_loc(dp)}` — max {ulps(dp)}, rel-L2 "
                   f"{_fmt(dp.get('rel_l2'))}. Fix: {_DOT_FIX}")
    for key, what in (("first_semantic", "First semantic error (fails on fp32)"),
                      ("first_precision", "First precision error (passes fp32, fails bf16)")):
        p = tri.get(key)
        out.append(f"- {what}: " + ("none" if p is None else
                   f"`{_loc(p)}` — max {ulps(p)}, rel-L2 {_fmt(p.get('rel_l2'))}"))
    out += ["", "| layer | site | diagnosis | fp32 statuses | bf16 statuses |", "|---|---|---|---|---|"]
    for s in tri.get("sites") or ():
        lay = "model" if s["layer"] is None else s["layer"]
        out.append(f"| {lay} | {s['site']} | {s['diagnosis']} | {_counts(s['fp32'])} | {_counts(s['bf16'])} |")
    return out + [""]


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def dot_precision_lines(dp: dict | None) -> list[str]:
    """Terminal lines of the report's `dot_precision` section (issue 31): the diagnosis and the fix, or how many
    failing points the dot-precision shadow did not explain."""
    if not dp:
        return []
    if not dp.get("explained"):
        return [f"  dot precision: none of the {dp['compared']} failing point(s) compared matches the reference with "
                "one-bf16-pass dots (not a dot-precision difference)"]
    if not dp.get("diagnosis"):
        return [f"  dot precision: {dp['explained']} of {dp['compared']} failing point(s) compared match the reference "
                "with one-bf16-pass dots, " + ("but not all of them" if dp.get("explains_first") else
                                               "but not the first failing point") + ": not the diagnosis"]
    return [f"  DOT PRECISION: {dp['explained']} of {dp['failing']} failing point(s) match the reference with "
            f"one-bf16-pass dots, first {_loc(dp['first'])}: {dp['diagnosis']}",
            f"  fix: {dp['fix']}"]


def variants_summary(records: list[dict]) -> list[dict]:
    """The report's `variants` section: per named variant (parity.numerics.variants), how many points matched it
    directly (the rounding check's site) or inherited it (downstream in the layer), and where."""
    out: dict[str, dict] = {}
    for r in records:
        if r.get("status") != "variant":
            continue
        v = r.get("variant") or {}
        e = out.setdefault(v.get("name", "?"), {"name": v.get("name", "?"), "formula": v.get("formula"),
                                                "seen": v.get("seen"), "direct": 0, "inherited": 0, "sites": []})
        e["inherited" if v.get("inherited_from") else "direct"] += 1
        where = _loc_site(r.get("layer"), r["site"])
        if where not in e["sites"]:
            e["sites"].append(where)
    return list(out.values())


def _loc_site(layer, site: str) -> str:
    return site if layer is None else f"L{layer:02d}/{site}"


def variant_lines(report: dict) -> list[str]:
    """Terminal lines naming each variant the target matched (counted as passing, never a first divergence)."""
    out = []
    for v in report.get("variants") or ():
        shown = ", ".join(v["sites"][:5]) + (f", ... ({len(v['sites'])} sites)" if len(v["sites"]) > 5 else "")
        out.append(f"  variant {v['name']} ({v['formula']}): {v['direct']} point(s) matched it, {v['inherited']} "
                   f"inherited it, at {shown} — counted as passing (--parity-strict-variants fails them)")
    return out


def layer_table_markdown(report: dict) -> list[str]:
    """The per-layer table as markdown lines (report.md, the CI job summary), HERE on the first divergence's row."""
    fd = report.get("first_divergence")
    out = ["| phase | step | layer | points | fail | benign | max \\|Δ\\|/RMS | max rel-L2 | first failing site |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in layer_table(report):
        here = " **← HERE**" if fd and (row["phase"], row["step"], row["layer"]) == (fd["phase"], fd.get("step", 0),
                                                                                   fd.get("layer")) else ""
        out.append(f"| {row['phase']} | {row['step']} | {'model' if row['layer'] is None else row['layer']} | "
                   f"{row['points']} | {row['failed']} | {row['benign']} | {row['max_diff_rms']:.3g} | "
                   f"{row['max_rel_l2']:.2e} | {row['first_fail']}{here} |")
    return out


def markdown(report: dict) -> str:
    out = [f"# ling3-parity report — {'PASSED' if report['passed'] else 'FAILED'}", "",
           f"- dump: `{report['dump']}`", f"- target: `{report['target']}`", f"- mode: `{report['mode']}`",
           f"- counts: {report.get('counts')}"] + [f"- {line.strip()}" for line in phase_lines(report)] + [""]
    info = report.get("target_info")  # protocol v2: what actually ran (Target.describe())
    if info:
        out += ["## What ran", ""] + [f"- {k}: `{v}`" for k, v in info.items()] + [""]
    if "replay_env" in report:
        out += env_markdown(report["replay_env"])
    dp = dot_precision_lines(report.get("dot_precision"))
    if dp:
        out += ["## Dot precision", ""] + [f"- {line.strip()}" for line in dp] + [""]
    if "dump_provenance" in report:
        out += markdown_section(report["dump_provenance"])
    sem = report.get("semantics")
    if sem and sem.get("departures"):  # forks where the dump's runtime departs from the intended behaviour
        out += ["## Semantic forks", "", f"Replayed with the **{sem['replayed_with']}** semantics "
                "(`--parity-semantics dump|intended`). The dump's runtime departs from the intended behaviour on:", "",
                "| fork | dump | intended | what |", "|---|---|---|---|"]
        out += [f"| {d['fork']} | {d['dump']} | {d['intended']} | {d['what']} |" for d in sem["departures"]]
        if sem.get("explained_points"):
            out += ["", f"{sem['explained_points']} point(s) differ only by that (status `semantic`): "
                    + ", ".join(f"`{k}`" for k in sem["explained"][:20])]
        out.append("")
    if report.get("triage"):
        out += triage_markdown(report["triage"])
    if report.get("variants"):
        out += ["## Variants", "", "Named implementation variants the target matched (parity.numerics.variants): "
                "counted as passing, never a first divergence; `--parity-strict-variants` fails them.", "",
                "| variant | formula | where seen | points matching | points inheriting | sites |",
                "|---|---|---|---|---|---|"]
        out += [f"| {v['name']} | {v['formula']} | {v['seen']} | {v['direct']} | {v['inherited']} | "
                + ", ".join(v["sites"][:20]) + (" ..." if len(v["sites"]) > 20 else "") + " |"
                for v in report["variants"]]
        out.append("")
    out += port_markdown(report)
    fd = report.get("first_divergence")
    if fd:
        out += ["## First divergence", "", f"- point: `{_loc(fd)}` — max {ulps(fd)}, "
                f"p99 {ulps(fd, 'p99_ulp')}, rel-L2 {_fmt(fd.get('rel_l2'))}, cosine {_fmt(fd.get('cosine'), '.6f')}",
                f"- worst element: index {fd.get('worst_index')}, ref {_fmt(fd.get('worst_ref'), '.7g')}, "
                f"test {_fmt(fd.get('worst_test'), '.7g')}",
                f"- source: `{_loc(fd['source'])}` (first failing point whose inputs pass)", ""]
        if fd.get("message"):
            out += ["```", fd["message"], "```", ""]
    out += ["## Per layer", ""] + layer_table_markdown(report)
    out += ["", "## Failing points", ""]
    fails = [r for r in report["points"] if r.get("status") == "fail"]
    for r in fails[:200]:
        out.append(f"- `{_loc(r)}`: max {ulps(r)}, rel-L2 {_fmt(r.get('rel_l2'))}, worst "
                   f"{r.get('worst_index')} (ref {_fmt(r.get('worst_ref'), '.6g')}, test {_fmt(r.get('worst_test'), '.6g')})")
    if not fails:
        out.append("none")
    return "\n".join(out) + "\n"


def _svg_plot(rows: list[dict]) -> str:
    """Per-layer error growth (prefill, max rel-L2 per layer, log scale) as inline SVG: no external dependency."""
    pts = [(r["layer"], r["max_rel_l2"], r["failed"]) for r in rows if r["phase"] == "prefill" and r["layer"] is not None]
    if not pts:
        return "<p>(no per-layer points)</p>"
    w, h, pad = 640, 220, 40
    ys = [max(p[1], 1e-12) for p in pts]
    lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)) + 1e-9)
    hi = max(hi, lo + 1)
    n = max(p[0] for p in pts) or 1

    def xy(layer, v):
        x = pad + (w - 2 * pad) * layer / n
        y = h - pad - (h - 2 * pad) * (math.log10(max(v, 1e-12)) - lo) / (hi - lo)
        return x, y

    line = " ".join(f"{xy(l, v)[0]:.1f},{xy(l, v)[1]:.1f}" for l, v, _ in pts)
    dots = "".join(
        f'<circle cx="{xy(l, v)[0]:.1f}" cy="{xy(l, v)[1]:.1f}" r="4" fill="{"#c0392b" if f else "#27ae60"}">'
        f"<title>layer {l}: max rel-L2 {v:.3e}, {f} failing</title></circle>" for l, v, f in pts)
    ticks = "".join(
        f'<text x="4" y="{xy(0, 10.0 ** e)[1] + 4:.1f}" font-size="10">1e{e}</text>' for e in range(lo, hi + 1))
    xt = "".join(f'<text x="{xy(l, 1)[0] - 4:.1f}" y="{h - pad + 16}" font-size="10">{l}</text>' for l, _, _ in pts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
            f'aria-label="per-layer error growth"><rect width="{w}" height="{h}" fill="#fafafa"/>'
            f'<polyline points="{line}" fill="none" stroke="#2c3e50" stroke-width="1.5"/>{dots}{ticks}{xt}'
            f'<text x="{w / 2 - 60}" y="{h - 6}" font-size="11">layer (prefill)</text>'
            f'<text x="{pad}" y="14" font-size="11">max rel-L2 per layer (log)</text></svg>')


def html_page(report: dict) -> str:
    fd = report.get("first_divergence")
    esc = html.escape
    verdict = "PASSED" if report["passed"] else "FAILED"
    color = "#27ae60" if report["passed"] else "#c0392b"
    head = (f"<h1 style='color:{color}'>ling3-parity: {verdict}</h1><p>dump <code>{esc(report['dump'])}</code> · "
            f"target <code>{esc(report['target'])}</code> · mode <code>{esc(report['mode'])}</code> · "
            f"{esc(str(report.get('counts')))}</p>")
    if "dump_provenance" in report:
        head += f"<p>dump kernels: <code>{esc(kernels_line(report['dump_provenance']))}</code></p>"
    if "replay_env" in report:
        head += f"<p>replay env: <code>{esc(env_line(report['replay_env']))}</code></p>"
    if fd:
        head += (f"<div class='fd'><b>First divergence:</b> <code>{esc(_loc(fd))}</code> — max {esc(ulps(fd))}, "
                 f"rel-L2 {_fmt(fd.get('rel_l2'))}, worst at {esc(str(fd.get('worst_index')))} "
                 f"(ref {_fmt(fd.get('worst_ref'), '.7g')}, test {_fmt(fd.get('worst_test'), '.7g')})<br>"
                 f"<b>Source:</b> <code>{esc(_loc(fd['source']))}</code> — {esc(source_meaning(report))}.</div>")
        if fd.get("message"):
            head += f"<pre>{esc(fd['message'])}</pre>"
    extra = (dot_precision_lines(report.get("dot_precision"))
             + (triage_lines(report["triage"]) if report.get("triage") else []) + variant_lines(report)
             + port_lines(report))
    if extra:
        head += "<pre>" + esc("\n".join(x.strip() for x in extra)) + "</pre>"
    rows_html = []
    for row in layer_table(report):
        here = fd and (row["phase"], row["step"], row["layer"]) == (fd["phase"], fd.get("step", 0), fd.get("layer"))
        cls = "here" if here else ("bad" if row["failed"] else "")
        lay = "model" if row["layer"] is None else row["layer"]
        rows_html.append(
            f"<tr class='{cls}'><td>{'HERE ▶' if here else ''}</td><td>{row['phase']}</td><td>{row['step']}</td>"
            f"<td>{lay}</td><td>{row['points']}</td><td>{row['failed']}</td><td>{row['benign']}</td>"
            f"<td>{row['max_diff_rms']:.3g}</td><td>{row['max_rel_l2']:.2e}</td><td>{esc(row['first_fail'])}</td></tr>")
    pts_html = []
    for r in report["points"]:
        if r.get("status") in ("fail", "benign", "missing"):
            pv = f" ({r['provenance']})" if r.get("provenance") else ""  # a composed target: port / reference
            pts_html.append(f"<tr class='{'bad' if r['status'] == 'fail' else ''}'><td>{esc(_loc(r))}{pv}</td>"
                            f"<td>{r['status']}</td><td>{esc(ulps(r))}</td><td>{_fmt(r.get('rel_l2'))}</td>"
                            f"<td>{esc(str(r.get('worst_index', '')))}</td><td>{_fmt(r.get('worst_ref'), '.6g')}</td>"
                            f"<td>{_fmt(r.get('worst_test'), '.6g')}</td></tr>")
    style = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
             "font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#eee}"
             "tr.bad td{background:#fdecea}tr.here td{background:#f9d6d2;font-weight:bold}"
             ".fd{background:#fff4e5;border-left:4px solid #e67e22;padding:8px;margin:8px 0}code{font-size:13px}"
             "pre{white-space:pre-wrap;background:#f6f6f6;padding:8px;font-size:12px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>ling3-parity {verdict}</title>"
            f"<style>{style}</style></head><body>{head}<h2>Error growth</h2>{_svg_plot(layer_table(report))}"
            "<h2>Per layer</h2><table><tr><th></th><th>phase</th><th>step</th><th>layer</th><th>points</th>"
            "<th>fail</th><th>benign</th><th>max |Δ|/RMS</th><th>max rel-L2</th><th>first failing site</th></tr>"
            + "".join(rows_html) + "</table><h2>Failing, benign and missing points</h2><table><tr><th>point</th>"
            "<th>status</th><th>max ULP</th><th>rel-L2</th><th>worst index</th><th>ref</th><th>test</th></tr>"
            + ("".join(pts_html) or "<tr><td colspan=7>none</td></tr>") + "</table></body></html>\n")


def write_reports(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    (out / "report.md").write_text(markdown(report))
    (out / "report.html").write_text(html_page(report))
    return out


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def diff_reports(a: dict, b: dict) -> str:
    """Before/after: verdict change, first divergence of each, points whose status or max ULP changed."""
    def key(r):
        return (r["phase"], r.get("step", 0), r.get("layer"), r["site"])

    ia, ib = {key(r): r for r in a["points"]}, {key(r): r for r in b["points"]}
    lines = [f"before: {'PASSED' if a['passed'] else 'FAILED'}  first divergence "
             f"{_loc(a['first_divergence']) if a.get('first_divergence') else '-'}",
             f"after:  {'PASSED' if b['passed'] else 'FAILED'}  first divergence "
             f"{_loc(b['first_divergence']) if b.get('first_divergence') else '-'}"]
    changed = []
    for k in sorted(set(ia) | set(ib), key=lambda k: (k[0] != "prefill", k[1], -1 if k[2] is None else k[2], k[3])):
        ra, rb = ia.get(k), ib.get(k)
        if ra is None or rb is None:
            changed.append(f"  {_loc(ra or rb)}: only in {'after' if ra is None else 'before'}")
        elif ra.get("status") != rb.get("status") or ra.get("max_ulp") != rb.get("max_ulp"):
            changed.append(f"  {_loc(ra)}: {ra.get('status')} {ulps(ra)} -> {rb.get('status')} {ulps(rb)}")
    lines.append(f"{len(changed)} point(s) changed")
    return "\n".join(lines + changed)


def load_report(path: str | Path) -> dict:
    from parity.errors import ParityError

    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ParityError(f"{p}: cannot read a report ({e})") from None
    if d.get("schema") != SCHEMA:
        raise ParityError(f"{p}: schema is {d.get('schema')!r}, expected {SCHEMA!r}")
    return d


def records_iter(report: dict) -> Iterable[dict]:
    return iter(report["points"])


# ------------------------------------------------------------------------------------------ port-facing notes (issue 32)
# Sections a port engineer acts on, added to report.json only when they have something to say (so reports of a clean
# run keep their keys): `target_errors` (a target call that raised: the unit's points are not tested), `dtype_notes`
# (a target output in another dtype than the dump's, and the rounding the comparison applied), `structural_differences`
# (a point the target declares in a coarser form: named, not compared).
def target_errors(records: list[dict]) -> list[dict]:
    """One entry per target call that raised ({where, call, exception, frame, message, points}: how many points of
    its unit were not tested), from the records' `target_error` (plugin) in execution order."""
    out: dict[str, dict] = {}
    for r in records:
        e = r.get("target_error")
        if e:
            entry = out.setdefault(e.get("message", ""), dict(e, points=0))
            entry["points"] += 1
    return list(out.values())


def dtype_notes(records: list[dict]) -> list[dict]:
    """One entry per (layer, note) of points whose target output had another dtype than the dump's: the note (which
    dtypes, the rounding applied), how many points and which sites."""
    out: dict[tuple, dict] = {}
    for r in records:
        n = r.get("dtype_note")
        if n:
            e = out.setdefault((r.get("layer"), n), {"layer": r.get("layer"), "note": n, "points": 0, "sites": []})
            e["points"] += 1
            if r["site"] not in e["sites"]:
                e["sites"].append(r["site"])
    return list(out.values())


def structural_differences(records: list[dict]) -> list[dict]:
    """One entry per (site, declared structural form) a target computes with no exact mapping to the dump's point
    (`parity.targets.taps.coarser`): {site, reason, points, layers}; those points are status `semantic`, not compared."""
    out: dict[tuple, dict] = {}
    for r in records:
        if r.get("structural"):
            e = out.setdefault((r["site"], r.get("transform")), {"site": r["site"], "reason": r.get("transform"),
                                                                 "points": 0, "layers": []})
            e["points"] += 1
            if r.get("layer") not in e["layers"]:
                e["layers"].append(r.get("layer"))
    return list(out.values())


def port_sections(records: list[dict]) -> dict:
    """The port-facing report.json keys that have content (see above)."""
    out = {"target_errors": target_errors(records), "dtype_notes": dtype_notes(records),
           "structural_differences": structural_differences(records),
           "provenance": provenance_summary(records), "independent_sources": independent_sources(records)}
    return {k: v for k, v in out.items() if v}


def port_lines(report: dict) -> list[str]:
    """Terminal lines of the port-facing sections (target call errors, dtype notes)."""
    out = [f"  TARGET ERROR: {e['message']} — {e['points']} point(s) of it not tested"
           for e in report.get("target_errors") or ()]
    out += provenance_lines(report) + independent_lines(report)
    for d in report.get("structural_differences") or ():
        lays = ", ".join("model" if x is None else str(x) for x in d["layers"][:8])
        out.append(f"  STRUCTURAL: {d['site']}: {d['reason']} — not compared, status semantic "
                   f"({d['points']} point(s), layer(s) {lays})")
    for n in report.get("dtype_notes") or ():
        lay = "model" if n["layer"] is None else f"layer {n['layer']}"
        sites = ", ".join(n["sites"][:6]) + (f", ... ({len(n['sites'])} sites)" if len(n["sites"]) > 6 else "")
        out.append(f"  dtype note, {lay}: {n['note']} ({n['points']} point(s): {sites})")
    return out


def port_markdown(report: dict) -> list[str]:
    """report.md lines of the port-facing sections (none when they are empty)."""
    lines = port_lines(report)
    return ["## Port notes", ""] + [f"- {line.strip()}" for line in lines] + [""] if lines else []


def provenance_summary(records: list[dict]) -> dict:
    """A composed target's provenance (`provenance` of its records, parity.targets.partial): {"counts": {"port": n,
    "reference": m}, "port_sites": {"L00": [sites the port computed]}}; {} for a target that is all its own."""
    counts: dict[str, int] = {}
    port: dict[str, list[str]] = {}
    for r in records:
        pv = r.get("provenance")
        if not pv:
            continue
        counts[pv] = counts.get(pv, 0) + 1
        if pv == "port":
            sites = port.setdefault(_loc_site(r.get("layer"), "").rstrip("/") or "model", [])
            if r["site"] not in sites:
                sites.append(r["site"])
    return {"counts": counts, "port_sites": port} if counts else {}


def provenance_lines(report: dict) -> list[str]:
    """Terminal lines: which sites the port computed (layers sharing a site list on one line), and that the
    reference computed the rest."""
    pv = report.get("provenance")
    if not pv:
        return []
    c = pv.get("counts", {})
    out = [f"  provenance: {c.get('port', 0)} point(s) computed by the port, {c.get('reference', 0)} by the "
           "reference (report.json points[].provenance)"]
    groups: dict[tuple, list[str]] = {}
    for lay, sites in (pv.get("port_sites") or {}).items():
        groups.setdefault(tuple(sites), []).append(lay)
    for sites, lays in groups.items():
        shown = ", ".join(sites[:8]) + (f", ... ({len(sites)} sites)" if len(sites) > 8 else "")
        out.append(f"    port: {', '.join(lays)}: {shown}")
    return out


def independent_sources(records: list[dict]) -> list[dict]:
    """Per layer, every site that fails on its own dumped inputs (`independent_source`, parity.replay.independent),
    in execution order, with its first failing step; an entry {"layer", "note"} where it could not be checked."""
    out: dict[tuple, dict] = {}
    for r in records:
        if r.get("independent_source"):
            out.setdefault((r.get("layer"), r["site"]), {"layer": r.get("layer"), "site": r["site"],
                                                          "phase": r["phase"], "step": r.get("step", 0)})
        elif r.get("independent_source_note"):
            out.setdefault((r.get("layer"), None), {"layer": r.get("layer"), "note": r["independent_source_note"]})
    return list(out.values())


def independent_lines(report: dict) -> list[str]:
    """Terminal lines: per failing layer, every independent source (fails on its own dumped inputs)."""
    by: dict = {}
    for e in report.get("independent_sources") or ():
        by.setdefault(e["layer"], []).append(e)
    out = []
    for lay, es in by.items():
        where = "model" if lay is None else f"L{lay:02d}"
        sites = [e["site"] for e in es if "site" in e]
        notes = [e["note"] for e in es if "note" in e]
        if sites:
            out.append(f"  independent sources {where} (each fails on its own dumped inputs): " + ", ".join(sites))
        out += [f"  independent sources {where}: {n}" for n in notes]
    return out
