#!/usr/bin/env python3
"""Moved: the exactness corpus is walked by `python tools/calibrate.py corpus --only exactness`, the rates re-derived
by `python tools/calibrate.py rules`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate  # noqa: E402

RENAMED = {"--seeds": "--exactness-seeds", "--prompt-lens": "--exactness-prompt-lens",
           "--decode-steps": "--exactness-decode-steps"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--from-corpus" in argv:  # the rows are stored beside the other measurements: re-derive them all
        i = argv.index("--from-corpus")
        new = ["rules", "--from", str(Path(argv[i + 1]).parent)]
    else:
        new = ["corpus", "--only", "exactness"] + [RENAMED.get(a.split("=")[0], a.split("=")[0]) +
                                                   ("=" + a.split("=", 1)[1] if "=" in a else "") for a in argv]
    print(f"tools/exactness.py moved: running `python tools/calibrate.py {' '.join(new)}`", file=sys.stderr)
    return calibrate.main(new)


if __name__ == "__main__":
    sys.exit(main())
