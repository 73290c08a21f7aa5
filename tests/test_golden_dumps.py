"""The bundled golden dumps: MANIFEST integrity, and regeneration from the MANIFEST's recipe gives identical tensors."""

import hashlib
import json
import os

import numpy as np
import pytest

from parity.cli.dump_hf import main as dump_main
from parity.dumpfile import DumpReader, fingerprint_checkpoint
from parity.golden import DUMPS, GOLDEN, ROOT, machine_kind

MANIFEST_DOC = json.loads((DUMPS / "MANIFEST.json").read_text())
MANIFEST = MANIFEST_DOC["dumps"]


def test_manifest_matches_files_and_recipes():
    assert [e["file"] for e in MANIFEST] == [g.file for g in GOLDEN]
    for e, g in zip(MANIFEST, GOLDEN):
        data = (DUMPS / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"], f"{e['file']} changed; rerun tools/golden_dumps.py"
        assert len(data) == e["bytes"] and e["command"] == g.command()
        with DumpReader(DUMPS / e["file"]) as d:  # made from the bundled checkpoint it names
            assert d.fingerprint == fingerprint_checkpoint(ROOT / e["checkpoint"])
            assert d.prompt_len == g.prompt_len and d.steps("decode") == [1, 2, 3, 4]


@pytest.mark.parametrize("golden", GOLDEN, ids=[g.file for g in GOLDEN])
def test_regeneration_gives_identical_tensors(golden, tmp_path, monkeypatch):
    if machine_kind() != MANIFEST_DOC["machine"]:  # parity/golden.py: bit-identity holds per CPU kind
        pytest.skip(f"golden dumps were made on {MANIFEST_DOC['machine']}, this CPU is {machine_kind()}: torch's GEMM "
                    "kernels differ, so regeneration is bit-identical only there (run tools/golden_dumps.py to remake)")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    out = tmp_path / golden.file
    assert dump_main(golden.args(out)) == 0
    with DumpReader(DUMPS / golden.file) as a, DumpReader(out) as b:
        assert a.points() == b.points()
        assert np.array_equal(a.input_ids, b.input_ids)
        for p in a.points():
            x, y = a.read(p), b.read(p)
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), p.key()
