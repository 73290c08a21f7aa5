#!/usr/bin/env python3
"""Write a minimal reproducer bundle of a report's first divergence (thin CLI over parity.reporting.repro)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli.repro import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
