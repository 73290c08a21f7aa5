"""Every literal numeric bound of tests/, with the measurement it rests on (issue 35).

A bound here is one of:
- **measured**: the largest value of the compared quantity seen, the CPU kinds it was seen on, and a value at least
  ×3 above it (`MIN_HEADROOM`; `tests/test_bounds_headroom.py` fails otherwise), so another summation order (another
  vector ISA, another BLAS) does not turn a correct result red;
- **fp64-relative**: a multiple of a noise floor measured in the same test against an independent float64 run of the
  same maths (`measured` is then the largest multiple seen);
- **exact**: the compared quantities are equal in exact arithmetic and both sides are float64 (or fp32 elementwise
  maths checked against float64), so the bound is a stated multiple of the precision's unit roundoff, not a
  measurement of anything CPU-dependent (`measured` still recorded).

Bound values are floats (a `Bound` *is* its value), so tests compare against them directly. With
`LING3_PARITY_BOUNDS_LOG=<file>` set, every comparison `x <= BOUND` (any of <, <=, >, >=, either side) appends the
observed `x` to that file as a JSON line: `python tools/bounds_report.py <file>` prints the largest value per bound,
which is how `measured` below was filled in (command and machine in each `measured_on`).

A float literal used as a tolerance anywhere else in tests/ fails `tests/test_bounds_headroom.py`'s scan unless its
line says why it is not one: `# not-a-bound: <reason>` (e.g. a property of constructed data, a config value).
"""

from __future__ import annotations

import json
import os
import platform

MIN_HEADROOM = 3.0
LOG_VAR = "LING3_PARITY_BOUNDS_LOG"

# CPU kinds measured on (parity.golden.machine_kind() plus the caps of tests/conftest.py's LING3_PARITY_CPU_ISA).
XEON = "Intel Xeon 2-core VM, AVX-512 (GenuineIntel/AVX512), 2026-11-27"
XEON_AVX2 = "same Xeon, LING3_PARITY_CPU_ISA=AVX2 (oneDNN, MKL, ATen, XLA capped to AVX2), 2026-11-27"
EPYC = "AMD EPYC 2-core VM, AVX2 only (issue 35's report, 2026-11-27)"
XEON_OLD = "Intel Xeon, AVX-512 (value recorded in the test's comment before issue 35)"

REGISTRY: dict[str, "Bound"] = {}


class Bound(float):
    """A tolerance: its value, the largest compared value measured, where, and why the bound is what it is."""

    name: str
    measured: float | None
    measured_on: tuple[str, ...]
    why: str
    kind: str

    def __new__(cls, name: str, value: float, *, measured: float | None, measured_on: tuple[str, ...], why: str,
                kind: str = "measured") -> "Bound":
        if kind not in ("measured", "fp64-relative", "exact"):
            raise ValueError(f"tests/bounds.py: {name}: kind {kind!r}, expected measured | fp64-relative | exact")
        b = super().__new__(cls, value)
        b.name, b.measured, b.measured_on, b.why, b.kind = name, measured, tuple(measured_on), why, kind
        REGISTRY[name] = b
        return b

    @property
    def headroom(self) -> float:
        """value / measured (inf when nothing above 0 was measured)."""
        return float(self) / self.measured if self.measured else float("inf")

    def _seen(self, other) -> None:
        path = os.environ.get(LOG_VAR)
        if path and isinstance(other, (int, float)):
            with open(path, "a") as f:
                f.write(json.dumps({"bound": self.name, "observed": float(other), "value": float(self),
                                    "isa": os.environ.get("LING3_PARITY_CPU_ISA", ""),
                                    "cpu": platform.processor() or platform.machine()}) + "\n")

    # `x <= B` with x a float calls B.__ge__(x) first (B's type is a subclass of x's): each records x.
    def __lt__(self, other):
        self._seen(other)
        return float(self) < other

    def __le__(self, other):
        self._seen(other)
        return float(self) <= other

    def __gt__(self, other):
        self._seen(other)
        return float(self) > other

    def __ge__(self, other):
        self._seen(other)
        return float(self) >= other

    __hash__ = float.__hash__


def headroom_problems(bounds=None, minimum: float = MIN_HEADROOM) -> list[str]:
    """One line per bound without a recorded measurement (measured/fp64-relative kinds) or with value / measured below
    `minimum`."""
    out = []
    for b in (bounds if bounds is not None else REGISTRY.values()):
        if b.measured is None:
            if b.kind != "exact":
                out.append(f"tests/bounds.py: {b.name}: no measured value recorded (kind {b.kind})")
            continue
        if not b.measured_on:
            out.append(f"tests/bounds.py: {b.name}: measured {b.measured:g} on no named CPU kind")
        if b.headroom < minimum:
            out.append(f"tests/bounds.py: {b.name} = {float(b):g}: headroom ×{b.headroom:.2f} over measured "
                       f"{b.measured:g}, expected >= ×{minimum:g}")
    return out


# --------------------------------------------------------------------------------------------- the bounds
# fp64 evaluations of two codes of the same maths (test_backward_dump.py): exact maths, float64 both sides.
FP64_SAME_MATHS_REL = Bound(
    "FP64_SAME_MATHS_REL", 1e-10, measured=3.3e-13, measured_on=(XEON_OLD,), kind="exact",
    why="two float64 evaluations of the same maths differ by float64 rounding (unit roundoff 1.1e-16) amplified by "
        "the model's depth; 1e-10 is ~1e6 roundoffs, far below any real maths difference (>= 1e-3 for the planted "
        "bugs)")
KDA_GRAD_FP64_REL = Bound(
    "KDA_GRAD_FP64_REL", 1e-10, measured=4.4e-14, measured_on=(XEON_OLD, XEON), kind="exact",
    why="stand-in KDA autograd vs fla's naive KDA, both in float64: same maths, float64 rounding only")
FP64_LOSS_REL = Bound(
    "FP64_LOSS_REL", 1e-12, measured=None, measured_on=(), kind="exact",
    why="one float64 scalar loss computed twice by the same maths in a different order: float64 rounding only")
KDA_FP32_NOISE_MULTIPLE_RECURRENT = Bound(
    "KDA_FP32_NOISE_MULTIPLE_RECURRENT", 8.0, measured=2.2, measured_on=(XEON, XEON_AVX2), kind="fp64-relative",
    why="the stand-in's recurrent KDA in fp32 is the same recurrence as fla's naive_recurrent_kda: its error against "
        "the float64 naive (on the same fp32 inputs) is the naive fp32's own error (the noise floor) times a "
        "summation-order factor; measured max-abs-relative ratio over seeds 0-4, T=40 and 65")
KDA_FP32_NOISE_MULTIPLE_CHUNK = Bound(
    "KDA_FP32_NOISE_MULTIPLE_CHUNK", 150.0, measured=47.0, measured_on=(XEON, XEON_AVX2), kind="fp64-relative",
    why="the chunked form (within-chunk cumulative decays, a triangular solve) loses more in fp32 than the naive "
        "recurrence: its error against the float64 naive is 7-47x the naive fp32's over seeds 0-4, T=100 and 128 "
        "(16.5 for the test's seed 0 with AVX2 caps); a precision bug (one bf16 rounding) gives > 1000x")
