"""`tools/repro.py REPORT_DIR [--point P]`: a minimal reproducer bundle of a report's first divergence (parity.reporting.repro).

    tools/repro.py reports/tiny-bf16                        # the first divergence's source -> reports/tiny-bf16/repro
    tools/repro.py reports/tiny-bf16 --point decode/S001/L03/attention.core --out /tmp/b
    python repro.py [--target reference]                    # in the bundle: 1 + one MISMATCH line, or 0 + MATCH

Modes: `isolated` (the site alone, fed its dumped inputs; needs the target's `isolated` capability) or `layer` (the
whole layer fed the dumped layer input); `auto` picks isolated where the target can, else layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parity.errors import ParityError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="repro.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("report", help="report directory (or its report.json)")
    p.add_argument("--point", help="point to reproduce, e.g. prefill/L03/attention.core (default: the first "
                                   "divergence's source)")
    p.add_argument("--out", help="bundle directory (default: <report dir>/repro)")
    p.add_argument("--target", help="target to bundle instead of the report's (a name or package.module:Class)")
    p.add_argument("--mode", choices=("auto", "isolated", "layer"), default="auto")
    p.add_argument("--dump", help="the dump, where the report's path does not resolve here")
    p.add_argument("--ckpt", help="the checkpoint directory, where the report's does not resolve here")
    a = p.parse_args(argv)
    from parity.reporting.bundles import make_report_bundle as make_bundle
    from parity.reporting.report import load_report

    try:
        rep = load_report(a.report)
        rdir = Path(a.report) if Path(a.report).is_dir() else Path(a.report).parent
        out = make_bundle(rep, a.out or rdir / "repro", point=a.point, target=a.target, mode=a.mode, dump=a.dump,
                          ckpt=a.ckpt, report_path=str(rdir))
    except ParityError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: run `python {out / 'repro.py'}` (README.txt says what is inside)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
