"""HDF5 dump file, schema `ling3-parity-dump` version 1 (DESIGN §4): writer, lazy reader, validator, fingerprint.

Layout (DESIGN §4):

    (userblock, 512 B)       the seal: size + sha256 of the rest, written after the file is closed (see "seal")
    /                        root attrs: schema, version, created_utc, tool_version, runtime, model_class, config_json,
                             checkpoint_fingerprint, torch/transformers/fla versions, device, compute_dtype, seed,
                             complete, + any extra meta (non-scalars JSON-encoded; their names in attr `json_keys`),
                             e.g. `kernels` (kernel provenance, parity.provenance; absent in older dumps)
    /tokens/input_ids        [B, T_total] int32 (prompt + decode tokens)
    /tokens/prompt_len       scalar int64
    /prefill/model/<site>    model-level sites (embed, final_norm, logits)
    /prefill/L03/<site>      one dataset per site; attrs dtype, module, io, shape_names
    /decode/S001/L03/<site>  the same per decode step
    /prefill/MTP0/<site>     MTP layer j's points (`parity.model.mtp_points`): their own group, never mixed into the main
    /decode/S001/MTP0/<site> stack's (the reader lists them apart: `mtp_points()`; `points()` is the main stack)
    /unavailable             [N, 2] strings: (point or site pattern, reason) a runtime cannot provide (never zeros)
    /stats/<point path>      statistics-only mode: an *empty* dataset (h5py.Empty) whose attrs are the statistics;
                             kept apart from the data tree so `has(point)` / `read(point)` never see a stats-only point
                             as data (a replay reports it as missing instead of comparing against nothing).

bfloat16 has no HDF5 type (env_notes "HDF5 and safetensors"): it is stored as its uint16 bits with attr
dtype="bfloat16" and read back as an `ml_dtypes.bfloat16` view, bit-exact.

Every problem with a file (foreign, truncated, incomplete, of another checkpoint, malformed) is a one-line `DumpError`
naming the file (DESIGN §10); no h5py/numpy exception escapes the reader (tests/test_dumpfile_fuzz.py corrupts files
at random to check it).
"""

from __future__ import annotations

import datetime as _dt
import errno
import glob
import hashlib
import io
import json
import logging
import os
import re
import resource
import signal
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import h5py
import ml_dtypes
import numpy as np

from parity.errors import CheckpointError, ConfigError, DumpError, ParityError
from parity.model.mtp_points import GROUP_RE as _MTP_RE
from parity.model.mtp_points import MtpPoint
from parity.model.points import Point, mtp_site
from parity.provenance import check_kernels

SCHEMA = "ling3-parity-dump"
VERSION = 1

# Root attrs the writer needs from the caller's meta (DESIGN §4); schema/version/created_utc/complete are its own.
REQUIRED_META = (
    "runtime",
    "model_class",
    "config_json",
    "checkpoint_fingerprint",
    "torch_version",
    "transformers_version",
    "fla_version",
    "device",
    "compute_dtype",
    "seed",
)
WRITER_META = ("schema", "version", "created_utc", "complete", "json_keys")

# Real dtype name (attr `dtype`) -> numpy storage dtype. bfloat16 is stored as its bits.
STORAGE = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bool": np.dtype(np.bool_),
    **{n: np.dtype(n) for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
}
IO_KINDS = ("input", "output")

# Compression, measured on this machine (2 shared cores): one [12800, 2048] bf16 array of N(0, 0.5) values (52 MB)
# written with DumpWriter.write (1 MiB chunks), then DumpReader(...).read; two runs each, MB/s of array bytes:
#                     write     write + finish (seal)   open (sha256) + read   size / raw
#   lzf + shuffle     142-149   118-126                 240-300                0.84    <- chosen
#   gzip 1 + shuffle   53-54     50-51                  195-245                0.72
#   none             2300-2700  490-560                 620-685                1.00
# (plain h5py, no writer, 51 KB auto-chunks: lzf alone 116 MB/s but size 0.996 — bf16 bits need the shuffle.)
# lzf + shuffle writes ~2.7x faster than gzip 1 + shuffle for 16 % more bytes; a dump streams as hooks fire, so write
# speed is what slows a real-model dump. Both are built into h5py (no extra package, DESIGN §4).
# Filters that need no extra package (DESIGN §4). "lzf" (shuffle + lzf) is the default; "none" trades ~15 % more disk
# for ~10x cheaper writes (bf16 activations barely compress: measured on a 4-layer Ling3-Tiny-shaped dump, 79 MB of
# arrays: lzf+shuffle 0.85 of raw at 78-170 MB/s, none 1.03 at 765 MB/s; README "Performance").
COMPRESSIONS = {"lzf": dict(compression="lzf", shuffle=True), "none": {}}
CHUNK_BYTES = 1 << 20  # ~1 MiB chunks: large enough for the filters to be efficient, small enough for lazy slicing

_LAYER_RE = re.compile(r"^L(\d{2,})$")
_STEP_RE = re.compile(r"^S(\d{3,})$")
# "backward" (issue 26): the cotangents and weight gradients of one backward pass of the prefill, one step (0)
_PHASES = ("prefill", "decode", "backward")


# ---------------------------------------------------------------------------------------------------- fingerprint
def fingerprint_checkpoint(ckpt_dir: str | os.PathLike) -> str:
    """sha256 over config.json's bytes and every top-level `*.safetensors` header (never the tensor bytes).

    Files are taken in sorted name order; each contributes its name, its length prefix and its bytes (config.json) or
    its 8-byte little-endian header length + JSON header (safetensors), so a renamed file or a changed dtype/shape/
    offset changes the fingerprint while a re-save with identical headers and config does not need the tensors read.
    """
    d = Path(ckpt_dir)
    cfg = d / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{cfg}: missing; a checkpoint directory needs a config.json to be fingerprinted")
    shards = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    if not shards:
        raise CheckpointError(f"{d}: no *.safetensors files; nothing to fingerprint besides config.json")
    h = hashlib.sha256()

    def add(name: str, payload: bytes) -> None:
        h.update(name.encode() + b"\0" + struct.pack("<Q", len(payload)))
        h.update(payload)

    try:
        add("config.json", cfg.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{cfg}: cannot read ({e.strerror or e})") from None
    for p in shards:
        add(p.name, _safetensors_header(p))
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    """The 8-byte length prefix + JSON header of a safetensors file, checked against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: malformed safetensors header: file has {size} bytes, expected >= 8")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: malformed safetensors header: header length {n} exceeds the file size {size} - 8"
                )
            header = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        obj = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header: not a UTF-8 JSON object ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: malformed safetensors header: JSON {type(obj).__name__}, expected an object")
    data_len = size - 8 - n
    for name, info in obj.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise CheckpointError(
                f"{path}: malformed safetensors header: tensor {name!r} data_offsets {offs!r}, expected "
                f"[begin, end] within the {data_len} data bytes"
            )
    return prefix + header


# ---------------------------------------------------------------------------------------------------- helpers
@contextmanager
def _h5_errors(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn anything h5py/numpy raise on a damaged file into a one-line DumpError naming the file."""
    try:
        yield
    except ParityError:
        raise
    except Exception as e:  # h5py raises OSError, KeyError, RuntimeError, ValueError, TypeError, ... on bad files
        msg = str(e).splitlines()[0] if str(e) else ""
        raise DumpError(f"{path}: {what}: {type(e).__name__}: {msg} (truncated or damaged file?)") from None


def _attr_value(v: Any) -> Any:
    """An h5py attr value as a plain Python value."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_, str, float, np.floating)):
        return True
    if isinstance(v, (int, np.integer)):
        return -(2**63) <= int(v) < 2**63
    return False


def _encode_attrs(d: dict, *, where: str) -> tuple[dict, list[str]]:
    """Scalars as is, everything else JSON-encoded (names returned so the reader can decode them back)."""
    out, json_keys = {}, []
    for k, v in d.items():
        if not isinstance(k, str) or not k:
            raise DumpError(f"{where}: attribute name {k!r}, expected a non-empty string")
        if _is_scalar(v):
            out[k] = v.item() if isinstance(v, np.generic) else v
        else:
            try:
                out[k] = json.dumps(v, sort_keys=True, default=_json_default)
            except (TypeError, ValueError) as e:
                raise DumpError(f"{where}: attribute {k!r} is not JSON-serialisable ({e})") from None
            json_keys.append(k)
    return out, json_keys


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (Path, Point, MtpPoint)):
        return str(o) if isinstance(o, Path) else o.key()
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def _decode_attrs(attrs: h5py.AttributeManager, *, where: str) -> dict:
    raw = {k: _attr_value(attrs[k]) for k in attrs.keys()}
    json_keys = raw.pop("json_keys", "[]")
    try:
        keys = json.loads(json_keys) if isinstance(json_keys, str) else None
    except json.JSONDecodeError:
        keys = None
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise DumpError(f"{where}: attr json_keys {json_keys!r}, expected a JSON list of attribute names")
    for k in keys:
        if k not in raw:
            continue
        try:
            raw[k] = json.loads(raw[k])
        except (TypeError, json.JSONDecodeError):
            raise DumpError(f"{where}: attr {k!r} is listed in json_keys but is not valid JSON") from None
    return raw


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """~CHUNK_BYTES chunks: whole trailing dims where possible, split along the leading ones."""
    chunk = list(shape)
    budget = max(1, CHUNK_BYTES // itemsize)
    for ax in range(len(shape)):
        inner = int(np.prod(chunk[ax + 1:], dtype=np.int64)) if ax + 1 < len(shape) else 1
        if inner * chunk[ax] <= budget:
            break
        chunk[ax] = max(1, budget // inner) if inner <= budget else 1
    return tuple(max(1, c) for c in chunk)


def _sort_key(p: Point | MtpPoint) -> tuple:
    """(phase, step, model-level / layers / MTP layers, site): the main stack first, then the MTP layers."""
    ph = _PHASES.index(p.phase) if p.phase in _PHASES else 9
    if isinstance(p, MtpPoint):
        return (ph, p.step, 1, p.mtp, p.site)
    return (ph, p.step, 0, -1 if p.layer is None else p.layer, p.site)


# ---------------------------------------------------------------------------------------------------- seal
# HDF5 (the C library) is not hardened against damaged files: a few flipped or zeroed bytes in its metadata can make
# it crash (SIGSEGV) or loop forever while reading attributes — measured with tests/test_dumpfile_fuzz.py's
# corruptions before this seal existed. So no byte of a dump reaches HDF5 unverified: the writer reserves a
# 512-byte HDF5 *userblock* (ignored by HDF5) at the start of the file and, after closing the file, writes there
#     b"ling3-parity-dump seal v1\n" + {"sha256": <hex of bytes[512:]>, "size": <file size>} + "\n", NUL-padded.
# The reader checks size (truncation) and sha256 (any damage) before opening. sha256 runs at ~1.7 GB/s here
# (hashlib, `python -c "import hashlib,os,time; ..."` on 200 MB), i.e. seconds even for a multi-GB real-model dump;
# `verify=False` skips the hash (size is still checked) for callers that accept the risk.
# The seal also carries the DESIGN §4 promise "a crashed run leaves no file that looks complete": it is written last.
USERBLOCK = 512
SEAL_MAGIC = b"ling3-parity-dump seal v1\n"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _file_sha256(path: Path, start: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _seal(path: Path) -> None:
    size = path.stat().st_size
    body = SEAL_MAGIC + json.dumps({"sha256": _file_sha256(path, USERBLOCK), "size": size}).encode() + b"\n"
    with open(path, "r+b") as f:
        f.write(body.ljust(USERBLOCK, b"\0"))
        f.flush()
        os.fsync(f.fileno())


def seal_dump(path: str | os.PathLike) -> None:
    """Re-seal a dump after a *deliberate* edit of its contents (e.g. with h5py in "r+" mode).

    This blesses whatever the file now holds; the semantic checks of `validate_dump` still apply afterwards.
    """
    p = Path(path)
    try:
        head = p.read_bytes()[: USERBLOCK + len(_HDF5_SIGNATURE)]
    except OSError as e:
        raise DumpError(f"{p}: cannot read ({e.strerror or e})") from None
    if head[USERBLOCK:] != _HDF5_SIGNATURE:
        raise DumpError(f"{p}: not a ling3-parity dump layout (no HDF5 signature after a {USERBLOCK}-byte userblock)")
    _seal(p)


def _check_seal(path: Path, verify: bool) -> None:
    try:
        if not path.is_file():
            raise DumpError(f"{path}: no such dump file" if not path.exists() else f"{path}: not a file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(USERBLOCK + len(_HDF5_SIGNATURE))
    except OSError as e:
        raise DumpError(f"{path}: cannot read ({e.strerror or e})") from None
    if not head.startswith(SEAL_MAGIC):
        if head.startswith(_HDF5_SIGNATURE):
            raise DumpError(f"{path}: foreign file: an HDF5 file without the ling3-parity userblock seal, "
                            f"expected schema={SCHEMA!r}")
        if head[USERBLOCK:] == _HDF5_SIGNATURE and not head[:USERBLOCK].strip(b"\0"):
            raise DumpError(f"{path}: incomplete dump (no seal): written by a run that did not finish")
        raise DumpError(f"{path}: foreign file: not an HDF5 file of schema {SCHEMA!r} (no seal, no HDF5 signature)")
    line = head[len(SEAL_MAGIC):USERBLOCK].split(b"\n", 1)[0]
    try:
        seal = json.loads(line.decode("ascii"))
        want_size, want_sha = int(seal["size"]), str(seal["sha256"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise DumpError(f"{path}: damaged seal in the first {USERBLOCK} bytes (not size/sha256 JSON)") from None
    if size != want_size:
        what = "truncated file" if size < want_size else "file longer than sealed"
        raise DumpError(f"{path}: {what}: {size} bytes, the seal says {want_size}")
    if verify:
        got = _file_sha256(path, USERBLOCK)
        if got != want_sha:
            raise DumpError(f"{path}: damaged file: sha256 of its content is {got[:16]}…, the seal says "
                            f"{want_sha[:16]}…")


# ---------------------------------------------------------------------------------------------------- writer
_log = logging.getLogger(__name__)


def check_output_path(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Refuse an output path a dump cannot be written to, before any work is done (one line naming the path)."""
    p = Path(path)
    if p.is_dir():
        raise DumpError(f"{p}: is a directory; expected the path of the dump file to write, e.g. {p / 'dump.h5'}")
    if p.exists() and not force:
        raise DumpError(f"{p}: a dump already exists; pass --force (force=True) to replace it "
                        "(it is never overwritten silently)")
    if p.exists() and not p.is_file():
        raise DumpError(f"{p}: exists and is not a regular file; expected the path of a dump file")
    if not p.parent.is_dir():
        raise DumpError(f"{p}: parent directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise DumpError(f"{p}: directory {p.parent} is not writable")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale_temp_files(path: str | os.PathLike) -> list[str]:
    """Remove `<path>.tmp-<pid>` files left by dump writers that died without cleaning up (SIGKILL, power loss): the
    PID is gone and the file is one of ours (an unsealed or sealed dump layout). Returns one line per file found,
    including those left alone (a running writer's, or not a dump's)."""
    p = Path(path)
    notes: list[str] = []
    if not p.parent.is_dir():
        return notes
    pattern = re.compile(re.escape(p.name) + r"\.tmp-(\d+)")
    for f in sorted(p.parent.glob(glob.escape(p.name) + ".tmp-*")):
        m = pattern.fullmatch(f.name)
        if not m or not f.is_file() or f in _ACTIVE_TMP:
            continue
        pid = int(m[1])
        if pid != os.getpid() and _pid_alive(pid):
            notes.append(f"{f}: temporary file of a running process (PID {pid}), left alone")
            continue
        try:
            with open(f, "rb") as fh:
                head = fh.read(USERBLOCK + len(_HDF5_SIGNATURE))
            if len(head) == len(_HDF5_SIGNATURE) + USERBLOCK and head[USERBLOCK:] != _HDF5_SIGNATURE:
                notes.append(f"{f}: not a dump's temporary file (no HDF5 signature after the userblock), left alone")
                continue
            f.unlink()
        except OSError as e:
            notes.append(f"{f}: stale temporary file of PID {pid} could not be removed ({e.strerror or e})")
            continue
        notes.append(f"removed {f}: temporary file of a dump that did not finish (PID {pid} is gone)")
    return notes


class _SafeFile(io.FileIO):
    """The temporary dump file as HDF5 sees it (h5py's file-object driver). The first OSError of a write or truncate
    (EFBIG from a file-size limit, ENOSPC, EDQUOT, EIO, ...) is kept in `error`, and from then on writes are accepted
    and dropped: HDF5 never sees a failed write. (With HDF5's own sec2 driver, a failed write leaves HDF5 unable to
    close the file: `ulimit -f 2000` printed ~1,900 lines of h5py errors and then segfaulted, h5py 3.16 / HDF5 2.0;
    putting /dev/null under its descriptor does not help, its close then fails on ftruncate.) The writer checks
    `error` after each HDF5 call and abandons the file. `discard` drops every later write (abort)."""

    error: OSError | None = None
    discard: bool = False

    def write(self, b) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        if self.error is None and not self.discard:
            done = 0
            try:
                while done < len(view):  # FileIO.write is one write(2): it may write part (up to a size limit)
                    n = self._write_some(view[done:])
                    if not n:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += n
            except OSError as e:
                self.error = e
        return len(view)

    def _write_some(self, view: memoryview) -> int:
        return super().write(view)

    def truncate(self, size=None) -> int:  # type: ignore[override]
        if self.error is None and not self.discard:
            try:
                return super().truncate(size)
            except OSError as e:
                self.error = e
        return self.tell() if size is None else size


def _describe_io_error(e: OSError, path: Path) -> str:
    what = e.strerror or str(e)
    if e.errno == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        return f"{what} (the process's file-size limit, `ulimit -f`, is {limit})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            st = os.statvfs(path.parent)
            return f"{what} ({st.f_bavail * st.f_frsize / 1e6:.1f} MB free in {path.parent})"
        except OSError:
            return what
    return what


# Temporary files of the writers of this process, removed on SIGTERM (the handler is installed while there are any).
_ACTIVE_TMP: set[Path] = set()


def _on_sigterm(signum, frame) -> None:
    """Remove the temporary dump files, then die of SIGTERM as if there were no handler (exit status 143)."""
    for p in list(_ACTIVE_TMP):
        try:
            os.unlink(p)
        except OSError:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _track_tmp(path: Path) -> None:
    if threading.current_thread() is threading.main_thread():  # signal dispositions: main thread only
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a handler of the caller's own is left alone
            signal.signal(signal.SIGTERM, _on_sigterm)
        # A file-size limit raises SIGXFSZ, whose default kills the process; ignored, the write fails with EFBIG and
        # is reported (Python ignores it at start-up already; an embedding program may not).
        if signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _ACTIVE_TMP.add(path)


def _untrack_tmp(path: Path) -> None:
    _ACTIVE_TMP.discard(path)
    if (not _ACTIVE_TMP and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class DumpWriter:
    """Streams one dump to `path + ".tmp-<pid>"` and renames it onto `path` only when complete.

    Use as a context manager; a clean exit calls `finish()`, an exception deletes the temporary file. An existing
    `path` is refused unless `force`, and even then replaced only at the final `os.replace`. An I/O failure (disk
    full, file-size limit, ...) is one `DumpError` and leaves neither `path` nor the temporary file; SIGTERM removes the
    temporary file; stale temporary files of dead writers of the same `path` are removed when the next one starts.
    """

    def __init__(self, path: str | os.PathLike, meta: dict, *, force: bool = False, compression: str = "lzf") -> None:
        self.path = Path(path)
        self.force = force
        if compression not in COMPRESSIONS:
            raise DumpError(f"{self.path}: compression {compression!r}, expected one of {sorted(COMPRESSIONS)}")
        self._filters = COMPRESSIONS[compression]
        self.tmp_path = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        check_output_path(self.path, force=force)
        if not isinstance(meta, dict):
            raise DumpError(f"{self.path}: meta is a {type(meta).__name__}, expected a dict of root attributes")
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise DumpError(f"{self.path}: meta lacks required keys {missing} (DESIGN §4 root attrs)")
        clash = [k for k in WRITER_META if k in meta]
        if clash:
            raise DumpError(f"{self.path}: meta keys {clash} are set by the writer itself")
        fp = meta["checkpoint_fingerprint"]
        if not (isinstance(fp, str) and fp):
            raise DumpError(f"{self.path}: meta checkpoint_fingerprint {fp!r}, expected a non-empty string")
        meta = dict(meta)
        # config_json is always a JSON string in the file (DESIGN §4), whether given as a dict or as text.
        cj = meta["config_json"]
        if isinstance(cj, dict):
            meta["config_json"] = json.dumps(cj, sort_keys=True)
        elif isinstance(cj, str):
            try:
                if not isinstance(json.loads(cj), dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise DumpError(f"{self.path}: meta config_json is not a JSON object ({e})") from None
        else:
            raise DumpError(f"{self.path}: meta config_json is a {type(cj).__name__}, expected a dict or JSON text")
        meta.setdefault("tool_version", _tool_version())
        attrs, json_keys = _encode_attrs(meta, where=f"{self.path} meta")

        self._written: set[Point] = set()
        self._stats: set[Point] = set()
        self._unavailable: dict[str, str] = {}
        self._tokens = False
        self._closed = False
        # Time spent inside write()/finish() and the array bytes handed to write(): the HDF5 write rate (bench, §9).
        self.seconds_writing = 0.0
        self.array_bytes = 0
        self.stale_notes = clean_stale_temp_files(self.path)
        for note in self.stale_notes:
            _log.info("%s", note)
        try:
            self._file = _SafeFile(self.tmp_path, "w+")
        except OSError as e:
            raise DumpError(f"{self.tmp_path}: cannot create the temporary dump file "
                            f"({_describe_io_error(e, self.tmp_path)})") from None
        _track_tmp(self.tmp_path)
        # libver v110: checksummed metadata (readable by HDF5 >= 1.10); the userblock holds the seal (see _seal).
        try:
            with self._io("creating the file"):
                self._f = h5py.File(self._file, "w", userblock_size=USERBLOCK, libver=("v110", "v110"))
        except BaseException:
            self._abort()
            raise
        try:
            with self._io("writing the root attributes"):
                root = self._f.attrs
                root["schema"] = SCHEMA
                root["version"] = VERSION
                root["created_utc"] = _created_utc(self.path)
                for k, v in attrs.items():
                    root[k] = v
                root["json_keys"] = json.dumps(sorted(json_keys))
                root["complete"] = False
                self._f.flush()
        except BaseException:
            self._abort()
            raise

    # -- context manager
    def __enter__(self) -> "DumpWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self._abort()

    # -- content
    def write_tokens(self, input_ids: np.ndarray, prompt_len: int) -> None:
        """`/tokens/input_ids` [B, T_total] int32 (prompt + decode tokens) and `/tokens/prompt_len`."""
        self._check_open()
        if self._tokens:
            raise DumpError(f"{self.tmp_path}: write_tokens called twice (tokens are never overwritten)")
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.size == 0:
            raise DumpError(f"{self.path}: input_ids {ids.dtype}{list(ids.shape)}, expected a non-empty [B, T] int array")
        if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            raise DumpError(f"{self.path}: input_ids range [{ids.min()}, {ids.max()}] does not fit int32 token ids >= 0")
        if isinstance(prompt_len, (bool, np.bool_)) or not isinstance(prompt_len, (int, np.integer)) \
                or not 0 < int(prompt_len) <= ids.shape[1]:
            raise DumpError(f"{self.path}: prompt_len {prompt_len!r}, expected an int in 1..{ids.shape[1]} (T_total)")
        with self._io("writing /tokens"):
            g = self._f.require_group("tokens")
            g.create_dataset("input_ids", data=ids.astype(np.int32))
            g.create_dataset("prompt_len", data=np.int64(prompt_len))
            del g
        self._tokens = True

    def write(self, point: Point | MtpPoint, array: np.ndarray, *, module: str = "", io: str = "output",
              shape_names: str = "") -> None:
        """One dataset at `point.h5_path()`; bf16 stored as uint16 bits + attr dtype="bfloat16"."""
        self._check_open()
        self._check_point(point)
        if point in self._written:
            raise DumpError(f"{self.path}: point {point.key()} written twice (nothing is overwritten silently)")
        if not isinstance(array, np.ndarray):
            raise DumpError(f"{self.path}: {point.key()}: got a {type(array).__name__}, expected a numpy array")
        name = array.dtype.name
        if name not in STORAGE:
            raise DumpError(f"{self.path}: {point.key()}: dtype {name} not storable; expected one of {sorted(STORAGE)}")
        if io not in IO_KINDS:
            raise DumpError(f"{self.path}: {point.key()}: io={io!r}, expected one of {IO_KINDS}")
        if shape_names and len(shape_names.split(",")) != array.ndim:
            raise DumpError(f"{self.path}: {point.key()}: shape_names {shape_names!r} names "
                            f"{len(shape_names.split(','))} dims, the array has shape {array.shape}")
        t0 = time.perf_counter()
        # (np.ascontiguousarray would turn a 0-d array into 1-d)
        data = np.array(array, order="C", copy=not array.flags.c_contiguous).view(STORAGE[name])
        kw: dict = {}
        if data.ndim > 0 and data.size > 0:
            kw = dict(chunks=_chunks(data.shape, data.itemsize), **self._filters)
        with self._io(f"writing {point.key()}"):
            ds = self._f.create_dataset(point.h5_path(), data=data, **kw)
            ds.attrs["dtype"] = name
            ds.attrs["module"] = str(module)
            ds.attrs["io"] = io
            ds.attrs["shape_names"] = str(shape_names)
            del ds  # closes the dataset: its chunks are written now, and a failure is seen here
        self._written.add(point)
        self.seconds_writing += time.perf_counter() - t0
        self.array_bytes += data.nbytes

    def write_stats(self, point: Point | MtpPoint, stats: dict) -> None:
        """Statistics-only mode: an empty dataset at `/stats<point path>` whose attrs are `stats` (DESIGN §9)."""
        self._check_open()
        self._check_point(point)
        if point in self._stats:
            raise DumpError(f"{self.path}: statistics of {point.key()} written twice")
        if not isinstance(stats, dict):
            raise DumpError(f"{self.path}: stats of {point.key()} is a {type(stats).__name__}, expected a dict")
        attrs, json_keys = _encode_attrs(stats, where=f"{self.path} stats of {point.key()}")
        if "json_keys" in attrs:
            raise DumpError(f"{self.path}: stats of {point.key()}: key 'json_keys' is reserved")
        with self._io(f"writing the statistics of {point.key()}"):
            ds = self._f.create_dataset("/stats" + point.h5_path(), data=h5py.Empty("f4"))
            for k, v in attrs.items():
                ds.attrs[k] = v
            ds.attrs["json_keys"] = json.dumps(sorted(json_keys))
            del ds
        self._stats.add(point)

    def set_meta(self, key: str, value: Any) -> None:
        """Set (or replace) one root attribute of the caller's meta after the writer was opened — for facts known only
        once the forward ran (e.g. a guard run on the prefill's own inputs). The writer's own attrs are refused."""
        self._check_open()
        if key in WRITER_META:
            raise DumpError(f"{self.path}: root attr {key!r} is set by the writer itself")
        attrs, json_keys = _encode_attrs({key: value}, where=f"{self.path} meta")
        root = self._f.attrs
        keys = set(json.loads(_attr_value(root["json_keys"])))
        keys.discard(key)
        keys.update(json_keys)
        if key in root:
            del root[key]
        root[key] = attrs[key]
        root["json_keys"] = json.dumps(sorted(keys))

    def mark_unavailable(self, point_or_pattern: Point | str, reason: str) -> None:
        """Record a point (or a site pattern such as `L03/attention.gate`) the runtime cannot provide, and why."""
        self._check_open()
        key = point_or_pattern.key() if isinstance(point_or_pattern, (Point, MtpPoint)) else point_or_pattern
        if not (isinstance(key, str) and key):
            raise DumpError(f"{self.path}: unavailable pattern {point_or_pattern!r}, expected a Point or a string")
        if not (isinstance(reason, str) and reason.strip()):
            raise DumpError(f"{self.path}: unavailable {key}: reason {reason!r}, expected a non-empty string")
        if key in self._unavailable:
            raise DumpError(f"{self.path}: {key} marked unavailable twice ({self._unavailable[key]!r}, {reason!r})")
        if isinstance(point_or_pattern, (Point, MtpPoint)) and point_or_pattern in self._written:
            raise DumpError(f"{self.path}: {key} was written, it cannot also be unavailable")
        self._unavailable[key] = reason

    def finish(self) -> Path:
        """Write the unavailable table, set complete=True, close and rename onto the final path."""
        if self._closed:
            return self.path
        t0 = time.perf_counter()
        try:
            if not self._tokens:
                raise DumpError(f"{self.path}: write_tokens() was never called; a dump without tokens is incomplete")
            rows = sorted(self._unavailable.items())
            with self._io("closing the file"):
                self._f.create_dataset("unavailable", data=np.array(rows, dtype=object).reshape(len(rows), 2),
                                       dtype=h5py.string_dtype())
                self._f.attrs["complete"] = True
                self._f.flush()
                self._f.close()
                self._file.close()
            try:
                _seal(self.tmp_path)
            except OSError as e:
                self._file.error = e
                self._fail("sealing the file")
            self._closed = True
            if self.path.exists() and not self.force:
                self._forget_tmp()  # kept on purpose: a finished dump
                raise DumpError(f"{self.path}: appeared while writing; the finished dump is left at {self.tmp_path} "
                                "(pass --force to replace)")
            try:
                os.replace(self.tmp_path, self.path)
            except OSError as e:
                self._abort()
                raise DumpError(f"{self.path}: cannot rename the finished dump onto it ({e.strerror or e}); "
                                "nothing was left") from None
            self._forget_tmp()
            self.seconds_writing += time.perf_counter() - t0  # incl. the final flush and the seal
        except BaseException as e:
            if not (isinstance(e, DumpError) and self._closed):
                self._abort()
            raise
        return self.path

    @contextmanager
    def _io(self, what: str) -> Iterator[None]:
        """Around every HDF5 call: an I/O failure of the file (kept by _SafeFile, HDF5 never saw it) becomes one
        DumpError naming the file, the operation and the cause, with the temporary file removed."""
        try:
            yield
        except Exception:
            if self._file.error is None:
                raise  # not an I/O failure
        if self._file.error is not None:
            self._fail(what)

    def _fail(self, what: str) -> None:
        err = self._file.error
        self._abort()
        raise DumpError(f"{self.path}: cannot write the dump ({what}): {_describe_io_error(err, self.path)}; "
                        f"nothing was left under {self.path.name}, the temporary file was removed")

    def _abort(self) -> None:
        """Close and delete the temporary file; the final path is left as it was."""
        if not self._closed:
            self._closed = True
            self._file.discard = True  # a doomed file: HDF5's closing writes go nowhere (and cannot fail)
            try:
                self._f.close()
            except Exception:
                pass
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass
        self._forget_tmp()

    def _forget_tmp(self) -> None:
        _untrack_tmp(self.tmp_path)

    def _check_open(self) -> None:
        if self._closed:
            raise DumpError(f"{self.path}: writer already finished or aborted")

    def _check_point(self, point: Point | MtpPoint) -> None:
        if not isinstance(point, (Point, MtpPoint)):
            raise DumpError(f"{self.path}: got {point!r}, expected a parity.model.points.Point or parity.model.mtp_points.MtpPoint")
        ok = (point.phase in ("prefill", "backward") and point.step == 0) or (point.phase == "decode" and point.step >= 1)
        layer = point.mtp if isinstance(point, MtpPoint) else point.layer
        if not ok or (layer is not None and layer < 0) or not point.site or "/" in point.site:
            raise DumpError(f"{self.path}: malformed point {point!r}: expected prefill or backward step 0 or decode step >= 1, "
                            "layer None or >= 0, a site name without '/'")


def _created_utc(path: Path) -> str:
    """Now, or $SOURCE_DATE_EPOCH (reproducible-builds convention): with it set, the same dump regenerated is
    byte-identical (created_utc is the only run-dependent byte; HDF5 stores no object times by default), which the
    bit-identical regeneration check of the golden dumps (DESIGN §4) needs."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        t = _dt.datetime.now(_dt.timezone.utc)
    else:
        try:
            t = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc)
        except (ValueError, OverflowError, OSError):
            raise DumpError(f"{path}: SOURCE_DATE_EPOCH={epoch!r}, expected integer seconds since 1970") from None
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _tool_version() -> str:
    import parity

    return parity.__version__


# ---------------------------------------------------------------------------------------------------- validator
def _open(path: Path, verify: bool = True) -> h5py.File:
    """Check the seal, then open read-only without HDF5 file locking (several pytest-xdist workers read at once)."""
    _check_seal(path, verify)
    with _h5_errors(path, "cannot open as HDF5"):
        return h5py.File(path, "r", locking=False)


def _validate_open(f: h5py.File, path: Path, expect_fingerprint: str | None) -> tuple[dict, dict]:
    """Checks of DESIGN §4 on an open file; returns the decoded root meta and {data point: its dtype attr}."""
    with _h5_errors(path, "cannot read root attributes"):
        attrs = f.attrs
        schema = _attr_value(attrs["schema"]) if "schema" in attrs else None
        if schema is None:
            raise DumpError(f"{path}: foreign file: HDF5 without a 'schema' attribute, expected schema={SCHEMA!r}")
        if schema != SCHEMA:
            raise DumpError(f"{path}: foreign file: schema={schema!r}, expected {SCHEMA!r}")
        version = _attr_value(attrs["version"]) if "version" in attrs else None
        if isinstance(version, bool) or version != VERSION:
            raise DumpError(f"{path}: unsupported dump version {version!r}; this suite reads version {VERSION}")
        complete = _attr_value(attrs["complete"]) if "complete" in attrs else None
        if complete is not True:
            raise DumpError(f"{path}: incomplete dump (complete={complete!r}): written by a run that did not finish")
        meta = _decode_attrs(attrs, where=str(path))
    for k in ("checkpoint_fingerprint", "config_json"):
        if not isinstance(meta.get(k), str) or not meta[k]:
            raise DumpError(f"{path}: root attr {k} is {meta.get(k)!r}, expected a non-empty string")
    try:
        cfg = json.loads(meta["config_json"])
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: root attr config_json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise DumpError(f"{path}: root attr config_json holds a JSON {type(cfg).__name__}, expected an object")
    if "kernels" in meta:  # kernel provenance (absent in dumps written before it existed)
        check_kernels(meta["kernels"], str(path))
    fp = meta["checkpoint_fingerprint"]
    if expect_fingerprint is not None and fp != expect_fingerprint:
        src = meta.get("checkpoint_dir", "an unrecorded directory")
        raise DumpError(f"{path}: fingerprint mismatch: the dump was made from checkpoint {fp} ({src}), "
                        f"expected checkpoint {expect_fingerprint}")
    with _h5_errors(path, "cannot read the dump's groups"):
        dtypes = _check_tree(f, path)
    return meta, dtypes


def _check_tree(f: h5py.File, path: Path) -> dict:
    """Group names of DESIGN §4, tokens, unavailable table, and every dataset's dtype attr against its storage.
    Returns {data point: dtype attr} (the reader's index: one pass over the file's attributes, not two)."""
    allowed_root = {"tokens", "unavailable", "stats", *_PHASES}
    extra = sorted(set(f.keys()) - allowed_root)
    if extra:
        raise DumpError(f"{path}: unexpected root entries {extra}; expected {sorted(allowed_root)}")
    if "tokens" not in f or not isinstance(f["tokens"], h5py.Group):
        raise DumpError(f"{path}: /tokens missing")
    for name, kind in (("input_ids", "iu"), ("prompt_len", "iu")):
        ds = f["tokens"].get(name)
        if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in kind:
            raise DumpError(f"{path}: /tokens/{name} missing or not an integer dataset")
    if f["tokens/input_ids"].ndim != 2 or f["tokens/prompt_len"].shape != ():
        raise DumpError(f"{path}: /tokens/input_ids must be [B, T] and /tokens/prompt_len a scalar")
    un = f.get("unavailable")
    if un is not None and not (isinstance(un, h5py.Dataset) and un.ndim == 2 and un.shape[1] == 2
                               and h5py.check_string_dtype(un.dtype) is not None):
        raise DumpError(f"{path}: /unavailable is not an [N, 2] string table")
    dtypes = {}
    for phase in _PHASES:
        if phase in f:
            for p, ds in _iter_phase(f, phase, path, prefix=""):
                dtypes[p] = _check_dataset(ds, p, path)
    if "stats" in f:
        st = f["stats"]
        if not isinstance(st, h5py.Group) or set(st.keys()) - set(_PHASES):
            raise DumpError(f"{path}: /stats holds {list(st.keys()) if isinstance(st, h5py.Group) else st}, "
                            f"expected groups {list(_PHASES)}")
        for phase in st.keys():
            for p, ds in _iter_phase(st, phase, path, prefix="/stats"):
                if ds.get_space().get_simple_extent_type() != h5py.h5s.NULL:
                    raise DumpError(f"{path}: /stats{p.h5_path()} has data; statistics are attrs of an empty dataset")
    return dtypes


def _check_dataset(ds: h5py.h5d.DatasetID, p: Point, path: Path) -> str:
    dtype = _low_attr(ds, "dtype")
    if dtype not in STORAGE:
        raise DumpError(f"{path}: {p.key()}: dtype attr {dtype!r} is unknown; expected one of {sorted(STORAGE)}")
    if ds.dtype != STORAGE[dtype]:
        raise DumpError(f"{path}: {p.key()}: dtype attr {dtype!r} is inconsistent with its storage {ds.dtype} "
                        f"(expected {STORAGE[dtype]})")
    return dtype


def _low_attr(oid, name: str) -> Any:
    """Attribute `name` of an open HDF5 object id as a plain Python value (None when absent), through h5py's
    low-level API: the high-level `ds.attrs[name]` costs ~0.15 ms per call, which a dump's thousands of datasets
    turned into a visible part of opening it (`pytest parity`, issue 17)."""
    key = name.encode()
    if not h5py.h5a.exists(oid, key):
        return None
    at = h5py.h5a.open(oid, key)
    buf = np.empty(at.shape, at.dtype)
    at.read(buf)
    return _attr_value(buf[()] if buf.ndim == 0 else buf)


def _open_object(g: h5py.Group, name: str):
    """A member of group g as a low-level object id (DatasetID, GroupID, ...) — cheaper than `g[name]`."""
    return h5py.h5o.open(g.id, name.encode())


def _iter_phase(root: h5py.Group, phase: str, path: Path, prefix: str
                ) -> Iterator[tuple[Point | MtpPoint, h5py.h5d.DatasetID]]:
    """(Point, low-level dataset id) under /<phase>, checking the group names of DESIGN §4 on the way."""
    g = root[phase]
    if not isinstance(g, h5py.Group):
        raise DumpError(f"{path}: {prefix}/{phase} is not a group")
    if phase in ("prefill", "backward"):
        steps = [(0, g)]
    else:
        steps = []
        for name in g.keys():
            m = _STEP_RE.match(name)
            if not m or int(m.group(1)) < 1 or not isinstance(g[name], h5py.Group):
                raise DumpError(f"{path}: {prefix}/decode/{name}: expected decode step groups S001, S002, ...")
            steps.append((int(m.group(1)), g[name]))
    for step, sg in steps:
        for lname in sg.keys():
            mtp = None
            if lname == "model":
                layer = None
            elif (mm := _MTP_RE.match(lname)) is not None:
                layer, mtp = None, int(mm.group(1))
            else:
                m = _LAYER_RE.match(lname)
                if not m:
                    raise DumpError(f"{path}: {sg.name}/{lname}: expected 'model' or a layer group L00, L01, ... "
                                    "(or an MTP group MTP0, ...)")
                layer = int(m.group(1))
            lg = sg[lname]
            if not isinstance(lg, h5py.Group):
                raise DumpError(f"{path}: {lg.name}: expected a group of site datasets")
            for site in lg.keys():
                ds = _open_object(lg, site)
                if not isinstance(ds, h5py.h5d.DatasetID):
                    raise DumpError(f"{path}: {lg.name}/{site}: expected a dataset, found a group")
                yield (Point(phase, step, layer, site) if mtp is None else MtpPoint(phase, step, mtp, site)), ds


def validate_dump(path: str | os.PathLike, *, expect_fingerprint: str | None = None, verify: bool = True) -> dict:
    """Validate a dump (seal, schema, version, complete, fingerprint, tree, dtype attrs); return its root meta.

    Raises a one-line DumpError for a foreign, truncated, incomplete, mismatched or malformed file.
    """
    p = Path(path)
    f = _open(p, verify)
    try:
        return _validate_open(f, p, expect_fingerprint)[0]
    finally:
        with _h5_errors(p, "cannot close"):
            f.close()


# ---------------------------------------------------------------------------------------------------- reader
def _stored(point):
    """The replay names MTP points `Point(phase, step, None, "MTP{j}/<site>")` (parity.model.points.mtp_site); the file
    indexes them as `MtpPoint`s."""
    if isinstance(point, Point) and point.layer is None and (m := mtp_site(point.site)) is not None:
        return MtpPoint(point.phase, point.step, m[0], m[1])
    return point


class DumpReader:
    """Lazy read-only view of a validated dump. Safe to open from several processes at once (no HDF5 locking)."""

    def __init__(self, path: str | os.PathLike, *, expect_fingerprint: str | None = None,
                 verify: bool = True) -> None:
        """Validates the file (`validate_dump`); `verify=False` skips the content sha256 (size is still checked)."""
        self.path = Path(path)
        self._f: h5py.File | None = _open(self.path, verify)
        try:
            self.meta, self._dtypes = _validate_open(self._f, self.path, expect_fingerprint)
            self._index = {p for p in self._dtypes if isinstance(p, Point)}  # the main stack
            self._mtp_index = {p for p in self._dtypes if isinstance(p, MtpPoint)}  # MTP layers (own groups)
            self._attrs: dict[Point, dict] = {}  # per-point attrs, read once (a replay asks for each point's dtype)
            self._stats_index = self._build_stats_index()
        except BaseException:
            self.close()
            raise
        self._config = None

    # -- lifecycle
    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except Exception:
                pass
            self._f = None

    def __enter__(self) -> "DumpReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DumpReader({str(self.path)!r}, {len(self._index)} points)"

    # -- root metadata
    @property
    def fingerprint(self) -> str:
        return self.meta["checkpoint_fingerprint"]

    @property
    def config(self):
        """The dump's Ling3Config (non-strict: a newer config with extra keys still reads)."""
        if self._config is None:
            from parity.model.config import Ling3Config

            fam = self.meta.get("family")
            if fam is not None and fam != "ling3":  # another family's dump (`parity.model.families`)
                raise DumpError(f"{self.path}: a {fam} dump (root attr family {fam!r}), not a Ling3 one: pytest parity "
                                "replays it in its family's own tests (`test_kimi_layer[...]` for Kimi Linear, "
                                "docs/kimi_linear.md), tools/kimi_check.py CKPT --from-dump DUMP too")
            try:
                self._config = Ling3Config.from_dict(json.loads(self.meta["config_json"]),
                                                     source=f"{self.path}:config_json", strict=False)
            except ConfigError as e:
                raise DumpError(f"{self.path}: root attr config_json is not a usable Ling3 config: {e}") from None
        return self._config

    @property
    def input_ids(self) -> np.ndarray:
        with _h5_errors(self.path, "cannot read /tokens/input_ids"):
            return self._file["tokens/input_ids"][()]

    @property
    def prompt_len(self) -> int:
        with _h5_errors(self.path, "cannot read /tokens/prompt_len"):
            return int(self._file["tokens/prompt_len"][()])

    # -- structure
    def phases(self) -> list[str]:
        return [ph for ph in _PHASES if any(p.phase == ph for p in self._index)]

    def steps(self, phase: str) -> list[int]:
        return sorted({p.step for p in self._index if p.phase == phase})

    def layers(self, phase: str, step: int) -> list[int | None]:
        """Layers with data at (phase, step); model-level sites are layer None (listed first)."""
        ls = {p.layer for p in self._index if p.phase == phase and p.step == step}
        return ([None] if None in ls else []) + sorted(x for x in ls if x is not None)

    def sites(self, phase: str, step: int, layer: int | None) -> list[str]:
        return sorted(p.site for p in self._index if (p.phase, p.step, p.layer) == (phase, step, layer))

    def points(self) -> list[Point]:
        """Every data point of the main stack, in (phase, step, layer, site) order with model-level first within a
        step. MTP layers' points are listed by `mtp_points()`."""
        return sorted(self._index, key=_sort_key)

    def mtp_points(self) -> list[MtpPoint]:
        """Every data point of the MTP layers (groups MTP0, ...), in (phase, step, MTP layer, site) order."""
        return sorted(self._mtp_index, key=_sort_key)

    @property
    def semantics(self) -> dict | None:
        """The root attr `semantics` (how the dump's runtime behaves on the known semantic forks, DESIGN §4), or
        None for a dump written before it existed."""
        sem = self.meta.get("semantics")
        if sem is None:
            return None
        if not isinstance(sem, dict):
            raise DumpError(f"{self.path}: root attr semantics is a {type(sem).__name__}, expected a JSON object")
        return sem

    @property
    def kernels(self) -> dict | None:
        """The root attr `kernels` (which KDA implementation ran on each path, versions, device, fp32 matmul
        settings; DESIGN §4), checked, or None for a dump written before it existed ("provenance not recorded")."""
        return self.meta.get("kernels")  # checked when the file was opened

    def stats_points(self) -> list[Point | MtpPoint]:
        """Points that have statistics (statistics-only mode), main stack first, then the MTP layers'."""
        return sorted(self._stats_index, key=_sort_key)

    def has(self, point: Point | MtpPoint) -> bool:
        point = _stored(point)
        return point in self._index or point in self._mtp_index

    # -- data
    def read(self, point: Point, index: Any = ()) -> np.ndarray:
        """The array of a point (optionally `index`-sliced, read lazily); bf16 comes back as ml_dtypes.bfloat16."""
        point = _stored(point)
        if isinstance(index, tuple) and not index:  # the whole array through h5py's low-level API (a third of the high-level path's cost)
            if not self.has(point):
                raise DumpError(self._missing_message(point))
            with _h5_errors(self.path, f"cannot read {point.key()}"):
                ds = h5py.h5d.open(self._file.id, point.h5_path().encode())
                a = np.empty(ds.shape, ds.dtype)
                ds.read(h5py.h5s.ALL, h5py.h5s.ALL, a)
        else:
            ds = self._dataset(point)
            with _h5_errors(self.path, f"cannot read {point.key()}"):
                a = np.asarray(ds[index])
        return a.view(ml_dtypes.bfloat16) if self._dtypes[point] == "bfloat16" else a

    def dtype(self, point: Point | MtpPoint) -> str:
        """The point's logical dtype attr ("bfloat16", "float32", ...), checked against its storage on open."""
        point = _stored(point)
        if not self.has(point):
            raise DumpError(self._missing_message(point))
        return self._dtypes[point]

    def attrs(self, point: Point) -> dict:
        point = _stored(point)
        if point not in self._attrs:
            ds = self._dataset(point)
            with _h5_errors(self.path, f"cannot read attributes of {point.key()}"):
                self._attrs[point] = {k: _attr_value(v) for k, v in ds.attrs.items()}
        return dict(self._attrs[point])

    def shape(self, point: Point) -> tuple[int, ...]:
        return tuple(self._dataset(point).shape)

    def unavailable(self) -> dict[str, str]:
        """{point key or site pattern: reason} for what the runtime could not provide."""
        with _h5_errors(self.path, "cannot read /unavailable"):
            if "unavailable" not in self._file:
                return {}
            rows = self._file["unavailable"][()]
            return {_attr_value(k): _attr_value(r) for k, r in rows}

    def stats(self, point: Point) -> dict:
        """Statistics written by `DumpWriter.write_stats` for a point."""
        if point not in self._stats_index:
            raise DumpError(f"{point.key()}: no statistics in dump {self.path} "
                            f"({len(self._stats_index)} points have statistics)")
        with _h5_errors(self.path, f"cannot read statistics of {point.key()}"):
            return _decode_attrs(self._file["/stats" + point.h5_path()].attrs, where=f"{self.path} stats {point.key()}")

    # -- internals
    @property
    def _file(self) -> h5py.File:
        if self._f is None:
            raise DumpError(f"{self.path}: reader is closed")
        return self._f

    def _build_stats_index(self) -> set[Point]:
        with _h5_errors(self.path, "cannot list the dump's statistics"):
            st = self._file.get("stats")
            return {p for ph in _PHASES if st is not None and ph in st
                    for p, _ in _iter_phase(st, ph, self.path, "/stats")}

    def _dataset(self, point: Point | MtpPoint) -> h5py.Dataset:
        point = _stored(point)
        if not self.has(point):
            raise DumpError(self._missing_message(point))
        with _h5_errors(self.path, f"cannot open {point.key()}"):
            return self._file[point.h5_path()]

    def _missing_message(self, point: Point | MtpPoint) -> str:
        if isinstance(point, MtpPoint):
            here = sorted(p.site for p in self._mtp_index if (p.phase, p.step, p.mtp) == (point.phase, point.step,
                                                                                           point.mtp))
            lay = f"MTP{point.mtp}"
            has = (f"the dump has sites {', '.join(here)} at {point.phase}/{lay}" if here
                   else f"the dump has no {lay} points at {point.phase} step {point.step}")
            un = self.unavailable()
            why = un.get(point.key()) or un.get(f"{lay}/{point.site}") or un.get(f"{lay}/*")
            return f"{point.key()} not in dump {self.path}; " + (f"marked unavailable: {why}; " if why else "") + has
        here = self.sites(point.phase, point.step, point.layer)
        lay = "model" if point.layer is None else f"L{point.layer:02d}"
        if here:
            has = f"the dump has sites {', '.join(here)} at {point.phase}/{lay}"
        else:
            ls = ["model" if x is None else f"L{x:02d}" for x in self.layers(point.phase, point.step)]
            has = (f"the dump has layers {', '.join(ls)} at {point.phase} step {point.step}" if ls
                   else f"the dump has phases/steps {[(ph, self.steps(ph)) for ph in self.phases()]}")
        why = self.unavailable().get(point.key()) or self.unavailable().get(f"{lay}/{point.site}")
        return f"{point.key()} not in dump {self.path}; " + (f"marked unavailable: {why}; " if why else "") + has
