"""parity.dumpfile: bit-exact round trips, atomic writes, validation errors, checkpoint fingerprint (DESIGN §4).

References are independent of the code under test: bit patterns built by hand / numpy, files inspected with plain
h5py, safetensors files written by `safetensors.numpy`, sha256 from hashlib where a byte count matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from parity import dumpfile
from parity.model.config import PRESETS
from parity.dumpfile import DumpReader, DumpWriter, fingerprint_checkpoint, seal_dump, validate_dump
from parity.errors import CheckpointError, DumpError
from parity.model.points import Point

REPO = Path(__file__).resolve().parents[1]
FP_A = "a" * 64


def make_meta(**over) -> dict:
    meta = dict(runtime="twin", model_class="parity.torch_ref.twin.BailingMoeV3ForCausalLM",
                config_json=dict(PRESETS["tiny"]), checkpoint_fingerprint=FP_A, torch_version="2.13.0",
                transformers_version="5.23.0", fla_version="none", device="cpu", compute_dtype="bfloat16", seed=0,
                guards={"causality": "ok"}, checkpoint_dir="/ckpt/a")
    meta.update(over)
    return meta


def write_dump(path: Path, arrays: dict[Point, np.ndarray], *, meta: dict | None = None, force: bool = False) -> Path:
    with DumpWriter(path, meta or make_meta(), force=force) as w:
        for p, a in arrays.items():
            w.write(p, a)
        w.write_tokens(np.array([[5, 6, 7, 8]]), 3)
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


P_CORE = Point("prefill", 0, 3, "attention.core")


# ------------------------------------------------------------------------------------------ round trips
SPECIAL_BF16_BITS = [
    0x0000, 0x8000,  # +0, -0
    0x0001, 0x007F, 0x8001, 0x807F,  # smallest / largest subnormals, both signs
    0x0080, 0x8080,  # smallest normals
    0x7F7F, 0xFF7F,  # ±max finite
    0x7F80, 0xFF80,  # ±Inf
    0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF, 0x7FFF,  # quiet/signalling NaNs with payloads, both signs
    0x3F80, 0xBF80,  # ±1
]


def test_bf16_round_trip_is_bit_exact_for_every_pattern(tmp_path):
    bits = np.concatenate([np.array(SPECIAL_BF16_BITS, np.uint16), np.arange(1 << 16, dtype=np.uint16)])
    bits = np.random.default_rng(0).permutation(bits)[: 2 * 3 * (len(bits) // 6)].reshape(2, 3, -1)
    assert set(SPECIAL_BF16_BITS) <= set(bits.ravel().tolist())
    arr = bits.view(ml_dtypes.bfloat16)
    path = write_dump(tmp_path / "d.h5", {P_CORE: arr})
    with DumpReader(path) as r:
        got = r.read(P_CORE)
        assert got.dtype == np.dtype(ml_dtypes.bfloat16)
        assert got.shape == arr.shape
        np.testing.assert_array_equal(got.view(np.uint16), bits)
        assert r.attrs(P_CORE)["dtype"] == "bfloat16"
    # Storage format of DESIGN §4, checked with plain h5py: the uint16 bits themselves.
    with h5py.File(path, "r") as f:
        ds = f[P_CORE.h5_path()]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
        np.testing.assert_array_equal(ds[()], bits)
        assert ds.compression == "lzf" and ds.shuffle


def test_bf16_comparison_detects_a_changed_nan_payload(tmp_path):
    """Perturbation: a NaN payload change is invisible to value comparison but must fail the bit comparison."""
    bits = np.array(SPECIAL_BF16_BITS, np.uint16)
    path = write_dump(tmp_path / "d.h5", {P_CORE: bits.view(ml_dtypes.bfloat16)})
    i = SPECIAL_BF16_BITS.index(0x7FC1)
    with h5py.File(path, "r+") as f:
        f[P_CORE.h5_path()][i] = 0x7FC0
    with pytest.raises(DumpError, match="damaged file: sha256"):  # the seal notices the edit ...
        DumpReader(path)
    seal_dump(path)  # ... so bless it, to see what the bit comparison itself does
    with DumpReader(path) as r:
        got = r.read(P_CORE).view(np.uint16)
    assert not np.array_equal(got, bits)
    assert np.isnan(float(got[i].view(ml_dtypes.bfloat16)))  # same value class, different bits


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "int64", "uint8", "bool"])
def test_other_dtypes_round_trip_exactly(tmp_path, dtype):
    rng = np.random.default_rng(1)
    if dtype.startswith("float"):
        # every bit pattern class: random bits include NaN payloads, subnormals, infinities
        n = np.dtype(dtype).itemsize
        bits = rng.integers(0, 256, size=(4, 5, 6 * n), dtype=np.uint8)
        arr = bits.view(dtype)
        arr.ravel()[:4] = [0.0, -0.0, np.inf, -np.inf]
    elif dtype == "bool":
        arr = rng.integers(0, 2, (4, 5, 6)).astype(bool)
    else:
        info = np.iinfo(dtype)
        arr = rng.integers(info.min, info.max, (4, 5, 6), dtype=dtype, endpoint=True)
        arr.ravel()[:2] = [info.min, info.max]
    p_scalar = Point("prefill", 0, None, "embed")
    p_empty = Point("decode", 2, 0, "mlp")
    scalar = np.asarray(arr.ravel()[0])
    empty = arr[:0]
    path = tmp_path / "d.h5"
    with DumpWriter(path, make_meta()) as w:
        w.write(P_CORE, arr, module="model.layers.3.attention", io="input", shape_names="B,T,D")
        w.write(p_scalar, scalar)
        w.write(p_empty, empty)
        w.write_tokens(np.array([[1, 2]]), 1)
    with DumpReader(path) as r:
        for p, ref in ((P_CORE, arr), (p_scalar, scalar), (p_empty, empty)):
            got = r.read(p)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert got.tobytes() == ref.tobytes()  # bytes, so NaN payloads and -0 count
        assert r.attrs(P_CORE) == {"dtype": dtype, "module": "model.layers.3.attention", "io": "input",
                                   "shape_names": "B,T,D"}
        np.testing.assert_array_equal(r.read(P_CORE, np.s_[1, 2:4]).view(np.uint8), arr[1, 2:4].view(np.uint8))


def test_large_array_is_chunked(tmp_path):
    arr = np.arange(600 * 1024, dtype=np.float32).reshape(600, 1024)  # 2.4 MB
    path = write_dump(tmp_path / "d.h5", {P_CORE: arr})
    with h5py.File(path, "r") as f:
        ds = f[P_CORE.h5_path()]
        assert ds.chunks is not None and ds.chunks[1] == 1024
        assert np.prod(ds.chunks) * 4 <= dumpfile.CHUNK_BYTES
    with DumpReader(path) as r:
        np.testing.assert_array_equal(r.read(P_CORE), arr)


# ------------------------------------------------------------------------------------------ meta / structure
def test_root_attrs_and_structure(tmp_path):
    pts = {
        Point("prefill", 0, None, "embed"): np.zeros((1, 3, 4), np.float32),
        Point("prefill", 0, 0, "input"): np.zeros((1, 3, 4), np.float32),
        Point("prefill", 0, 0, "output"): np.zeros((1, 3, 4), np.float32),
        Point("prefill", 0, 10, "mlp"): np.zeros((1, 3, 4), np.float32),
        Point("prefill", 0, None, "logits"): np.zeros((1, 3, 8), np.float32),
        Point("decode", 1, 0, "output"): np.zeros((1, 1, 4), np.float32),
        Point("decode", 12, 0, "attention.dense:in"): np.zeros((1, 1, 4), np.float32),
    }
    meta = make_meta(determinism={"deterministic_algorithms": True}, layers_dumped=[0, 10], stats_only=False)
    path = write_dump(tmp_path / "d.h5", pts, meta=meta)
    with h5py.File(path, "r") as f:  # plain h5py view of DESIGN §4
        a = f.attrs
        assert a["schema"] == "ling3-parity-dump" and a["version"] == 1 and bool(a["complete"]) is True
        assert json.loads(a["config_json"]) == PRESETS["tiny"]
        assert a["checkpoint_fingerprint"] == FP_A and a["runtime"] == "twin" and a["seed"] == 0
        assert time.strptime(a["created_utc"], "%Y-%m-%dT%H:%M:%SZ")
        assert json.loads(a["determinism"]) == {"deterministic_algorithms": True}
        assert f["tokens/input_ids"].dtype == np.int32
        assert {"/prefill/L10/mlp", "/decode/S012/L00/attention.dense:in", "/prefill/model/logits"} <= set(
            _all_datasets(f))
    with DumpReader(path) as r:
        assert r.fingerprint == FP_A
        assert r.meta["determinism"] == {"deterministic_algorithms": True}
        assert r.meta["layers_dumped"] == [0, 10] and r.meta["stats_only"] is False
        assert r.meta["guards"] == {"causality": "ok"} and r.meta["tool_version"]
        assert r.config.num_hidden_layers == PRESETS["tiny"]["num_hidden_layers"]
        assert r.input_ids.dtype == np.int32 and r.input_ids.tolist() == [[5, 6, 7, 8]] and r.prompt_len == 3
        assert r.phases() == ["prefill", "decode"]
        assert r.steps("prefill") == [0] and r.steps("decode") == [1, 12]
        assert r.layers("prefill", 0) == [None, 0, 10]
        assert r.sites("prefill", 0, 0) == ["input", "output"]
        assert r.sites("prefill", 0, None) == ["embed", "logits"]
        assert set(r.points()) == set(pts) and len(r.points()) == len(pts)
        assert all(r.has(p) for p in pts) and not r.has(Point("prefill", 0, 1, "input"))
        # dtype() is the logical dtype attr read once on open; attrs() hands out copies of its per-point cache
        assert {r.dtype(p) for p in pts} == {"float32"}
        a = r.attrs(Point("prefill", 0, 0, "input"))
        a["dtype"] = "bfloat16"
        assert r.attrs(Point("prefill", 0, 0, "input"))["dtype"] == "float32"


def _all_datasets(f: h5py.File) -> list[str]:
    out: list[str] = []
    f.visititems(lambda n, o: out.append("/" + n) if isinstance(o, h5py.Dataset) else None)
    return out


def test_missing_point_names_point_file_and_sites(tmp_path):
    path = write_dump(tmp_path / "d.h5", {P_CORE: np.zeros(3, np.float32),
                                          Point("prefill", 0, 3, "attention.o_proj"): np.zeros(3, np.float32)})
    with DumpReader(path) as r:
        with pytest.raises(DumpError, match=r"prefill/L03/attention.gate not in dump .*d\.h5; the dump has sites "
                                            r"attention.core, attention.o_proj"):
            r.read(Point("prefill", 0, 3, "attention.gate"))
        with pytest.raises(DumpError, match=r"prefill/L07/mlp not in dump .*layers L03"):
            r.attrs(Point("prefill", 0, 7, "mlp"))
        with pytest.raises(DumpError, match=r"prefill/L07/mlp not in dump .*layers L03"):
            r.dtype(Point("prefill", 0, 7, "mlp"))


def test_unavailable_and_stats(tmp_path):
    p_stats = Point("decode", 1, 2, "mlp.gate.logits")
    st = {"shape": [1, 1, 16], "dtype": "float32", "nan": 0, "rms": 0.25, "absmax": 1.5}
    path = tmp_path / "d.h5"
    with DumpWriter(path, make_meta()) as w:
        w.write_stats(p_stats, st)
        w.mark_unavailable("L03/attention.gate", "the remote runtime computes the gate inside the kernel")
        w.mark_unavailable(Point("decode", 1, 0, "attention.state"), "hook registered but did not fire")
        with pytest.raises(DumpError, match="marked unavailable twice"):
            w.mark_unavailable("L03/attention.gate", "again")
        with pytest.raises(DumpError, match="statistics of decode/S001/L02/mlp.gate.logits written twice"):
            w.write_stats(p_stats, st)
        w.write_tokens(np.array([[1, 2]]), 1)
    with DumpReader(path) as r:
        assert r.unavailable() == {
            "L03/attention.gate": "the remote runtime computes the gate inside the kernel",
            "decode/S001/L00/attention.state": "hook registered but did not fire",
        }
        assert r.stats(p_stats) == st
        assert r.stats_points() == [p_stats]
        assert not r.has(p_stats) and r.points() == []  # statistics are never mistaken for data
        with pytest.raises(DumpError, match="decode/S001/L02/mlp.gate.logits not in dump"):
            r.read(p_stats)
        with pytest.raises(DumpError, match="no statistics"):
            r.stats(P_CORE)


# ------------------------------------------------------------------------------------------ writer refusals
def test_writer_refuses_bad_input(tmp_path):
    path = tmp_path / "d.h5"
    with pytest.raises(DumpError, match=r"meta lacks required keys \['checkpoint_fingerprint'\]"):
        DumpWriter(path, {k: v for k, v in make_meta().items() if k != "checkpoint_fingerprint"})
    with pytest.raises(DumpError, match="set by the writer"):
        DumpWriter(path, make_meta(complete=True))
    with pytest.raises(DumpError, match="parent directory"):
        DumpWriter(tmp_path / "nope" / "d.h5", make_meta())
    with pytest.raises(ZeroDivisionError):
        with DumpWriter(path, make_meta()) as w:
            w.write(P_CORE, np.zeros(2, np.float32))
            with pytest.raises(DumpError, match="prefill/L03/attention.core written twice"):
                w.write(P_CORE, np.ones(2, np.float32))
            with pytest.raises(DumpError, match="dtype complex64 not storable"):
                w.write(Point("prefill", 0, 0, "x"), np.zeros(2, np.complex64))
            with pytest.raises(DumpError, match="expected a numpy array"):
                w.write(Point("prefill", 0, 0, "x"), [1.0, 2.0])
            with pytest.raises(DumpError, match="shape_names 'B,T' names 2 dims"):
                w.write(Point("prefill", 0, 0, "x"), np.zeros((1, 2, 3)), shape_names="B,T")
            with pytest.raises(DumpError, match="io='inout'"):
                w.write(Point("prefill", 0, 0, "x"), np.zeros(2), io="inout")
            with pytest.raises(DumpError, match="malformed point"):
                w.write(Point("decode", 0, 0, "x"), np.zeros(2))
            with pytest.raises(DumpError, match="prompt_len 9"):
                w.write_tokens(np.array([[1, 2]]), 9)
            with pytest.raises(DumpError, match="cannot also be unavailable"):
                w.mark_unavailable(P_CORE, "why")
            1 / 0
    assert not path.exists() and not list(tmp_path.glob("d.h5.tmp-*"))  # aborted: temp deleted, nothing left


def test_finish_without_tokens_leaves_nothing(tmp_path):
    path = tmp_path / "d.h5"
    with pytest.raises(DumpError, match="write_tokens"):
        with DumpWriter(path, make_meta()) as w:
            w.write(P_CORE, np.zeros(2, np.float32))
    assert not path.exists() and not list(tmp_path.glob("d.h5.tmp-*"))


def test_regeneration_is_byte_identical_with_source_date_epoch(tmp_path, monkeypatch):
    """The golden-dump check of DESIGN §4 needs bit-identical regeneration: created_utc is the only varying byte."""
    arrays = {P_CORE: np.arange(12, dtype=np.float32).reshape(3, 4)}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a = write_dump(tmp_path / "a.h5", arrays).read_bytes()
    b = write_dump(tmp_path / "b.h5", arrays).read_bytes()
    assert a == b
    with DumpReader(tmp_path / "a.h5") as r:
        assert r.meta["created_utc"] == "2023-11-14T22:13:20Z"  # date -u -d @1700000000
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000001")  # perturbation: one second later, bytes differ
    assert write_dump(tmp_path / "c.h5", arrays).read_bytes() != a
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(DumpError, match="SOURCE_DATE_EPOCH='yesterday'"):
        write_dump(tmp_path / "d.h5", arrays)
    assert not list(tmp_path.glob("d.h5*"))


def test_writes_go_to_a_temporary_sibling(tmp_path):
    path = tmp_path / "d.h5"
    with DumpWriter(path, make_meta()) as w:
        w.write(P_CORE, np.zeros(2, np.float32))
        w.write_tokens(np.array([[1]]), 1)
        assert not path.exists() and w.tmp_path.exists() and w.tmp_path.parent == tmp_path
    assert path.exists() and not w.tmp_path.exists()
    validate_dump(path)
    # the writer's bookkeeping for the bench's HDF5 write rate: the array bytes it was handed, and its own time
    assert w.array_bytes == np.zeros(2, np.float32).nbytes and w.seconds_writing > 0


# ------------------------------------------------------------------------------------------ overwrite / force
def test_existing_dump_is_never_overwritten_without_force(tmp_path):
    path = write_dump(tmp_path / "d.h5", {P_CORE: np.zeros(2, np.float32)})
    before = sha(path)
    with pytest.raises(DumpError, match=r"d\.h5: a dump already exists; pass --force"):
        DumpWriter(path, make_meta(runtime="native"))
    assert sha(path) == before and not list(tmp_path.glob("d.h5.tmp-*"))


def test_force_replaces_only_when_complete(tmp_path):
    path = write_dump(tmp_path / "d.h5", {P_CORE: np.zeros(2, np.float32)})
    before = sha(path)
    # A forced run that dies: the old dump survives intact.
    with pytest.raises(RuntimeError):
        with DumpWriter(path, make_meta(runtime="native"), force=True) as w:
            w.write(P_CORE, np.ones(2, np.float32))
            raise RuntimeError("run died")
    assert sha(path) == before and not list(tmp_path.glob("d.h5.tmp-*"))
    # A forced run that finishes: old file untouched until the rename, then replaced.
    with DumpWriter(path, make_meta(runtime="native"), force=True) as w:
        w.write(P_CORE, np.ones(2, np.float32))
        w.write_tokens(np.array([[1]]), 1)
        assert sha(path) == before
        assert validate_dump(path)["runtime"] == "twin"
    with DumpReader(path) as r:
        assert r.meta["runtime"] == "native"
        np.testing.assert_array_equal(r.read(P_CORE), np.ones(2, np.float32))


KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from parity.dumpfile import DumpWriter
    from parity.model.points import Point
    meta = json_meta = __import__("json").loads(sys.argv[2])
    w = DumpWriter(sys.argv[1], meta).__enter__()
    for i in range(10**6):
        w.write(Point("prefill", 0, i, "input"), np.full((64, 256), i, np.float32))
        if i == 20:
            print("WRITING", w.tmp_path, flush=True)
""")


def test_killed_writer_leaves_no_dump(tmp_path):
    path = tmp_path / "d.h5"
    meta = make_meta()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), json.dumps(meta)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("WRITING"), proc.stderr.read()
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not path.exists()
    tmp = Path(line.split(maxsplit=1)[1].strip())
    assert tmp.exists() and tmp.parent == tmp_path and tmp.name.startswith("d.h5.tmp-")
    with pytest.raises(DumpError, match=r"incomplete dump \(no seal\): written by a run that did not finish") as e:
        validate_dump(tmp)
    assert str(tmp) in str(e.value)
    with pytest.raises(DumpError):
        DumpReader(tmp)


# ------------------------------------------------------------------------------------------ validation
@pytest.fixture
def good_dump(tmp_path) -> Path:
    return write_dump(tmp_path / "good.h5", {P_CORE: np.arange(6, dtype=np.float32).reshape(2, 3),
                                             Point("prefill", 0, 3, "mlp"): np.zeros(4, ml_dtypes.bfloat16)})


def _edit(path: Path, fn) -> Path:
    """A deliberate edit with plain h5py, re-sealed so that the semantic checks (not the seal) are exercised."""
    with h5py.File(path, "r+") as f:
        fn(f)
    seal_dump(path)
    return path


def test_validate_accepts_good_dump_and_returns_meta(good_dump):
    meta = validate_dump(good_dump, expect_fingerprint=FP_A)
    assert meta["schema"] == "ling3-parity-dump" and meta["complete"] is True and meta["checkpoint_fingerprint"] == FP_A


def test_foreign_and_missing_files(tmp_path):
    txt = tmp_path / "notes.h5"
    txt.write_text("hello, not HDF5\n" * 100)
    with pytest.raises(DumpError, match=r"notes\.h5: foreign file: not an HDF5 file"):
        validate_dump(txt)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DumpError, match=r"other\.h5: foreign file: an HDF5 file without the ling3-parity .*seal"):
        DumpReader(other)
    with pytest.raises(DumpError, match="no such dump file"):
        validate_dump(tmp_path / "absent.h5")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f.attrs.__setitem__("schema", "other-tool"), r"foreign file: schema='other-tool'"),
        (lambda f: f.attrs.__setitem__("version", 2), r"unsupported dump version 2"),
        (lambda f: f.attrs.__setitem__("complete", False), r"written by a run that did not finish"),
        (lambda f: f.attrs.__delitem__("complete"), r"complete=None.*did not finish"),
        (lambda f: f[P_CORE.h5_path()].attrs.__setitem__("dtype", "bfloat17"), r"dtype attr 'bfloat17' is unknown"),
        (lambda f: f[P_CORE.h5_path()].attrs.__setitem__("dtype", "bfloat16"),
         r"prefill/L03/attention.core: dtype attr 'bfloat16' is inconsistent with its storage float32"),
        (lambda f: f["prefill/L03/mlp"].attrs.__delitem__("dtype"), r"dtype attr None is unknown"),
        (lambda f: f.attrs.__setitem__("config_json", "{not json"), r"config_json is not valid JSON"),
        (lambda f: f.create_group("prefill/Layer4"), r"expected 'model' or a layer group"),
        (lambda f: f.__delitem__("tokens"), r"/tokens missing"),
        (lambda f: f.attrs.__delitem__("schema"), r"foreign file: HDF5 without a 'schema' attribute"),
    ],
)
def test_validation_errors(good_dump, edit, message):
    _edit(good_dump, edit)
    with pytest.raises(DumpError, match=message) as e:
        validate_dump(good_dump)
    assert str(good_dump) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DumpError, match=message):
        DumpReader(good_dump)


def test_truncated_file(good_dump):
    data = good_dump.read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 600):
        good_dump.write_bytes(data[:cut])
        with pytest.raises(DumpError, match=rf"truncated file: {cut} bytes, the seal says {len(data)}") as e:
            DumpReader(good_dump, verify=False)
        assert str(good_dump) in str(e.value)
    good_dump.write_bytes(data[:40])  # inside the seal line itself
    with pytest.raises(DumpError, match="damaged seal"):
        validate_dump(good_dump)


def test_seal_detects_one_changed_byte_anywhere(good_dump):
    data = good_dump.read_bytes()
    assert data.startswith(dumpfile.SEAL_MAGIC) and data[512:520] == b"\x89HDF\r\n\x1a\n"
    sealed = json.loads(data[len(dumpfile.SEAL_MAGIC):512].split(b"\n")[0])
    assert sealed == {"size": len(data), "sha256": hashlib.sha256(data[512:]).hexdigest()}  # independent hashlib
    for pos in (512, len(data) // 2, len(data) - 1):
        good_dump.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:])
        with pytest.raises(DumpError, match="damaged file: sha256"):
            validate_dump(good_dump)
    good_dump.write_bytes(data)
    validate_dump(good_dump)


def test_fingerprint_mismatch_names_both(good_dump):
    fp_b = "b" * 64
    with pytest.raises(DumpError) as e:
        DumpReader(good_dump, expect_fingerprint=fp_b)
    msg = str(e.value)
    assert FP_A in msg and fp_b in msg and "/ckpt/a" in msg and "made from checkpoint" in msg
    with pytest.raises(DumpError, match="fingerprint mismatch"):
        validate_dump(good_dump, expect_fingerprint=fp_b)
    with DumpReader(good_dump, expect_fingerprint=FP_A) as r:
        assert r.fingerprint == FP_A


def test_several_processes_read_one_dump_at_once(good_dump):
    """Read-only opens without HDF5 locking: another process reads while this one holds the file open."""
    code = ("import sys; from parity.dumpfile import DumpReader; from parity.model.points import Point\n"
            "with DumpReader(sys.argv[1]) as r: print(r.read(Point('prefill', 0, 3, 'attention.core')).sum())")
    with DumpReader(good_dump) as r:
        out = subprocess.run([sys.executable, "-c", code, str(good_dump)], capture_output=True, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) == 15.0 == float(r.read(P_CORE).sum())


# ------------------------------------------------------------------------------------------ fingerprint
def make_ckpt(d: Path, *, shards: int = 2, cfg: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg or PRESETS["tiny"], indent=2))
    rng = np.random.default_rng(0)
    for s in range(shards):
        save_file({f"model.layers.{s}.w": rng.standard_normal((8, 4)).astype(np.float32),
                   f"model.layers.{s}.b": np.arange(4, dtype=np.int64)},
                  str(d / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    return d


def _header_len(p: Path) -> int:
    return int.from_bytes(p.read_bytes()[:8], "little")


def test_fingerprint_ignores_tensor_bytes(tmp_path):
    d = make_ckpt(tmp_path / "c")
    fp = fingerprint_checkpoint(d)
    assert len(fp) == 64 and int(fp, 16) >= 0
    shard = sorted(d.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    start = 8 + _header_len(shard)
    raw[start:] = bytes(255 - b for b in raw[start:])  # every tensor byte changed, header unchanged
    shard.write_bytes(bytes(raw))
    assert fingerprint_checkpoint(d) == fp


def test_fingerprint_reads_only_headers(tmp_path, monkeypatch):
    """Count the bytes read from each safetensors file: exactly the 8-byte length + the header."""
    d = make_ckpt(tmp_path / "c")
    counts: dict[str, int] = {}
    real_open = open

    class Counting:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def read(self, n=-1):
            b = self.f.read(n)
            counts[self.name] = counts.get(self.name, 0) + len(b)
            return b

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(dumpfile, "open", lambda p, mode="r", *a, **k: Counting(real_open(p, mode, *a, **k),
                                                                                Path(p).name), raising=False)
    fingerprint_checkpoint(d)
    shards = sorted(d.glob("*.safetensors"))
    assert counts == {p.name: 8 + _header_len(p) for p in shards}
    assert all(p.stat().st_size > counts[p.name] for p in shards)


def test_fingerprint_changes_with_config_header_and_files(tmp_path):
    d = make_ckpt(tmp_path / "c")
    fp = fingerprint_checkpoint(d)
    # config.json byte change
    (d / "config.json").write_text((d / "config.json").read_text() + "\n")
    fp_cfg = fingerprint_checkpoint(d)
    assert fp_cfg != fp
    # header change with identical tensor bytes: a tensor renamed (same length name)
    shard = sorted(d.glob("*.safetensors"))[1]
    raw = shard.read_bytes()
    shard.write_bytes(raw.replace(b"model.layers.1.w", b"model.layers.1.v"))
    fp_hdr = fingerprint_checkpoint(d)
    assert fp_hdr != fp_cfg
    # a renamed shard file, and an extra shard
    shard.rename(d / "zz.safetensors")
    fp_name = fingerprint_checkpoint(d)
    assert fp_name != fp_hdr
    save_file({"x": np.zeros(2, np.float32)}, str(d / "extra.safetensors"))
    assert fingerprint_checkpoint(d) != fp_name
    # a different checkpoint directory with identical files has the same fingerprint (content, not location)
    e = make_ckpt(tmp_path / "e")
    f = make_ckpt(tmp_path / "f")
    assert fingerprint_checkpoint(e) == fingerprint_checkpoint(f) == fp


def test_fingerprint_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        fingerprint_checkpoint(tmp_path)
    d = make_ckpt(tmp_path / "c", shards=1)
    shard = next(d.glob("*.safetensors"))
    raw = shard.read_bytes()
    cases = [
        (raw[:5], r">= 8"),
        ((10**9).to_bytes(8, "little") + raw[8:], "exceeds the file size"),
        ((8).to_bytes(8, "little") + b"not json" + raw[16:], "not a UTF-8 JSON object"),
        ((2).to_bytes(8, "little") + b"[]", "JSON list, expected an object"),
        (raw[: len(raw) - 4], "data_offsets"),  # truncated tensor data: offsets point past the end
    ]
    for content, msg in cases:
        shard.write_bytes(content)
        with pytest.raises(CheckpointError, match=msg) as e:
            fingerprint_checkpoint(d)
        assert shard.name in str(e.value)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        fingerprint_checkpoint(d)
