"""tools/dump_hf.py and parity.torch_ref.dump on the bundled tiny checkpoints (issue: dump acceptance).

What is checked independently of the dumper's own code: coverage against the canonical point list of DESIGN §3
(parity.model.points), twin (remote) vs transformers' built-in bailing_hybrid (native) at every shared point, hook
transparency (bit-identical logits), the official-quirk guards, atomic writes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity.model.config import Ling3Config
from parity.dumpfile import DumpReader, validate_dump
from parity.errors import DumpError, ParityError
from parity.model.points import sites_for_config
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.prompts import builtin_ids
from bounds import DUMP_RUNTIMES_REL_L2

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "dumps" / "ckpt"
IDS_80 = builtin_ids(512, 80, seed=3)  # > 64 tokens: the chunked KDA path


def _opts(**kw) -> DumpOptions:
    kw.setdefault("progress", False)
    kw.setdefault("decode_steps", 2)
    return DumpOptions(**kw)


@pytest.fixture(scope="module")
def tiny_dump(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dump") / "tiny.h5"
    dump_checkpoint(CKPT / "tiny", out, IDS_80, _opts(dtype="bfloat16"))
    return out


def test_dump_holds_every_canonical_point(tiny_dump):
    cfg = Ling3Config.from_pretrained_dir(CKPT / "tiny")
    with DumpReader(tiny_dump) as d:
        assert d.unavailable() == {}  # the twin exposes every point through its taps
        assert d.steps("decode") == [1, 2]
        for phase, step, T in [("prefill", 0, 80), ("decode", 1, 1), ("decode", 2, 1)]:
            for s in ("embed", "final_norm", "logits"):
                assert d.has(_pt(phase, step, None, s)), (phase, step, s)
            for i in range(cfg.num_hidden_layers):
                want = set(sites_for_config(cfg, i)) | ({"attention.dense:in"} if cfg.layer_kind(i) == "mla" else set())
                got = set(d.sites(phase, step, i))
                assert want <= got, (phase, step, i, sorted(want - got))
            # canonical shapes (parity.model.points.canonical_shape) and real dtypes
            assert d.read(_pt(phase, step, 1, "attention.gate")).shape == (1, T, 4, 16)
            assert str(d.read(_pt(phase, step, 1, "attention.gate")).dtype) == "float32"  # fp32 gate (facts §8)
            assert str(d.read(_pt(phase, step, 1, "attention.q_proj")).dtype) == "bfloat16"
            assert d.read(_pt(phase, step, 1, "attention.state")).shape == (1, 4, 16, 16)
            assert d.read(_pt(phase, step, 3, "mlp.gate.topk_idx")).shape == (1, T, 4)
        idx = d.read(_pt("prefill", 0, 3, "mlp.gate.topk_idx"))
        assert (np.diff(idx, axis=-1) > 0).all()  # canonical order: ascending expert ids per token
        assert d.input_ids.shape == (1, 82) and d.prompt_len == 80
        meta = d.meta
        assert meta["runtime"] == "remote" and meta["capture_map"] == "twin"
        guards = meta["guards"] if isinstance(meta["guards"], dict) else json.loads(meta["guards"])
        assert guards["causality"]["causal"] is True
        assert "inv_freq" in json.dumps(guards)


def _pt(phase, step, layer, site):
    from parity.model.points import Point

    return Point(phase, step, layer, site)


def test_hooks_change_nothing(tmp_path):
    """Logits of the dumped forward are bit-identical to a plain forward without hooks."""
    import torch

    from parity.torch_ref.loader import load_model

    out = tmp_path / "d.h5"
    dump_checkpoint(CKPT / "tiny", out, IDS_80, _opts(dtype="bfloat16", decode_steps=0))
    lm = load_model(CKPT / "tiny", "remote", dtype=torch.bfloat16)
    with torch.no_grad():
        pos = torch.arange(80)
        plain = lm.model(input_ids=torch.as_tensor(IDS_80), position_ids=pos[None], cache_position=pos,
                         attention_mask=torch.ones(1, 80, dtype=torch.long), use_cache=True).logits
    lm.release()  # leave no fla stand-ins installed for later tests in this process
    with DumpReader(out) as d:
        dumped = d.read(_pt("prefill", 0, None, "logits"))
    # the dump holds lm_head's own output (model dtype); the model returns it upcast with .float() (facts §6):
    # bf16 -> fp32 is exact, so casting back recovers the bits
    assert str(dumped.dtype) == "bfloat16"
    plain_bits = plain.to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(dumped.view(np.int16), plain_bits)


def test_twin_and_native_agree_at_every_shared_point(tmp_path):
    """fp32, Flash-shaped (clamp off: the built-in has none). Measured: max rel-L2 over shared points ~3e-6."""
    ck = tmp_path / "tf"
    shutil.copytree(CKPT / "tiny-flash", ck)
    cfgd = json.loads((ck / "config.json").read_text())
    cfgd["expert_swiglu_limit_list"] = None
    cfgd["share_expert_swiglu_limit_list"] = None
    (ck / "config.json").write_text(json.dumps(cfgd, indent=2, sort_keys=True))
    a, b = tmp_path / "remote.h5", tmp_path / "native.h5"
    dump_checkpoint(ck, a, IDS_80, _opts(dtype="float32", runtime="remote"))
    dump_checkpoint(ck, b, IDS_80, _opts(dtype="float32", runtime="native"))
    with DumpReader(a) as ra, DumpReader(b) as rb:
        shared = sorted(set(ra.points()) & set(rb.points()), key=lambda p: p.key())
        assert len(shared) > 300
        assert rb.unavailable(), "the built-in hides some points; they must be declared, not zero-filled"
        worst = (0.0, None)
        for p in shared:
            x, y = ra.read(p), rb.read(p)
            assert x.shape == y.shape, p
            if x.dtype.kind in "iu":
                assert np.array_equal(x, y), p  # router ids, canonical order
                continue
            x, y = x.astype(np.float64), y.astype(np.float64)
            rel = np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)
            worst = max(worst, (rel, p.key()))
        assert float(worst[0]) < DUMP_RUNTIMES_REL_L2, worst


def test_guards_catch_official_quirks(tmp_path):
    """Each official-file trap switched on in the twin either fails the dump clearly or is neutralised."""
    base = tmp_path / "base.h5"
    dump_checkpoint(CKPT / "tiny", base, IDS_80[:, :40], _opts(dtype="float32"))
    for quirk in ("twin_quirk_uninit_inv_freq", "twin_quirk_cache_len_from_layer0", "twin_quirk_noncausal_sdpa"):
        ck = tmp_path / quirk
        shutil.copytree(CKPT / "tiny", ck)
        cfgd = json.loads((ck / "config.json").read_text())
        cfgd[quirk] = True
        (ck / "config.json").write_text(json.dumps(cfgd, indent=2, sort_keys=True))
        out = tmp_path / f"{quirk}.h5"
        try:
            dump_checkpoint(ck, out, IDS_80[:, :40], _opts(dtype="float32"))
        except ParityError as e:
            assert "causal" in str(e) or "inv_freq" in str(e), str(e)
            assert not out.exists()
            continue
        with DumpReader(base) as r0, DumpReader(out) as r1:
            for p in r0.points():
                np.testing.assert_array_equal(r0.read(p), r1.read(p), err_msg=f"{quirk}: {p.key()}")


def _wait_until(cond, proc: subprocess.Popen, what: str, deadline_s: float = 900.0) -> None:
    """Poll `cond` until it holds (no fixed sleep: a loaded machine only makes this slower); fail if the process
    ends first or nothing happens within a generous deadline."""
    end = time.monotonic() + deadline_s
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (rc {proc.returncode}) before {what}: {err[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"no {what} within {deadline_s:.0f} s")
        time.sleep(0.1)


def _long_dump(out: Path) -> subprocess.Popen:
    """A CLI dump that writes for many seconds (600 tokens, 50 decode steps) — to be interrupted."""
    return subprocess.Popen([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny"), "--out", str(out),
                             "--prompt-len", "600", "--decode-steps", "50", "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _writing(tmp_dir: Path, name: str, min_bytes: int = 1 << 20):
    """Condition: the writer's temporary file exists and holds data (points are being written)."""
    def cond() -> bool:
        return any(f.stat().st_size >= min_bytes for f in tmp_dir.glob(f"{name}.tmp-*") if f.exists())
    return cond


def test_refuses_overwrite_and_interrupted_dump_leaves_nothing(tmp_path, tiny_dump):
    with pytest.raises(ParityError, match="--force"):
        dump_checkpoint(CKPT / "tiny", tiny_dump, IDS_80, _opts())
    out = tmp_path / "killed.h5"
    proc = _long_dump(out)
    _wait_until(_writing(tmp_path, out.name), proc, "temporary file with data")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not out.exists()
    leftovers = list(tmp_path.glob("killed.h5*"))
    assert leftovers, "the writer should have been killed mid-write (temp file present)"
    for f in leftovers:
        with pytest.raises(DumpError):
            validate_dump(f)
    # the next dump of the same file removes the dead writer's temporary file and says so; a running process's
    # temporary file (this test's own PID) is left alone and named
    alive = tmp_path / f"killed.h5.tmp-{os.getpid()}"
    alive.write_bytes(b"\0" * 512 + b"\x89HDF\r\n\x1a\n")
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny"), "--out", str(out),
                        "--prompt-len", "8", "--decode-steps", "0", "--layers", "0", "--no-progress"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    for f in leftovers:
        assert not f.exists() and f"removed {f}: temporary file of a dump that did not finish" in r.stderr, r.stderr
    assert alive.exists() and f"{alive}: temporary file of a running process (PID {os.getpid()}), left alone" \
        in r.stderr, r.stderr
    validate_dump(out)


def test_sigterm_removes_the_temporary_file(tmp_path):
    out = tmp_path / "term.h5"
    proc = _long_dump(out)
    _wait_until(_writing(tmp_path, out.name), proc, "temporary file with data")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # dies of SIGTERM, as without a handler
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), *args, "--no-progress"],
                          capture_output=True, text=True, cwd=REPO)


def _limit_file_size(n: int):
    def preexec():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return preexec


def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """`ulimit -f` while writing (measured on the old writer: ~1,900-5,600 lines of h5py errors, then a segfault)."""
    out = tmp_path / "big.h5"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny"), "--out", str(out),
                        "--prompt-len", "40", "--decode-steps", "4", "--no-progress"],
                       capture_output=True, text=True, cwd=REPO, preexec_fn=_limit_file_size(1 << 20))
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"dump_hf: error: {out}: cannot write the dump (writing ") and \
        "File too large (the process's file-size limit, `ulimit -f`, is 1048576 bytes)" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC (injected below the writer's file object: a real full disk needs a small filesystem to mount), with a
    partial write before it as the kernel does at the last free block."""
    import errno

    import parity.dumpfile as dumpfile

    class FullDisk(dumpfile._SafeFile):
        room = 300_000

        def _write_some(self, view) -> int:
            if FullDisk.room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = min(len(view), FullDisk.room)
            FullDisk.room -= n
            return super()._write_some(view[:n])

    monkeypatch.setattr(dumpfile, "_SafeFile", FullDisk)
    out = tmp_path / "full.h5"
    with pytest.raises(DumpError, match=r"full\.h5: cannot write the dump \(writing .*\): No space left on device "
                                        r"\([\d.]+ MB free in .*\); nothing was left under full\.h5"):
        dump_checkpoint(CKPT / "tiny", out, IDS_80[:, :40], _opts(decode_steps=1, causality_check=False))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, expected", [
    (["--layers", "3-1"], "dump_hf: error: --layers '3-1': range 3-1 is empty (start > end)"),
    (["--layers", "0,9"], "dump_hf: error: --layers '0,9': layer(s) [9] out of range; the model has layers 0..7"),
    (["--layers", "two"], "dump_hf: error: --layers 'two': 'two' is not a layer number or a range"),
    (["--sites", "atention.*"], "dump_hf: error: --sites: pattern 'atention.*' matches no site of the dumped layers"),
    (["--sites", "mlp.gate.*", "--layers", "0"],  # layer 0 is dense
     "dump_hf: error: --sites: pattern 'mlp.gate.*' matches no site of the dumped layers"),
    (["--decode-steps", "-1"], "dump_hf: error: argument --decode-steps: -1: expected an integer >= 0"),
    (["--prompt-len", "0"], "dump_hf: error: argument --prompt-len: 0: expected an integer >= 1"),
    (["--dtype", "fp32,fp16"], "dump_hf: error: argument --dtype: 'fp16': expected bf16 or fp32"),
])
def test_cli_refuses_bad_options_in_one_line(tmp_path, args, expected):
    r = _cli(str(CKPT / "tiny"), "--out", str(tmp_path / "x.h5"), *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(expected), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_dtype_pair_in_one_go(tmp_path):
    """`--dtype fp32,bf16` (issue 25): two dumps of the same prompt and options, named OUT-fp32 / OUT-bf16, each in
    its dtype, the command recorded in each; the pair is what a run triages across tiers."""
    from parity.dumpfile import DumpReader

    r = _cli(str(CKPT / "tiny"), "--out", str(tmp_path / "t.h5"), "--dtype", "fp32,bf16", "--prompt-len", "12",
             "--decode-steps", "1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-bf16.h5", "t-fp32.h5"]
    assert f"--parity-dump {tmp_path / 't-fp32.h5'} --parity-dump {tmp_path / 't-bf16.h5'}" in r.stdout, r.stdout
    readers = {d: DumpReader(tmp_path / f"t-{d}.h5") for d in ("fp32", "bf16")}
    assert readers["fp32"].meta["compute_dtype"] == "float32" and readers["bf16"].meta["compute_dtype"] == "bfloat16"
    assert np.array_equal(readers["fp32"].input_ids, readers["bf16"].input_ids)
    assert readers["fp32"].meta["checkpoint_fingerprint"] == readers["bf16"].meta["checkpoint_fingerprint"]
    # '{dtype}' in --out names the files instead; an existing file of the pair refuses both before anything runs
    r = _cli(str(CKPT / "tiny"), "--out", str(tmp_path / "t-{dtype}.h5"), "--dtype", "fp32,bf16", "--prompt-len", "12")
    assert r.returncode == 2 and "t-fp32.h5" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_cli_refuses_a_directory_as_out(tmp_path):
    r = _cli(str(CKPT / "tiny"), "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dump_hf: error: {tmp_path}: is a directory; expected the path of the dump file"), \
        r.stderr
    r = _cli(str(CKPT / "tiny"), "--out", str(tmp_path), "--force")  # --force does not make a directory a dump
    assert r.returncode == 2 and "is a directory" in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layer_types, expected", [
    (["linear_attention"] * 5 + ["lightning_attention"] + ["linear_attention", "full_attention"],
     "field 'layer_types'[5] = 'lightning_attention', expected 'linear_attention' (KDA) or 'full_attention' (MLA)"),
    (["linear_attention"] * 8, "field 'layer_types'[3] = 'linear_attention', but layer 3 is MLA"),
    (["linear_attention"] * 3, "field 'layer_types' = ['linear_attention', 'linear_attention', 'linear_attention'], "
                               "expected a list of num_hidden_layers = 8 entries"),
])
def test_cli_refuses_a_config_with_bad_layer_types(tmp_path, layer_types, expected):
    ck = tmp_path / "ck"
    shutil.copytree(CKPT / "tiny", ck)
    cfgd = json.loads((ck / "config.json").read_text())
    cfgd["layer_types"] = layer_types
    (ck / "config.json").write_text(json.dumps(cfgd))
    r = _cli(str(ck), "--out", str(tmp_path / "x.h5"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dump_hf: error: {ck / 'config.json'}: {expected}"), r.stderr
    assert not (tmp_path / "x.h5").exists()


def test_remote_code_runs_only_when_trusted_or_the_suites_twin(tmp_path):
    """A checkpoint whose modeling file is not the twin's: refused without --trust-remote-code before any of its code
    runs (the edited file leaves a marker when imported); run with it; --runtime native runs none of it."""
    ck = tmp_path / "ck"
    shutil.copytree(CKPT / "tiny-flash", ck)
    cfg = json.loads((ck / "config.json").read_text())  # no SwiGLU clamp, so --runtime native can run it too
    cfg["expert_swiglu_limit_list"] = cfg["share_expert_swiglu_limit_list"] = None
    (ck / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    marker = tmp_path / "ran"
    with open(ck / "modeling_bailing_moe_v3.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'a').write('imported\\n')\n")
    small = ["--prompt-len", "8", "--decode-steps", "0", "--layers", "0"]
    r = _cli(str(ck), "--out", str(tmp_path / "a.h5"), *small)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dump_hf: error: {ck}: --runtime remote would run the checkpoint's own Python code "
                               "(configuration_bailing_moe_v3.py, modeling_bailing_moe_v3.py; "
                               "modeling_bailing_moe_v3.py differs from the suite's twin (sha256)); "
                               "pass --trust-remote-code"), r.stderr
    assert not marker.exists() and not (tmp_path / "a.h5").exists()
    r = _cli(str(ck), "--out", str(tmp_path / "n.h5"), "--runtime", "native", *small)
    assert r.returncode == 0 and not marker.exists(), r.stderr
    r = _cli(str(ck), "--out", str(tmp_path / "a.h5"), "--trust-remote-code", *small)
    assert r.returncode == 0 and marker.read_text() == "imported\n", r.stderr
    with DumpReader(tmp_path / "a.h5") as d:
        g = d.meta["guards"] if isinstance(d.meta["guards"], dict) else json.loads(d.meta["guards"])
        assert g["remote_code"]["trusted"] == "explicitly" and g["remote_code"]["suite_twin"] is False
    # the library refuses the same way (DumpOptions.trust_remote_code defaults to False)
    with pytest.raises(ParityError, match="differs from the suite's twin"):
        dump_checkpoint(ck, tmp_path / "b.h5", IDS_80[:, :8], _opts(decode_steps=0, layers=[0]))
    # a bundled checkpoint is the twin: trusted without the flag (test_cli_end_to_end runs one)
    from parity.torch_ref.remote_code import twin_mismatch

    assert twin_mismatch(CKPT / "tiny") is None and twin_mismatch(CKPT / "tiny-flash") is None


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "cli.h5"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny-flash"), "--out",
                        str(out), "--builtin-prompt", "short", "--decode-steps", "1", "--layers", "0,5",
                        "--sites", "attention.*,output", "--no-progress"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    with DumpReader(out) as d:
        assert sorted(x for x in d.layers("prefill", 0) if x is not None) == [0, 5]
        assert all(s.startswith("attention") or s == "output" for s in d.sites("prefill", 0, 5))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny-flash"), "--out",
                        str(out), "--builtin-prompt", "short"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "--force" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(CKPT / "tiny-flash"), "--out",
                        str(tmp_path / "x.h5"), "--ids", "1,2,3", "--ids", "4,5"], capture_output=True, text=True)
    assert r.returncode == 2 and "different lengths" in r.stderr


def test_stats_only(tmp_path):
    out = tmp_path / "s.h5"
    dump_checkpoint(CKPT / "tiny", out, IDS_80[:, :20], _opts(stats_only=True, decode_steps=1))
    with DumpReader(out) as d:
        assert d.points() == [] or all(False for _ in d.points())
        st = d.stats(_pt("prefill", 0, 3, "attention.core"))
        assert st["shape"] == [1, 20, 64] and st["rms"] > 0 and st["nan"] == 0


def _h5_content(path: Path) -> dict:
    """Every root attr, dataset (bits) and dataset attr of a dump, by name (HDF5 file bytes are not reproducible
    run to run even on the synchronous path, so the comparison is of content)."""
    import h5py

    out = {"/": {k: str(v) for k, v in h5py.File(path).attrs.items()}}
    with h5py.File(path) as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                out[name] = (data.tobytes() if isinstance(data, np.ndarray) else repr(data),
                             {k: str(v) for k, v in obj.attrs.items()})
        f.visititems(visit)
    return out


def test_writer_thread_and_no_compression_write_what_the_default_writes(tmp_path, tiny_dump, monkeypatch):
    """The background writer is an ordering-preserving fast path of the synchronous one: same datasets, same bits,
    same attributes."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a, b, c = tmp_path / "thread.h5", tmp_path / "sync.h5", tmp_path / "raw.h5"
    ids = IDS_80[:, :70]
    dump_checkpoint(CKPT / "tiny", a, ids, _opts(decode_steps=1, causality_check=False, write_thread=True))
    dump_checkpoint(CKPT / "tiny", b, ids, _opts(decode_steps=1, causality_check=False, write_thread=False))
    dump_checkpoint(CKPT / "tiny", c, ids, _opts(decode_steps=1, causality_check=False, compression="none"))
    ca, cb, cc = _h5_content(a), _h5_content(b), _h5_content(c)
    assert len(ca) > 100 and ca.keys() == cb.keys() == cc.keys()
    assert [k for k in ca if ca[k] != cb[k]] == [] and [k for k in ca if ca[k] != cc[k]] == []
    validate_dump(c)
    assert c.stat().st_size > b.stat().st_size  # the filter really was off


def test_background_writer_raises_a_write_error_in_the_caller():
    from parity.model.points import Point
    from parity.torch_ref.dump import BackgroundWriter

    done = []

    def write(point, arr, attrs):
        if point.site == "bad":
            raise DumpError(f"x.h5: {point.key()}: cannot write")
        done.append(point.site)

    bw = BackgroundWriter(write, max_pending_bytes=16)
    bw.put(Point("prefill", 0, 1, "a"), np.zeros(4, np.float32), {})
    bw.put(Point("prefill", 0, 1, "bad"), np.zeros(4, np.float32), {})
    bw.close(raise_error=False)  # waits for both writes; the error is kept
    assert done == ["a"]
    with pytest.raises(DumpError, match="bad: cannot write"):  # raised in the caller's thread at the next put
        bw.put(Point("prefill", 0, 1, "c"), np.zeros(4, np.float32), {})
