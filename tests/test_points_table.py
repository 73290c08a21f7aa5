"""Issue 32 item 4: docs/points.md is generated from the site graph and true of real dumps.

- regenerating it (`parity.model.points_doc.table_markdown`, what `tools/points_table.py` prints) gives the committed
  page: a change to parity/model/points.py without regenerating fails here;
- its shape and dtype columns hold for every point of the bundled bf16 golden dumps (tiny: q-LoRA; tiny-flash: no
  q-LoRA), an independent check of the hand-written SHAPES / DTYPE_RULES;
- its `submodule` inputs column is what the isolated replay feeds (`layer_graph`'s inputs).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from parity.dumpfile import DumpReader
from parity.golden import DUMPS
from parity.model import points, points_doc
from parity.model.points import SITE_GRAPH, Point, layer_graph

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "points.md"


def test_the_committed_page_is_the_generated_one():
    assert PAGE.read_text() == points_doc.table_markdown(), \
        "docs/points.md is stale: run `python tools/points_table.py > docs/points.md`"


def test_the_cli_prints_the_page():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "points_table.py")], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0 and r.stdout == PAGE.read_text(), r.stderr


def test_a_changed_site_graph_changes_the_page(monkeypatch):
    """The staleness check can fail: one more input of a site is a different page."""
    i = next(n for n, s in enumerate(SITE_GRAPH) if s.name == "attention.o_proj")
    changed = list(SITE_GRAPH)
    changed[i] = dataclasses.replace(changed[i], inputs=changed[i].inputs + ("attention.g_proj",))
    monkeypatch.setattr(points_doc, "SITE_GRAPH", tuple(changed))
    assert points_doc.table_markdown() != PAGE.read_text()


def _rows() -> dict[tuple[str, str], tuple[str, str]]:
    """(site, layers column) -> (shape, dtype) as the page says."""
    out = {}
    for line in PAGE.read_text().split("## Model-level")[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            out[(cells[1].strip("`"), cells[2])] = (cells[3].strip("[]"), cells[4].split(" ")[0])
    return out


def _layer_column(cfg, i: int, site: str) -> str:
    kind = cfg.layer_kind(i)
    for s in layer_graph(kind, cfg.is_moe(i), cfg.q_lora):
        if s.name == site:
            return {"layer": "every", "mla/q_lora": "mla (q-LoRA)", "mla/no_q_lora": "mla (no q-LoRA)"}.get(s.kind,
                                                                                                          s.kind)
    raise KeyError(site)


@pytest.mark.parametrize("name", ["tiny-bf16.h5", "tiny-flash-bf16.h5"])
def test_shapes_and_dtypes_match_the_golden_dumps(name):
    rows = _rows()
    checked = 0
    with DumpReader(DUMPS / name) as d:
        cfg = d.config
    if True:
        with h5py.File(DUMPS / name, "r", locking=False) as h:
            for phase, grp in (("prefill", h["prefill"]), ("decode", h["decode"]["S001"])):
                for lay in grp:
                    if not lay.startswith("L"):
                        continue
                    i = int(lay[1:])
                    for site, ds in grp[lay].items():
                        if site.endswith(":in") and site != "attention.dense:in":
                            continue
                        shape, dtype = rows[(site, _layer_column(cfg, i, site))]
                        T = ds.shape[1] if site not in ("attention.state", "attention.conv_state") else 1
                        want = points_doc.eval_shape(shape, cfg, 1, T)
                        assert tuple(ds.shape) == want, (name, phase, i, site, ds.shape, shape)
                        got = ds.attrs["dtype"]
                        assert got == ("bfloat16" if dtype == "compute" else dtype), (name, phase, i, site, got)
                        checked += 1
    assert checked > 100


def test_the_inputs_column_is_what_the_isolated_replay_feeds():
    text = PAGE.read_text()
    for s in SITE_GRAPH:
        if s.alias or (s.kind == "mla" and s.name == "attention.core"):
            continue
        row = next(l for l in text.splitlines() if f"| `{s.name}` |" in l and f"| {points_doc._kinds(s)} |" in l)
        feeds = row.split("|")[7]
        assert [x.strip(" `") for x in feeds.split(",") if x.strip()] == list(s.inputs) or \
            (s.positions and "positions" in feeds), (s.name, feeds)
