"""The bundled golden dumps (`dumps/*.h5`): what they hold and the exact command that regenerates each.

Both presets, bf16 and fp32, prefill + 4 decode steps. Between them the prompts cover ≤ 64 tokens (the official KDA's
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
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")  # a capped oneDNN (parity/cpu_isa.py) runs other bf16 GEMM kernels
    return f"{kind}/onednn<={isa}" if isa else kind


# Where the official-runtime golden's checkpoint is rebuilt (outside the repository: it holds the official file).
OFFICIAL_CKPT_ROOT = "/tmp/ling3-parity-official"


@dataclass(frozen=True)
class Golden:
    file: str
    ckpt: str  # bundled checkpoint directory under dumps/ckpt (its weights and config; its fingerprint)
    dtype: str  # "bf16" | "fp32"
    prompt_len: int
    runtime: str = "twin"  # "twin": the bundled directory as is; "official": its weights + the official modeling file

    def ckpt_dir(self) -> str:
        """The directory dump_hf reads (relative to the repository root for the twin)."""
        return f"dumps/ckpt/{self.ckpt}" if self.runtime == "twin" else f"{OFFICIAL_CKPT_ROOT}/{self.ckpt}"

    def args(self, out: str | Path | None = None, ckpt_dir: str | Path | None = None) -> list[str]:
        """dump_hf.py arguments (relative to the repository root)."""
        trust = ["--trust-remote-code"] if self.runtime == "official" else []
        return [str(ckpt_dir or self.ckpt_dir()), *trust, "--out", str(out or f"dumps/{self.file}"), "--prompt-len",
                str(self.prompt_len), "--decode-steps", str(DECODE_STEPS), "--dtype", self.dtype, "--seed", str(SEED),
                "--force", "--no-progress"]

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
    Golden("tiny-fp32.h5", "tiny", "fp32", 100),
    Golden("tiny-flash-bf16.h5", "tiny-flash", "bf16", 100),
    Golden("tiny-flash-fp32.h5", "tiny-flash", "fp32", 40),
    Golden("tiny-flash-official-bf16.h5", "tiny-flash", "bf16", 100, runtime="official"),
)
