"""Which repro bundle a report gets (`tools/repro.py`, the CI summary): a Ling3 point's (`parity.reporting.repro`)
or a Kimi Linear point's (`parity.reporting.kimi_repro`), by the report's `family`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_report_bundle(report: dict, out_dir: str | Path, **kw: Any) -> Path:
    """The repro bundle of a report's point (keywords as `repro.make_bundle`'s) for the report's family."""
    if report.get("family", "ling3") == "kimi_linear":
        from parity.reporting.kimi_repro import make_kimi_bundle

        return make_kimi_bundle(report, out_dir, **kw)
    from parity.reporting.repro import make_bundle

    return make_bundle(report, out_dir, **kw)
