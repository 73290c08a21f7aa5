"""The reference's compiler options that serve compile speed only leave its bits alone (issue 35).

`REFERENCE_COMPILER_OPTIONS` turns XLA:CPU's MLIR fusion emitters off (`parity.jax_ling3._legacy_cpu_emitters`:
~40 % less compile time). That is only acceptable while both emitters give the same bits: the KDA + MoE and MLA + MoE
layers of the bundled tiny-bf16 golden are compiled both ways and every point compared bit for bit. The same
comparison against the excess-precision option (known to move bf16 roundings) shows that it can fail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"


def _layer(i: int, options: dict | None):
    """(output, points) of layer i of the golden at its dumped prefill input, with the reference's jitted layer
    (None) or the same layer function jitted with `options`."""
    import jax

    from parity.dumpfile import DumpReader
    from parity.jax_ling3.layer import decoder_layer
    from parity.jax_ling3.weights import CheckpointReader
    from parity.model.points import Point
    from parity.targets.reference import ReferenceTarget

    class Compiled(ReferenceTarget):
        def _layer_fn(self):
            if options is None:
                return super()._layer_fn()
            return jax.jit(decoder_layer, static_argnames=("spec",), compiler_options=options)

    with DumpReader(DUMP) as d:
        cfg, h = d.config, d.read(Point("prefill", 0, i, "input"))
    t = Compiled()
    t.build(cfg, "bfloat16")
    t.load_layer(i, CheckpointReader(ROOT / "dumps" / "ckpt" / "tiny").hf_tensors(i))
    res = t.layer_forward(i, h, np.arange(h.shape[1]))
    return res.output, res.points


def _differing(a, b) -> list[str]:
    out = [] if np.array_equal(a[0].view(np.uint16), b[0].view(np.uint16)) else ["output"]
    return out + sorted(k for k in a[1] if a[1][k].tobytes() != b[1][k].tobytes())


@pytest.mark.parametrize("i", [1, 3], ids=["kda_moe", "mla_moe"])
def test_fast_compile_option_keeps_every_bit(i):
    if REFERENCE_COMPILER_OPTIONS.get("xla_cpu_use_fusion_emitters") is not False:
        pytest.skip("the reference keeps XLA's default emitters with this jaxlib (nothing to check)")
    default_emitters = {k: v for k, v in REFERENCE_COMPILER_OPTIONS.items() if k != "xla_cpu_use_fusion_emitters"}
    ref = _layer(i, None)
    assert _differing(ref, _layer(i, default_emitters)) == []
    if i == 1:  # the comparison sees a changed rounding: excess precision moves the KDA output norm's bf16 points
        assert _differing(ref, _layer(i, {**REFERENCE_COMPILER_OPTIONS, "xla_allow_excess_precision": True}))


@pytest.mark.parametrize("i", [1, 3], ids=["kda_moe", "mla_moe"])
def test_ynn_dots_only_option_keeps_every_forward_bit(i):
    """`parity.jax_ling3._ynn_dots_only` (YNNPACK's dot + reduce fusion off: it drops bf16 round trips in a VJP,
    tests/test_jax_native_bwd.py) leaves the forward's bits alone: the golden's layers compiled with and without it."""
    key = "xla_cpu_experimental_ynn_fusion_type"
    if key not in REFERENCE_COMPILER_OPTIONS:
        pytest.skip("the reference keeps XLA's default YNNPACK fusions with this jaxlib (nothing to check)")
    assert _differing(_layer(i, None), _layer(i, {k: v for k, v in REFERENCE_COMPILER_OPTIONS.items() if k != key})) == []
