"""The native-bf16 VJPs (`ops.BWD_NATIVE_BF16`, issue 33 item 1): a bf16 `ops.linear` (`ops._linear_bf16`) and MLA's
attention core (`mla._core_bf16`) differentiate through hand-written VJPs whose products are bf16 x bf16 -> fp32
dots, where plain AD of the readable functions (`ops._linear_ref`, `mla._core`) upcasts every operand.

- linear: dx = dy Wᵀ and dW = xᵀ dy against numpy's float64 products of the same bf16 values, rounded once to bf16
  (an independent reference): a different fp32 summation order can only move a value across a bf16 rounding
  boundary, so every element within 1 bf16 ULP of it and >= 99 % equal — the forward's own criterion
  (tests/test_jax_ops.py).
- attention core: every gradient within rel-L2 NATIVE_BWD_VS_PLAIN_AD (tests/bounds.py) of plain AD of `_core`
  (same rounding points, other fp32 sums).
- the forward bits do not depend on the switch (the primal path is the readable one).
Shown to fail: a weight gradient whose xᵀ is not transposed in memory but reshaped (`contiguous_t` broken), an
attention VJP that forgets the softmax scale, and one whose dq is 1 % off.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS, mla, ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds import NATIVE_BWD_VS_PLAIN_AD  # noqa: E402

F32, BF = jnp.float32, jnp.bfloat16


def _vjp(f, args, ct, native: bool, monkeypatch) -> list[np.ndarray]:
    """The gradients of f at args for cotangent ct, traced with `BWD_NATIVE_BF16 = native` (read at trace time)."""
    monkeypatch.setattr(ops, "BWD_NATIVE_BF16", native)

    def g(*a):
        out, vjp = jax.vjp(f, *a)
        return vjp(ct.astype(out.dtype))

    out = jax.jit(g, compiler_options=REFERENCE_COMPILER_OPTIONS)(*args)
    return [np.asarray(v).astype(np.float64) for v in out]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bf16_values(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


def _linear_case(seed=0):
    rng = np.random.default_rng(seed)
    return _bf16_values(rng, (2, 64, 256)), _bf16_values(rng, (256, 96), 0.05), _bf16_values(rng, (2, 64, 96))


def _once_rounded(exact: np.ndarray, got: np.ndarray, acc_bound: np.ndarray) -> list[str]:
    """got (bf16 values as float64) against exact (float64) rounded once to bf16: within 1 bf16 ULP plus the fp32
    accumulation bound `acc_bound` everywhere (an element whose terms cancel can move by more than its own ULP) and
    equal in >= 99 % of the elements; the failures found."""
    ref = exact.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    d = np.abs(got - ref)
    ulp = np.spacing(np.abs(ref).astype(ml_dtypes.bfloat16)).astype(np.float64)
    allowed = ulp + acc_bound
    bad = []
    if not np.all(d <= allowed):
        i = np.unravel_index(np.argmax(d / allowed), d.shape)
        bad.append(f"{int(np.sum(d > allowed))} elements beyond 1 ULP + the fp32 accumulation bound, worst at {i}: "
                   f"{got[i]} vs {ref[i]}")
    if not np.mean(d == 0) >= 0.99:  # not-a-bound: the forward's own criterion (test_jax_ops.py)
        bad.append(f"only {np.mean(d == 0):.3f} of the elements equal")
    return bad


def check_linear(monkeypatch) -> list[str]:
    x, w, dy = _linear_case()
    dx, dw = _vjp(ops.linear, (jnp.asarray(x), jnp.asarray(w)), jnp.asarray(dy), True, monkeypatch)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))  # bf16 products are exact in float64
    x2, dy2 = x64.reshape(-1, 256), dy64.reshape(-1, 96)

    def acc(a, b):  # fp32 accumulation of K terms: |error| <= K 2^-24 sum |a_i b_i| (test_jax_ops.py's bound)
        return a.shape[-1] * 2.0 ** -24 * (np.abs(a) @ np.abs(b))

    return ([f"dx: {m}" for m in _once_rounded(dy64 @ w64.T, dx, acc(dy64, w64.T))]
            + [f"dW: {m}" for m in _once_rounded(x2.T @ dy2, dw, acc(x2.T, dy2))])


def test_linear_vjp_is_the_once_rounded_exact_product(monkeypatch):
    bad = check_linear(monkeypatch)
    assert not bad, "; ".join(bad)


def test_linear_check_fails_for_a_weight_gradient_not_transposed(monkeypatch):
    monkeypatch.setattr(ops, "contiguous_t", lambda a: a.reshape(a.shape[1], a.shape[0]))  # the layout, not xᵀ
    jax.clear_caches()
    bad = check_linear(monkeypatch)
    jax.clear_caches()
    assert any(b.startswith("dW") for b in bad), f"a reshaped (not transposed) xᵀ passed: {bad}"


def _core_case(seed=1):
    rng = np.random.default_rng(seed)
    B, T, H, d, v = 1, 96, 4, 48, 32
    q, k = (jnp.asarray(_bf16_values(rng, (B, T, H, d))) for _ in range(2))
    vv, ct = (jnp.asarray(_bf16_values(rng, (B, T, H, v))) for _ in range(2))
    allowed = jnp.tril(jnp.ones((T, T), bool))
    return (q, k, vv), ct, allowed, d ** -0.5


def check_core(monkeypatch, core=None, block: int | None = None) -> list[str]:
    """The attention core's gradients with `BWD_NATIVE_BF16` on (or `core`, a stand-in for `mla._core_bf16`), its
    causal query blocks of `block` rows (`mla.causal_blocks`), against plain AD of `mla._core`; the failures found."""
    args, ct, allowed, scale = _core_case()
    blocks = mla.causal_blocks(allowed.shape[0], allowed.shape[1], block)
    native = (lambda q, k, v: mla._core_bf16(q, k, v, allowed, scale, blocks)) if core is None else \
        (lambda q, k, v: core(q, k, v, allowed, scale, blocks))
    got = _vjp(native, args, ct, True, monkeypatch)
    ref = _vjp(lambda q, k, v: mla._core(q, k, v, allowed, scale, BF), args, ct, False, monkeypatch)
    return [f"d{n}: rel-L2 {_rel(a, b):.3g}" for n, a, b in zip("qkv", got, ref)
            if not _rel(a, b) <= NATIVE_BWD_VS_PLAIN_AD]


# one block; blocks that divide T = 96; blocks that do not (the last one shorter)
BLOCKS = (None, 32, 40)


@pytest.mark.parametrize("block", BLOCKS)
def test_attention_core_vjp_matches_plain_autodiff(monkeypatch, block):
    bad = check_core(monkeypatch, block=block)
    assert not bad, "; ".join(bad)


def test_causal_blocks_cover_each_query_once_and_its_keys():
    for T, block in ((96, 32), (96, 40), (2048, 256), (96, None), (20, 32)):
        blocks = mla.causal_blocks(T, T, block)
        assert [b[0] for b in blocks] == [0] + [b[1] for b in blocks[:-1]] and blocks[-1][1] == T
        assert all(s1 == t1 for _, t1, s1 in blocks)  # every key a query of the block may see, none after
    assert mla.causal_blocks(4, 9, 2) == ((0, 4, 9),)  # not a square mask (a decode step): one block


def _broken_core(bwd):
    f = jax.custom_vjp(lambda q, k, v, allowed, scale, blocks: mla._core(q, k, v, allowed, scale, BF),
                       nondiff_argnums=(4, 5))
    f.defvjp(mla._core_bf16_fwd, bwd)
    return f


@pytest.mark.parametrize("block", (None, 40))
def test_attention_check_fails_for_broken_vjps(monkeypatch, block):
    no_scale = _broken_core(lambda scale, blocks, res, dout: mla._core_bf16_bwd(1.0, blocks, res, dout))
    off = _broken_core(lambda scale, blocks, res, dout: (lambda g: (g[0] * 1.01,) + g[1:])(
        mla._core_bf16_bwd(scale, blocks, res, dout)))
    bad_scale, bad_off = check_core(monkeypatch, no_scale, block), check_core(monkeypatch, off, block)
    assert {b[:2] for b in bad_scale} == {"dq", "dk"}, f"the softmax scale forgotten: {bad_scale}"
    assert [b[:2] for b in bad_off] == ["dq"], f"dq 1 % off: {bad_off}"


def test_attention_check_fails_for_a_key_block_left_out(monkeypatch):
    """A blocked VJP whose later query blocks stop one key short (s1 = t1 - 1: a block's last query does not see its
    own key): dq, dk and dv wrong."""
    bad = check_core(monkeypatch, lambda q, k, v, allowed, scale, blocks: mla._core_bf16(
        q, k, v, allowed, scale, tuple((t0, t1, s1 - 1 if t0 else s1) for t0, t1, s1 in blocks)), 40)
    assert {b[:2] for b in bad} == {"dq", "dk", "dv"}, f"a key block left out passed: {bad}"


def test_forward_bits_do_not_depend_on_the_switch(monkeypatch):
    x, w, _ = _linear_case()
    (q, k, v), _, allowed, scale = _core_case()
    outs = []
    for native in (True, False):
        monkeypatch.setattr(ops, "BWD_NATIVE_BF16", native)
        jax.clear_caches()
        outs.append((np.asarray(jax.jit(ops.linear)(jnp.asarray(x), jnp.asarray(w))),
                     np.asarray(jax.jit(lambda q, k, v: mla._naive(q[..., :32], q[..., 32:], k[..., :32], v,
                                                                   k[:, :, 0, 32:], allowed, scale, BF))(q, k, v))))
    jax.clear_caches()
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_xla_reduce_fusion_would_drop_a_rounding(monkeypatch):
    """Why the reference compiles with YNNPACK's dots only (`parity.jax_ling3._ynn_dots_only`): with XLA:CPU's default
    fusions (jaxlib 0.10) the attention VJP's d probs rounding is fused away and the check above fails."""
    import parity.jax_ling3 as pj

    key = "xla_cpu_experimental_ynn_fusion_type"
    if key not in pj.REFERENCE_COMPILER_OPTIONS:
        pytest.skip("the reference keeps XLA's default YNNPACK fusions with this jaxlib")
    monkeypatch.setattr(sys.modules[__name__], "REFERENCE_COMPILER_OPTIONS",
                        {k: v for k, v in pj.REFERENCE_COMPILER_OPTIONS.items() if k != key})
    jax.clear_caches()
    bad = check_core(monkeypatch)
    jax.clear_caches()
    assert {b[:2] for b in bad} == {"dq", "dk"}, f"XLA's default fusions kept every rounding here: {bad}"
