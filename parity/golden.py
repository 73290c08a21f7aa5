"""The bundled golden dumps (`dumps/*.h5`): what they hold and the exact command that regenerates each.

Both presets, bf16 and fp32, prefill + 4 decode steps; the three > 64-token goldens (fp32 and bf16, twin and official)
also hold the backward phase (`--grads`, issue 26), so the chunked KDA's backward is replayed by default. Between them the prompts cover ≤ 64 tokens (the official KDA's
recurrent kernel) and > 64 tokens (its chunked kernel), for each preset (DESIGN §4).
`tools/golden_dumps.py` regenerates them and rewrites `dumps/MANIFEST.json`; `tests/test_golden_dumps.py` checks that
regeneration gives identical tensors on the kind of CPU that made them (each MANIFEST entry's `machine`): torch's
fp32/bf16 GEMM kernels differ between CPU vendors (measured: the same code regenerates `tiny-fp32.h5` on an Intel Xeon
with 975 of 1035 points off by ~1e-7 relative, bit-identical on the AMD EPYC that made it).

One golden is made with the **official** remote code (issue 13: CI replays an official-runtime dump even where the
official file is absent): the bundled tiny-flash weights (same fingerprint, rebuilt by make_ckpt) with the official
`modeling_bailing_moe_v3.py` installed, in a directory outside the repository (the file is never committed). Its
MANIFEST entry names the official file's sha256; regenerating it needs that file (`parity.torch_ref.official`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DUMPS = ROOT / "dumps"
DECODE_STEPS = 4
SEED = 0


def machine_kind() -> str:
    """The CPU kind that bit-identity of a regenerated dump depends on: vendor and torch's CPU kernel capability."""
    import torch

    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kind = f"{vendor}/{torch.backends.cpu.get_cpu_capability()}"
    # Capped libraries run other kernels (parity/cpu_isa.py): oneDNN other bf16 GEMMs, MKL other fp32 GEMMs (an ATen
    # cap already shows in the capability above). The suffixes only appear when a cap is set.
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return kind + (f"/onednn<={isa}" if isa else "") + (f"/mkl<={mkl}" if mkl else "")


# Where the official-runtime golden's checkpoint is rebuilt (outside the repository: it holds the official file).
OFFICIAL_CKPT_ROOT = "/tmp/ling3-parity-official"


@dataclass(frozen=True)
class Golden:
    file: str
    ckpt: str  # bundled checkpoint directory under dumps/ckpt (its weights and config; its fingerprint)
    dtype: str  # "bf16" | "fp32"
    prompt_len: int
    runtime: str = "twin"  # "twin": the bundled directory as is; "official": its weights + the official modeling file
    grads: bool = False  # with the backward phase (`dump_hf.py --grads`, issue 26)

    def ckpt_dir(self) -> str:
        """The directory dump_hf reads (relative to the repository root for the twin)."""
        return f"dumps/ckpt/{self.ckpt}" if self.runtime == "twin" else f"{OFFICIAL_CKPT_ROOT}/{self.ckpt}"

    def args(self, out: str | Path | None = None, ckpt_dir: str | Path | None = None) -> list[str]:
        """dump_hf.py arguments (relative to the repository root)."""
        trust = ["--trust-remote-code"] if self.runtime == "official" else []
        return [str(ckpt_dir or self.ckpt_dir()), *trust, "--out", str(out or f"dumps/{self.file}"), "--prompt-len",
                str(self.prompt_len), "--decode-steps", str(DECODE_STEPS), "--dtype", self.dtype, "--seed", str(SEED),
                "--force", "--no-progress", *(["--grads"] if self.grads else [])]

    def prepare_command(self, ckpt_dir: str | Path | None = None) -> list[str] | None:
        """make_ckpt.py arguments that rebuild the official-runtime checkpoint (None for the twin). Same preset, seed
        and shard size as dumps/ckpt/README.md, so the weights and the fingerprint are the bundled directory's."""
        if self.runtime == "twin":
            return None
        return ["--preset", self.ckpt, "--seed", str(SEED), "--out", str(ckpt_dir or self.ckpt_dir()),
                "--max-shard-mb", "1", "--modeling", "official", "--force"]

    def command(self) -> str:
        dump = "SOURCE_DATE_EPOCH=0 python tools/dump_hf.py " + " ".join(self.args())
        prep = self.prepare_command()
        return dump if prep is None else "python tools/make_ckpt.py " + " ".join(prep) + " && " + dump


GOLDEN = (
    Golden("tiny-bf16.h5", "tiny", "bf16", 40),
    Golden("tiny-fp32.h5", "tiny", "fp32", 100, grads=True),
    Golden("tiny-flash-bf16.h5", "tiny-flash", "bf16", 100, grads=True),
    Golden("tiny-flash-fp32.h5", "tiny-flash", "fp32", 40),
    Golden("tiny-flash-official-bf16.h5", "tiny-flash", "bf16", 100, runtime="official", grads=True),
)



# --------------------------------------------------------------------------------------------- Kimi Linear (issue 34)
KIMI_DUMPS = DUMPS / "kimi"  # a folder of their own: what reads every Ling3 golden in dumps/*.h5 does not meet them
KIMI_CKPT = "kimi-tiny"  # dumps/ckpt/kimi-tiny: `tools/make_ckpt.py --family kimi-linear --preset tiny --seed 0`
KIMI_PROMPT_LEN = 70  # > 64: two chunks of the built-in's chunked KDA
KIMI_DECODE_STEPS = 2
# The CPU kind that made them (`machine_kind()`): regeneration is bit-identical there (tests/test_kimi_goldens.py)
KIMI_MACHINE = "AuthenticAMD/AVX512"


@dataclass(frozen=True)
class KimiGolden:
    """A bundled Kimi Linear dump: transformers' built-in `KimiLinearForCausalLM` on dumps/ckpt/kimi-tiny (fp32
    weights; the bf16 dump casts them), written by `tools/kimi_check.py --dump` (`parity.torch_ref.kimi_dump`)."""

    file: str
    dtype: str  # "float32" | "bfloat16"

    def ckpt_command(self) -> str:
        return (f"python tools/make_ckpt.py --family kimi-linear --preset tiny --seed {SEED} --dtype fp32 "
                f"--out dumps/ckpt/{KIMI_CKPT} --force")

    def args(self, out: str | Path | None = None) -> list[str]:
        """kimi_check.py arguments (relative to the repository root)."""
        return [f"dumps/ckpt/{KIMI_CKPT}", "--dtype", self.dtype, "--T", str(KIMI_PROMPT_LEN), "--decode-steps",
                str(KIMI_DECODE_STEPS), "--seed", str(SEED), "--dump", str(out or f"dumps/kimi/{self.file}"),
                "--force"]

    def command(self) -> str:
        # one torch thread: the built-in's fp32 decode GEMMs split their sums by thread count (2 threads changed
        # layer 2's decode-step sites in the last bits on the 2-core AMD EPYC, 2026-11-29)
        return "OMP_NUM_THREADS=1 SOURCE_DATE_EPOCH=0 python tools/kimi_check.py " + " ".join(self.args())


KIMI_GOLDEN = (KimiGolden("kimi-tiny-fp32.h5", "float32"), KimiGolden("kimi-tiny-bf16.h5", "bfloat16"))

# ------------------------------------------------------------------------------------------------ structure check
# What a regenerated golden must match on every machine (issue 25 item 7): bit-identity holds only on the CPU kind
# that made it, but the set of points, their shapes, dtypes and attrs, the root attrs' keys and their CPU-independent
# values do not depend on the CPU — so a capture change that adds or removes points fails anywhere.
#
# Root attrs whose values depend on the machine, the time, the installed versions or the paths the dump was made
# with (the test writes to a temporary directory): their presence is compared, not their values.
VARYING_ROOT_ATTRS = frozenset({"created_utc", "tool_version", "torch_version", "transformers_version", "fla_version",
                                "python_version", "device", "command", "checkpoint_dir", "determinism"})
CAUSALITY_WHERE = ("layer", "prefix_length", "output_scale")  # parity.torch_ref.dump.causality_guard's `worst`
MEASURED = "<measured>"  # stands for a float measured on the machine (e.g. the causality guard's max |diff|)


def mask_measured(value):
    """`value` (a decoded root attr) with every float replaced by MEASURED, recursively, and the checkpoint
    directory's name in remote-code module names (`transformers_modules.<dir>.<hash>`) replaced by `<dir>`."""
    if isinstance(value, float):
        return MEASURED
    if isinstance(value, str):
        return re.sub(r"transformers_modules\.\w+\.", "transformers_modules.<dir>.", value)
    if isinstance(value, dict):
        return {k: mask_measured(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_measured(v) for v in value]
    return value


def dump_structure(path: str | Path) -> dict:
    """Everything of a dump that does not depend on the CPU that made it: each dataset's path, shape, storage dtype
    and attrs; the root attrs (VARYING_ROOT_ATTRS by presence, floats masked); the prompt's token ids and
    `/unavailable`. Decode tokens are left out: they are the greedy argmax of the logits, which a near tie may flip
    on another CPU kind."""
    import h5py
    import numpy as np

    from parity.dumpfile import DumpReader

    with DumpReader(path) as d:  # validates seal, schema and version before h5py reads the file
        root = {k: "<varies>" if k in VARYING_ROOT_ATTRS else mask_measured(v) for k, v in d.meta.items()}
        causality = (root.get("guards") or {}).get("causality")
        if isinstance(causality, dict):  # where the worst |diff| was: recorded only where one is measured above 0
            for k in CAUSALITY_WHERE:  # (exactly 0 on AVX-512, ~1 fp32 ULP under the AVX2 caps)
                causality.pop(k, None)
        values = {"prompt_len": int(d.prompt_len), "prompt_ids": np.asarray(d.input_ids)[:, :d.prompt_len].tolist(),
                  "unavailable": d.unavailable()}
    datasets: dict[str, dict] = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            datasets[name] = {"shape": tuple(obj.shape), "storage": str(obj.dtype),
                              "attrs": {k: _plain(v) for k, v in obj.attrs.items()}}

    with h5py.File(path, "r", locking=False) as f:  # as DumpReader: a worker may hold the same file open
        f.visititems(visit)
    return {"root": root, "datasets": datasets, "values": values}


def _plain(v):
    """An HDF5 attr value as plain Python (bytes decoded, numpy scalars and arrays to Python)."""
    if isinstance(v, bytes):
        return v.decode()
    return v.tolist() if hasattr(v, "tolist") else v


def structure_differences(bundled: dict, regenerated: dict) -> list[str]:
    """One line per difference between two `dump_structure`s, naming the dataset or attr: empty when they match."""
    out = []
    a, b = bundled["datasets"], regenerated["datasets"]
    out += [f"{k}: recorded by the capture now, absent from the bundled dump" for k in sorted(b.keys() - a.keys())]
    out += [f"{k}: in the bundled dump, no longer recorded by the capture" for k in sorted(a.keys() - b.keys())]
    for k in sorted(a.keys() & b.keys()):
        for field in ("shape", "storage", "attrs"):
            if a[k][field] != b[k][field]:
                out.append(f"{k}: {field} {a[k][field]} in the bundled dump, {b[k][field]} regenerated")
    ra, rb = bundled["root"], regenerated["root"]
    out += [f"root attr {k}: recorded now, absent from the bundled dump" for k in sorted(rb.keys() - ra.keys())]
    out += [f"root attr {k}: in the bundled dump, no longer recorded" for k in sorted(ra.keys() - rb.keys())]
    for k in sorted(ra.keys() & rb.keys()):
        out += [f"root attr {where}: {_short(x)} in the bundled dump, {_short(y)} regenerated"
                for where, x, y in _differing(k, ra[k], rb[k])]
    va, vb = bundled["values"], regenerated["values"]
    out += [f"{k}: {_short(va[k])} in the bundled dump, {_short(vb[k])} regenerated" for k in va if va[k] != vb.get(k)]
    return out


def _differing(where: str, a, b) -> list[tuple[str, object, object]]:
    """(dotted path, a's value, b's value) of each difference, descending into dicts (an absent key is `<absent>`),
    so a JSON attr such as `guards` names the entry that changed."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys())
                for d in _differing(f"{where}.{k}", a.get(k, "<absent>"), b.get(k, "<absent>"))]
    return [] if a == b else [(where, a, b)]


def _short(v, n: int = 200) -> str:
    text = repr(v)
    return text if len(text) <= n else text[:n] + "…"
