#!/usr/bin/env python3
"""Moved: the safety bounds are derived by `python tools/calibrate.py rules` (with every other generated file)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --write was needed to write; the pipeline always writes every file (`rules --check` writes nothing)
    rest = [a for a in argv if a != "--write"] if "--write" in argv else ["--check"] + argv
    rest = ["--bounds-safety" if a == "--safety" else a for a in rest]
    if "--points" in rest:
        i = rest.index("--points")
        rest[i:i + 2] = ["--from", str(Path(rest[i + 1]).parent)]
    print(f"tools/safety_bounds.py moved: running `python tools/calibrate.py rules {' '.join(rest)}`", file=sys.stderr)
    return calibrate.main(["rules", *rest])


if __name__ == "__main__":
    sys.exit(main())
