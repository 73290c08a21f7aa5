#!/usr/bin/env python
"""Print the canonical point table (docs/points.md) generated from the site graph (thin CLI over
parity.model.points_doc).

    python tools/points_table.py > docs/points.md
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from parity.model.points_doc import table_markdown  # noqa: E402

if __name__ == "__main__":
    sys.stdout.write(table_markdown())
