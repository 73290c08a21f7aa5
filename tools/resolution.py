#!/usr/bin/env python3
"""Moved: `python tools/calibrate.py resolution` (same options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print(f"tools/resolution.py moved: running `python tools/calibrate.py resolution {' '.join(argv)}`", file=sys.stderr)
    return calibrate.main(["resolution", *argv])


if __name__ == "__main__":
    sys.exit(main())
