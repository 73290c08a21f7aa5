#!/usr/bin/env python3
"""Re-render or diff ling3-parity reports (thin CLI over parity.reporting.report)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
