"""The fast routed-expert path (`moe.routed_experts_blocked`) against the readable one (`moe.routed_experts_dense`):
bit for bit on every MoE layer and step of the bundled dumps (issue 17: "numerics unchanged"), with the dumps' own
MoE inputs (`post_attention_layernorm`) routed as `moe_block` routes them, clamp included (tiny-flash layers 6-7).

Both run under the reference's compiler options (`REFERENCE_COMPILER_OPTIONS`: bf16 roundings kept), as in the
replay. The dense path is evaluated on the rows zero-padded to whole 32-row tiles (the blocked path's largest block;
padding rows route to expert 0 with weight 0 and are cut off): XLA:CPU's AVX2 dot computes the remainder rows of an
N-row product (N not a multiple of its tile) with another kernel, so on an AVX2-only CPU (AMD EPYC Zen3, 2026-11-25)
the unpadded dense path differs from the blocked path in those remainder rows on the fp32 dumps (1,362 elements of
tiny-fp32's MoE outputs, 2,359 of tiny-flash-fp32's; e.g. rows 96-99 of 100, ≤ 2.1e-5 relative), and bit for bit
nowhere once padded (all five bundled dumps); on the AVX-512 machines both agreed unpadded. The padded evaluation is
the same readable function on mathematically identical input, giving every row the full-tile kernel. The bitwise check is shown to fail for a fast path with a bf16 precision slip, a dropped clamp, or the wrong
expert's weights. A compile-level guard keeps the row buffer out of bf16 (XLA:CPU converted
a bf16 buffer in full on every block: the slowdown this issue removed), and the block-size invariance the
32-row cap relies on is pinned at a mid-size shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity.dumpfile import DumpReader
from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS, moe
from parity.jax_ling3.model import to_device
from parity.jax_ling3.spec import layer_spec
from parity.jax_ling3.weights import CheckpointReader, convert_layer
from parity.model.points import Point

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = json.loads((ROOT / "dumps" / "MANIFEST.json").read_text())["dumps"]
DUMPS = [(d["file"], d["checkpoint"], "bfloat16" if d["dtype"] == "bf16" else "float32") for d in MANIFEST]


def _jit(fn):
    return jax.jit(fn, static_argnames=("limit",), compiler_options=REFERENCE_COMPILER_OPTIONS)


def _routed_inputs(dump: str, ckpt: str, dtype: str):
    """(layer, point key, expert params, x [N,D], idx [N,k], w [N,k], clamp limit) for every MoE layer and step: the
    dump's MoE input, routed and put in canonical order exactly as `moe.moe_block` does."""
    r = DumpReader(ROOT / "dumps" / dump)
    cfg = r.config
    reader = CheckpointReader(ROOT / ckpt)
    route = jax.jit(lambda x, wr, b, m: moe.route(x, wr, b, m), static_argnums=(3,),
                    compiler_options=REFERENCE_COMPILER_OPTIONS)
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe(i):
            continue
        spec = layer_spec(cfg, i, dtype)
        p = to_device(convert_layer(cfg, i, reader.lazy_tensors(i), dtype)["mlp"])
        for phase in r.phases():
            for step in r.steps(phase):
                pt = Point(phase, step, i, "post_attention_layernorm")
                x = jnp.asarray(r.read(pt), dtype)  # the dump stores it in the model dtype
                x = x.reshape(-1, x.shape[-1])
                _, idx, w = route(x, p["router"], p["expert_bias"], spec.model)
                order = jnp.argsort(idx, axis=-1)
                idx, w = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(w, order, -1)
                yield i, pt.key(), p, x, idx, w, spec.routed_limit


def _dense_on_whole_tiles(dense, p, x, idx, w, limit, tile: int = 32):
    """`dense` on x, idx, w zero-padded to a multiple of `tile` rows, cut back to N rows (see the module doc)."""
    n = x.shape[0]
    pad = -n % tile
    if pad:
        x, idx, w = (jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) for a in (x, idx, w))
    return dense(p, x, idx, w, limit=limit)[:n]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dump,ckpt,dtype", DUMPS, ids=[d[0] for d in DUMPS])
def test_fast_path_bit_identical_to_dense_on_bundled_dumps(dump, ckpt, dtype):
    dense, fast = _jit(moe.routed_experts_dense), _jit(moe.routed_experts_blocked)
    n, limits = 0, set()
    for i, key, p, x, idx, w, lim in _routed_inputs(dump, ckpt, dtype):
        ref, got = _bits(_dense_on_whole_tiles(dense, p, x, idx, w, lim)), _bits(fast(p, x, idx, w, limit=lim))
        assert ref.shape == got.shape
        bad = np.flatnonzero(ref != got)
        assert bad.size == 0, (f"{dump} {key}: fast path differs from the dense path in {bad.size} of {ref.size} "
                               f"elements (first at flat index {bad[0]})")
        n += 1
        limits.add(lim)
    assert n >= 8, f"{dump}: only {n} MoE (layer, step) inputs found"
    if "flash" in dump:
        assert any(limits), "tiny-flash has clamped MoE layers; none was compared"


@pytest.mark.parametrize("breakage", ["silu_rounded_twice", "clamp_dropped", "wrong_expert"])
def test_bitwise_check_catches_a_broken_fast_path(breakage, monkeypatch):
    """The comparison above, run over a whole bf16 dump, must fail for a fast path with a precision slip (silu(g)
    computed in bf16, i.e. σ rounded before the product), one that forgets the clamp (tiny-flash), and one that
    reads expert e+1's weights for expert e. (A fast path that only sums in another order — native bf16 dots — is
    barely visible on these tiny shapes: 2 of 39936 elements on tiny-flash-bf16, 0 on tiny-bf16.)"""
    dump, ckpt, dtype = next(d for d in DUMPS if d[0] == "tiny-flash-bf16.h5")
    dense = _jit(moe.routed_experts_dense)
    if breakage == "silu_rounded_twice":
        real = moe.routed_experts_blocked

        def fast(p, x, idx, w, limit):
            with pytest.MonkeyPatch.context() as m:  # only while the fast path is traced
                m.setattr(moe, "silu", lambda g: g * jax.nn.sigmoid(g))
                return real(p, x, idx, w, limit)
    elif breakage == "clamp_dropped":
        def fast(p, x, idx, w, limit):
            return moe.routed_experts_blocked(p, x, idx, w, None)
    else:
        def fast(p, x, idx, w, limit):
            return moe.routed_experts_blocked({n: jnp.roll(v, -1, axis=0) if n.startswith("experts_") else v
                                               for n, v in p.items()}, x, idx, w, limit)
    fast = _jit(fast)
    differing = sum(int((_bits(_dense_on_whole_tiles(dense, p, x, idx, w, lim))
                         != _bits(fast(p, x, idx, w, limit=lim))).sum())
                    for _, _, p, x, idx, w, lim in _routed_inputs(dump, ckpt, dtype))
    assert differing > 0, f"{breakage}: the broken fast path matched the dense path bit for bit on all of {dump}"


def test_row_buffer_never_bf16():
    """Compile-level guard (machine-independent): the blocked loop's row buffer [A + Bs, D] must not exist in bf16 —
    XLA:CPU has no bf16 dynamic-update-slice and converted such a buffer to fp32 and back in full on every block."""
    N, k, D, I, E = 64, 4, 128, 64, 16
    rng = np.random.default_rng(0)
    p = {n: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
         for n, s in [("experts_gate", (E, D, I)), ("experts_up", (E, D, I)), ("experts_down", (E, I, D))]}
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    idx = jnp.asarray(np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), -1), jnp.int32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    rows = N * k + moe.block_rows(N * k, E)
    hlo = _jit(moe.routed_experts_blocked).lower(p, x, idx, w, limit=None).compile().as_text()
    assert re.search(rf"\[{rows},{D}\]", hlo), f"no [{rows},{D}] row buffer in the compiled HLO: the guard is stale"
    # the buffer is what a while loop carries and a dynamic-update-slice writes (a bf16 [rows, D] value inside a
    # fusion, e.g. the gathered rows rounded to bf16 before their GEMM, is no buffer)
    carried = [ln for ln in hlo.splitlines() if " while(" in ln or "dynamic-update-slice(" in ln]
    assert any(f"[{rows},{D}]" in ln for ln in carried), "no loop carries the row buffer: the guard is stale"
    assert not [ln for ln in carried if f"bf16[{rows},{D}]" in ln], "the row buffer is bf16 in the compiled loop"


@pytest.mark.parametrize("D,I", [(512, 256), (1536, 512)], ids=["mid", "ling3-tiny-width"])
def test_block_rows_cap_and_block_size_invariance(D, I):
    """`block_rows` stays in [8, 32]; and row results do not depend on the block size within that range (what the
    cap relies on: a row's bits do not depend on how many rows its expert got, nor on the block size its rows go in), at a mid-size shape and at Ling3-Tiny's widths
    (D=1536, I=512), where T >= 512 gives 32-row blocks. Block 8 is a GEMM of 8 rows only; the others mix full
    blocks with tails of 8-32 rows."""
    assert moe.block_rows(4096, 128) == 32 and moe.block_rows(16384, 128) == 32 and moe.block_rows(10, 128) == 8
    N, k, E = 96, 4, 12  # 32 rows per expert on average: block 32, tails of 8, 16, 24 and 32 rows
    rng, route_rng = np.random.default_rng(1), np.random.default_rng(0)
    p = {n: jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16)
         for n, s in [("experts_gate", (E, D, I)), ("experts_up", (E, D, I)), ("experts_down", (E, I, D))]}
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    idx = jnp.asarray(np.sort(np.stack([route_rng.choice(E, k, replace=False) for _ in range(N)]), -1), jnp.int32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    assert moe.block_rows(N * k, E) == 32
    counts = np.bincount(np.asarray(idx).ravel(), minlength=E)
    tails = {-(-(int(c) % 32) // 8) * 8 for c in counts} - {0}  # block 32's tail sizes
    assert len(tails) >= 3, f"too few distinct tail sizes to pin: counts {counts}"
    outs = {b: _bits(jax.jit(lambda p, x, i, w, b=b: moe.routed_experts_blocked(p, x, i, w, None, block=b),
                             compiler_options=REFERENCE_COMPILER_OPTIONS)(p, x, idx, w)) for b in (8, 16, 24, 32)}
    for b, o in outs.items():
        assert np.array_equal(o, outs[32]), f"block {b} vs 32: {(o != outs[32]).sum()} elements differ"
