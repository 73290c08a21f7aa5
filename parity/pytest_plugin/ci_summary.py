"""The CI job summary (issue 25 item 4): `python -m parity.pytest_plugin.ci_summary REPORTS [--bundles]`.

Appends markdown to `$GITHUB_STEP_SUMMARY` (stdout when it is not set): per report under REPORTS (every
`report.json` below it), the verdict, the first divergence and its source, the first semantic / precision
divergence where the report has a `triage` section, the commands that reproduce the failure, and the per-layer table
(`parity.reporting.report.layer_table_markdown`, folded). With `--bundles` it also writes the repro bundle
(`parity.reporting.bundles.make_report_bundle`: Ling3's or Kimi's) of each failing report into `<report dir>/repro` and names it; a bundle that cannot be made
is one line in the summary, never a failed step (the verdict is pytest's exit status).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from parity.errors import ParityError


def find_reports(root: Path) -> list[Path]:
    """Every report.json below `root`, in path order (a run of several modes nests `label/mode/`)."""
    return sorted(root.rglob("report.json"))


def _point_line(title: str, d: dict | None) -> str:
    from parity.reporting.report import _fmt, _loc, ulps

    if not d:
        return f"- {title}: none"
    return (f"- {title}: `{_loc(d)}` — max {ulps(d)}, rel-L2 {_fmt(d.get('rel_l2'))}, worst at "
            f"{d.get('worst_index')} (ref {_fmt(d.get('worst_ref'), '.6g')}, test {_fmt(d.get('worst_test'), '.6g')})")


def report_markdown(report: dict, bundle_note: str | None = None) -> list[str]:
    """The summary section of one report."""
    from parity.reporting.repro import repro_commands
    from parity.reporting.report import _loc, layer_table_markdown, source_meaning

    verdict = "PASSED" if report["passed"] else "FAILED"
    out = [f"### {'✅' if report['passed'] else '❌'} {verdict}: `{report['dump']}`", "",
           f"target `{report['target']}` · mode `{report['mode']}` · {report.get('counts', {})}", ""]
    if "replay_env" in report:  # where the target ran (issue 31)
        from parity.replay.environment import env_line

        out += [f"- replay env: {env_line(report['replay_env'])}"]
    from parity.reporting.report import dot_precision_lines

    out += [f"- {line.strip()}" for line in dot_precision_lines(report.get("dot_precision"))]
    fd = report.get("first_divergence")
    if fd:
        out.append(_point_line("first divergence", fd))
        out.append(f"- source: `{_loc(fd['source'])}` — {source_meaning(report)}")
        out += _port_section(report)
    triage = report.get("triage")
    if triage is not None:  # the lead's triage section: the first semantic and the first precision divergence
        out.append(_point_line("first semantic divergence", triage.get("first_semantic")))
        out.append(_point_line("first precision divergence", triage.get("first_precision")))
        if triage.get("first_dot_precision"):
            out.append(_point_line("first dot-precision divergence", triage["first_dot_precision"]))
    cmds = [c.split(": ", 1) for c in repro_commands(report)]
    out += [f"- {name.strip()}: `{cmd}`" for name, cmd in cmds]
    if bundle_note:
        out.append(f"- {bundle_note}")
    out += ["", "<details><summary>per layer</summary>", ""] + layer_table_markdown(report) + ["", "</details>", ""]
    return out


def _bundle(report: dict, report_json: Path) -> str:
    """Write the failing report's repro bundle; the line saying where (or why not)."""
    from parity.reporting.bundles import make_report_bundle as make_bundle

    try:
        out = make_bundle(report, report_json.parent / "repro", report_path=str(report_json.parent))
    except Exception as e:  # noqa: BLE001  (a summary step must not fail the job: the verdict is pytest's)
        return f"repro bundle not written ({type(e).__name__}: {e})"
    return f"repro bundle written: `{out}` (artifact `ling3-parity-repro`; run `python repro.py` in it)"


def summary(root: Path, bundles: bool = False) -> str:
    """The whole job summary for the reports below `root`."""
    from parity.reporting.report import load_report

    paths = find_reports(root)
    out = ["## ling3-parity", ""]
    if not paths:
        return "\n".join(out + [f"no report.json below `{root}` (the replay wrote no report)", ""])
    for p in paths:
        try:
            rep = load_report(p)
        except ParityError as e:
            out += [f"- `{p}`: {e}", ""]
            continue
        note = None
        if bundles and not rep["passed"] and rep.get("first_divergence"):
            # a repro bundle replays the source point (`parity.reporting.repro`; a Kimi report's forward points by
            # `parity.reporting.kimi_repro`): a Kimi backward source has none
            src = rep["first_divergence"].get("source") or rep["first_divergence"]
            note = _bundle(rep, p) if rep.get("family", "ling3") == "ling3" or src.get("phase") != "backward" else \
                f"no repro bundle: a {rep['family']} backward point (its pytest command above reproduces it)"
        out += report_markdown(rep, note)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.pytest_plugin.ci_summary", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="?", default="reports", help="report root (default: reports)")
    ap.add_argument("--bundles", action="store_true", help="write the repro bundle of each failing report")
    a = ap.parse_args(argv)
    text = summary(Path(a.reports), bundles=a.bundles)
    dest = os.environ.get("GITHUB_STEP_SUMMARY")
    if not dest:
        sys.stdout.write(text)
        return 0
    with open(dest, "a", encoding="utf-8") as f:  # appended: other steps write their own sections
        f.write(text)
    return 0


def _port_section(report: dict) -> list[str]:
    """The port-facing lines (issue 32): every independent source, target call errors, dtype notes, provenance."""
    from parity.reporting.report import port_lines

    return [f"- {line.strip()}" for line in port_lines(report)]


if __name__ == "__main__":
    raise SystemExit(main())
