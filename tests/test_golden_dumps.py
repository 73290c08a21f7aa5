"""The bundled golden dumps: MANIFEST integrity, and regeneration from the MANIFEST's recipe gives identical tensors."""

import hashlib
import json
import os

import numpy as np
import pytest

from parity.cli.dump_hf import main as dump_main
from parity.dumpfile import DumpReader, fingerprint_checkpoint
from parity.golden import DUMPS, GOLDEN, ROOT, dump_structure, machine_kind, structure_differences
from parity.torch_ref import official
from parity.torch_ref.ckpt import main as make_ckpt_main
from parity.torch_ref.official import OFFICIAL_SHA256

MANIFEST = json.loads((DUMPS / "MANIFEST.json").read_text())["dumps"]


def test_manifest_matches_files_and_recipes():
    assert [e["file"] for e in MANIFEST] == [g.file for g in GOLDEN]
    for e, g in zip(MANIFEST, GOLDEN):
        data = (DUMPS / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"], f"{e['file']} changed; rerun tools/golden_dumps.py"
        assert len(data) == e["bytes"] and e["command"] == g.command() and e["runtime"] == g.runtime
        with DumpReader(DUMPS / e["file"]) as d:  # made from the bundled checkpoint it names
            assert d.fingerprint == fingerprint_checkpoint(ROOT / e["checkpoint"])
            assert d.prompt_len == g.prompt_len and d.steps("decode") == [1, 2, 3, 4]
            code = d.meta["guards"].get("remote_code")  # recorded since issue 14 (older goldens: twin by recipe)
            if g.runtime == "official":  # the official file ran, verifiably: its published sha256 is recorded
                assert e["official_sha256"] == OFFICIAL_SHA256
                assert code["sha256"]["modeling_bailing_moe_v3.py"] == OFFICIAL_SHA256 and not code["suite_twin"]
                assert d.mtp_points(), "the official golden holds the MTP layer's points (tiny-flash has one)"
            else:
                assert code is None or code["suite_twin"]


def test_official_golden_records_its_semantic_departure():
    """The official file ignores the SwiGLU clamp lists (facts §5.7): the golden says so, measured by the probe."""
    g = next(g for g in GOLDEN if g.runtime == "official")
    with DumpReader(DUMPS / g.file) as d:
        sem = d.semantics
    assert sem["swiglu_clamp"] == "ignored" and sem["departures"] == ["swiglu_clamp"]
    assert sem["kda_gate_precision"] == sem["kda_beta_precision"] == "float32"


def regenerate(golden, out_dir) -> "os.PathLike":
    """Remake one golden with its MANIFEST recipe into out_dir (from the repository root, created_utc fixed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / golden.file
    ckpt = None
    if golden.runtime == "official":
        ok, why = official.available()
        if not ok:
            pytest.skip(why)
        ckpt = out_dir / "ckpt"
        assert make_ckpt_main(golden.prepare_command(ckpt)) == 0
    old_cwd, old_epoch = os.getcwd(), os.environ.get("SOURCE_DATE_EPOCH")
    os.chdir(ROOT)
    os.environ["SOURCE_DATE_EPOCH"] = "0"
    try:
        assert dump_main(golden.args(out, ckpt)) == 0
    finally:
        os.chdir(old_cwd)
        if old_epoch is None:
            os.environ.pop("SOURCE_DATE_EPOCH", None)
        else:
            os.environ["SOURCE_DATE_EPOCH"] = old_epoch
    return out


@pytest.fixture(scope="module", params=GOLDEN, ids=[g.file for g in GOLDEN])
def regenerated(request, tmp_path_factory):
    """(golden, path of its regeneration): one regeneration per golden, shared by the structure and the bits test."""
    golden = request.param
    return golden, regenerate(golden, tmp_path_factory.mktemp(golden.file.removesuffix(".h5")))


def test_regeneration_has_the_same_structure(regenerated):
    """On every CPU: the points, shapes, dtypes, attrs and CPU-independent root attrs of a regeneration are the
    bundled golden's (a capture change that adds or removes points fails here, not only on the MANIFEST's CPU)."""
    golden, out = regenerated
    diffs = structure_differences(dump_structure(DUMPS / golden.file), dump_structure(out))
    assert not diffs, (f"dumps/{golden.file} is stale: {len(diffs)} difference(s) with its regeneration (rerun "
                       f"tools/golden_dumps.py --only {golden.file}):\n" + "\n".join(diffs[:20]))


def test_regeneration_gives_identical_tensors(regenerated):
    golden, out = regenerated
    made_on = next(e["machine"] for e in MANIFEST if e["file"] == golden.file)
    if machine_kind() != made_on:  # parity/golden.py: bit-identity holds per CPU kind
        pytest.skip(f"{golden.file} was made on {made_on}, this CPU is {machine_kind()}: torch's GEMM kernels "
                    "differ, so regeneration is bit-identical only there (its structure is checked everywhere)")
    with DumpReader(DUMPS / golden.file) as a, DumpReader(out) as b:
        assert a.points() == b.points() and a.mtp_points() == b.mtp_points()
        assert np.array_equal(a.input_ids, b.input_ids)
        for p in [*a.points(), *a.mtp_points()]:
            x, y = a.read(p), b.read(p)
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), p.key()


def test_a_capture_change_fails_the_structure_check(tmp_path, monkeypatch):
    """A capture point added without regenerating the goldens is named by the structure check, on any CPU."""
    from parity.torch_ref import capture

    golden = next(g for g in GOLDEN if g.file == "tiny-bf16.h5")  # the smallest: 40 tokens
    extra = capture.TapSpec("model.layers.{i}.attention.o_norm", "attention.o_norm:in", io="input", index=0,
                            kind="kda", scope="main")
    monkeypatch.setitem(capture.RUNTIME_MAPS, "twin", [*capture.RUNTIME_MAPS["twin"], extra])
    out = regenerate(golden, tmp_path)
    diffs = structure_differences(dump_structure(DUMPS / golden.file), dump_structure(out))
    added = [d for d in diffs if "attention.o_norm:in: recorded by the capture now" in d]
    assert added and all(d.startswith(("prefill/L", "decode/S")) for d in added), diffs[:10]


def test_structure_reads_a_dump_this_process_already_holds_open():
    """An xdist worker may hold a bundled dump open through a DumpReader (locking off, for concurrent readers) when
    the structure check reads it: HDF5 refuses a second open with other locking flags ("file locking flag values
    don't match", measured in a `-n 2` run), so the check opens it the reader's way."""
    from parity.dumpfile import DumpReader
    from parity.golden import dump_structure

    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "dumps" / "tiny-bf16.h5"
    with DumpReader(path):
        assert dump_structure(path)["datasets"]
