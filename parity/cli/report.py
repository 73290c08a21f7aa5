"""`tools/report.py`: re-render a report from its report.json, or diff two reports (before / after a change).

    tools/report.py show reports/tiny-bf16            # terminal summary; --out DIR re-renders md/html/json there
    tools/report.py diff before/report.json after/report.json
    tools/report.py triage reports/tiny-fp32 reports/tiny-bf16   # fp32 + bf16 of one checkpoint: semantic / precision / variant
"""

from __future__ import annotations

import argparse
import sys

from parity.errors import ParityError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="report.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="print the summary of a report (and re-render it with --out)")
    s.add_argument("report", help="report.json or the directory holding it")
    s.add_argument("--out", help="directory to write report.{json,md,html} into")
    d = sub.add_parser("diff", help="compare two reports")
    d.add_argument("before")
    d.add_argument("after")
    t = sub.add_parser("triage", help="per-site diagnosis of an fp32 and a bf16 report of one checkpoint "
                                      "(semantic / precision / variant); --write adds it to both reports")
    t.add_argument("fp32")
    t.add_argument("bf16")
    t.add_argument("--write", action="store_true", help="store the triage in both reports and re-render them")
    args = p.parse_args(argv)
    from parity.reporting.report import diff_reports, load_report, summary_text, write_reports

    try:
        if args.cmd == "show":
            rep = load_report(args.report)
            print(summary_text(rep))
            if args.out:
                print(f"wrote {write_reports(rep, args.out)}/report.{{json,md,html}}")
            return 0 if rep["passed"] else 1
        if args.cmd == "triage":
            return _triage(args)
        a, b = load_report(args.before), load_report(args.after)
        print(diff_reports(a, b))
        return 0
    except ParityError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2


def _triage(args) -> int:
    from pathlib import Path

    from parity.reporting.report import load_report, triage_lines, write_reports
    from parity.reporting.triage import pair_key, triage

    a, b = load_report(args.fp32), load_report(args.bf16)
    for path, rep, want in ((args.fp32, a, "float32"), (args.bf16, b, "bfloat16")):
        if rep.get("dump_dtype") not in (None, want):
            raise ParityError(f"{path}: dump_dtype is {rep.get('dump_dtype')!r}, expected {want!r} in this position")
    if pair_key(a) != pair_key(b):
        raise ParityError(f"{args.fp32} and {args.bf16}: not the same checkpoint, target and mode "
                          f"({pair_key(a)} vs {pair_key(b)}); triage compares one port on one checkpoint")
    tri = triage(a, b)
    print("\n".join(triage_lines(tri)))
    if args.write:
        for path, rep in ((args.fp32, a), (args.bf16, b)):
            rep["triage"] = tri
            p = Path(path)
            write_reports(rep, p if p.is_dir() else p.parent)
    return 1 if tri["first_semantic"] or tri["first_precision"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
