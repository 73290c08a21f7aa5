"""Memory measures of the reference target (issue 17). `release_freed_heap`: after a layer is converted, the freed numpy
scratch goes back to the OS instead of staying in glibc's heap (it kept ~50 MB above a Ling3-Tiny KDA+dense layer's
77 MB of weights)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from parity.targets.reference import _malloc_trim, release_freed_heap


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or _malloc_trim() is None,
                    reason="needs Linux /proc to measure and glibc's malloc_trim")
def test_freed_fragmented_heap_is_returned():
    # 64 KiB blocks stay below glibc's mmap threshold, so they live in the heap; freeing every other one leaves
    # 24 MiB of free memory between live blocks, which free() alone does not return
    blocks = [np.ones(64 * 1024 // 8) for _ in range(768)]
    del blocks[::2]
    before = _rss_mb()
    release_freed_heap()
    after = _rss_mb()
    assert before - after > 12, f"RSS {before:.1f} -> {after:.1f} MB: the freed 24 MiB stayed in the process"
    assert all(b[0] == 1.0 for b in blocks)  # the live blocks are untouched


def _layer_inputs(i: int):
    from pathlib import Path

    import jax.numpy as jnp

    from parity.dumpfile import DumpReader
    from parity.jax_ling3.weights import CheckpointReader
    from parity.model.points import Point
    from parity.targets.reference import ReferenceTarget

    root = Path(__file__).resolve().parents[1]
    r = DumpReader(root / "dumps" / "tiny-flash-bf16.h5")
    t = ReferenceTarget()
    t.build(r.config, "bfloat16")
    t.load_layer(i, CheckpointReader(root / "dumps" / "ckpt" / "tiny-flash").lazy_tensors(i))
    h = jnp.asarray(r.read(Point("prefill", 0, i, "input")), jnp.bfloat16)
    return t, h, jnp.arange(h.shape[1], dtype=jnp.int32)


@pytest.mark.parametrize("layer", [0, 5], ids=["kda_moe", "mla_moe"])
def test_compiled_call_gives_the_jit_call_bits(layer):
    """`compiled_call` (ahead-of-time compile, then run) gives the jit call's bits — its executable keeps the
    reference's compiler options (`xla_allow_excess_precision=false`): the control shows that the same layer compiled
    with excess precision allowed differs on these inputs, so the bitwise comparison would see lost options."""
    import jax

    from parity.jax_ling3.layer import decoder_layer, decoder_layer_jit
    from parity.jax_ling3.mla import init_mla_cache
    from parity.targets.reference import DECODE_ROOM, compiled_call

    t, h, pos = _layer_inputs(layer)
    spec = t.spec(layer)
    state = init_mla_cache(1, h.shape[1] + DECODE_ROOM, spec) if spec.kind == "mla" else None
    leaves = lambda x: [np.asarray(a).view(np.uint16) if np.asarray(a).dtype.itemsize == 2 else  # noqa: E731
                        np.asarray(a).view(np.uint32) for a in jax.tree_util.tree_leaves(x)]
    want = leaves(decoder_layer_jit(t.params[layer], h, pos, spec, state, None))
    got = leaves(compiled_call(decoder_layer_jit, spec, t.params[layer], h, pos, state, None))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    # XLA's default is excess precision allowed (tests/conftest.py turns it off process-wide, so ask for it here)
    excess = jax.jit(decoder_layer, static_argnames=("spec",), compiler_options={"xla_allow_excess_precision": True})
    other = leaves(excess(t.params[layer], h, pos, spec, state, None))
    assert not all(np.array_equal(a, b) for a, b in zip(other, want)), \
        "excess precision gave the same bits: the comparison would not see dropped compiler options here"
