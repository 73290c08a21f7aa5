"""Checkpoint-directory access for ports whose loaders read from disk (protocol v2, DESIGN §7).

`layer_checkpoint(src, out, layers)` writes a loadable copy of an HF checkpoint directory holding only the global
tensors and the selected layers' tensors (HF names and dtypes unchanged), with a `config.json` that a port's own
config loader accepts: `auto_map` removed (it points at remote code a port does not run and that transformers would
try to import) and any other keys named in `drop_keys` removed. Tensors are copied once, per selected layer, through
safetensors (no whole-model buffering beyond one layer).
"""

from __future__ import annotations

import json
from pathlib import Path

from parity.errors import ParityError


def layer_checkpoint(src: str | Path, out: str | Path, layers: list[int] | None = None,
                     drop_keys: tuple[str, ...] = ("auto_map",), widen_bf16: bool = False) -> Path:
    """Write the trimmed checkpoint to `out` (created; must not already hold a config.json) and return it.
    `widen_bf16`: store BF16 tensors as F32 (exact: bf16 is the top half of an fp32), for a port that runs an fp32
    model but cannot cast bf16 weights on load; the config's `torch_dtype` then says float32."""
    src, out = Path(src), Path(out)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ParityError(f"{src}: no config.json (expected an HF checkpoint directory)")
    if (out / "config.json").exists():
        raise ParityError(f"{out}: already holds a config.json; refusing to overwrite a checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(cfg_path.read_text())
    for k in drop_keys:
        cfg.pop(k, None)
    if widen_bf16:
        cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ParityError(f"{src}: no *.safetensors files")
    wanted = None if layers is None else {f"model.layers.{i}." for i in layers}

    def keep(key: str) -> bool:
        if not key.startswith("model.layers."):
            return True
        return wanted is None or any(key.startswith(p) for p in wanted)

    index: dict[str, str] = {}
    for f in files:
        kept = _copy_tensors(f, out / f.name, keep, widen_bf16)
        index.update({k: f.name for k in kept})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    return out


def _copy_tensors(src: Path, dst: Path, keep, widen_bf16: bool = False) -> list[str]:
    import struct

    import numpy as np

    with open(src, "rb") as h:
        raw = h.read(8)
        if len(raw) != 8:
            raise ParityError(f"{src}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(h.read(n))
        except ValueError as e:
            raise ParityError(f"{src}: unreadable safetensors header ({e})") from None
        base = 8 + n
        new_header: dict = {}
        chunks: list[bytes] = []
        off = 0
        for key in sorted(k for k in header if k != "__metadata__" and keep(k)):
            info = header[key]
            b, e = info["data_offsets"]
            h.seek(base + b)
            data = h.read(e - b)
            dtype = info["dtype"]
            if widen_bf16 and dtype == "BF16":  # bf16 bits -> the fp32 with the same top 16 bits (exact)
                data = (np.frombuffer(data, "<u2").astype("<u4") << 16).tobytes()
                dtype = "F32"
            new_header[key] = {"dtype": dtype, "shape": info["shape"], "data_offsets": [off, off + len(data)]}
            chunks.append(data)
            off += len(data)
    if not new_header:
        return []
    hdr = json.dumps(new_header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(dst, "wb") as w:
        w.write(struct.pack("<Q", len(hdr)))
        w.write(hdr)
        for c in chunks:
            w.write(c)
    return list(new_header)


__all__ = ["layer_checkpoint"]
