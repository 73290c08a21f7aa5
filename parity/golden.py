"""The bundled golden dumps (`dumps/*.h5`): what they hold and the exact command that regenerates each.

Both presets, bf16 and fp32, prefill + 4 decode steps. Between them the prompts cover ≤ 64 tokens (the official KDA's
recurrent kernel) and > 64 tokens (its chunked kernel), for each preset (DESIGN §4).
`tools/golden_dumps.py` regenerates them and rewrites `dumps/MANIFEST.json`; `tests/test_golden_dumps.py` checks that
regeneration gives identical tensors on the kind of CPU that made them (MANIFEST `machine`): torch's fp32/bf16 GEMM
kernels differ between CPU vendors (measured: the same code regenerates `tiny-fp32.h5` on an Intel Xeon with 975 of
1035 points off by ~1e-7 relative, bit-identical on the AMD EPYC that made it).
"""

from __future__ import annotations

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
    return f"{vendor}/{torch.backends.cpu.get_cpu_capability()}"


@dataclass(frozen=True)
class Golden:
    file: str
    ckpt: str  # bundled checkpoint directory under dumps/ckpt
    dtype: str  # "bf16" | "fp32"
    prompt_len: int

    def args(self, out: str | Path | None = None) -> list[str]:
        """dump_hf.py arguments (relative to the repository root)."""
        return [f"dumps/ckpt/{self.ckpt}", "--out", str(out or f"dumps/{self.file}"), "--prompt-len",
                str(self.prompt_len), "--decode-steps", str(DECODE_STEPS), "--dtype", self.dtype, "--seed", str(SEED),
                "--force", "--no-progress"]

    def command(self) -> str:
        return "SOURCE_DATE_EPOCH=0 python tools/dump_hf.py " + " ".join(self.args())


GOLDEN = (
    Golden("tiny-bf16.h5", "tiny", "bf16", 40),
    Golden("tiny-fp32.h5", "tiny", "fp32", 100),
    Golden("tiny-flash-bf16.h5", "tiny-flash", "bf16", 100),
    Golden("tiny-flash-fp32.h5", "tiny-flash", "fp32", 40),
)
