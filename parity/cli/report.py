"""`tools/report.py`: re-render a report from its report.json, or diff two reports (before / after a change).

    tools/report.py show reports/tiny-bf16            # terminal summary; --out DIR re-renders md/html/json there
    tools/report.py diff before/report.json after/report.json
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
    args = p.parse_args(argv)
    from parity.report import diff_reports, load_report, summary_text, write_reports

    try:
        if args.cmd == "show":
            rep = load_report(args.report)
            print(summary_text(rep))
            if args.out:
                print(f"wrote {write_reports(rep, args.out)}/report.{{json,md,html}}")
            return 0 if rep["passed"] else 1
        a, b = load_report(args.before), load_report(args.after)
        print(diff_reports(a, b))
        return 0
    except ParityError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
