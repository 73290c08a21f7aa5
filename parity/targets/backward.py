"""The suite's VJP helper (issue 26, DESIGN §7 `backward` capability): any port with a pure JAX layer function gets
its backward from `jax.vjp`, so sglang-jax-style / nnx ports need no hand-written backward.

A port's layer function has the form `fn(params, hidden, probes) -> (out, points)` — the pure forward of one decoder
layer on the residual stream `hidden` [B,T,D], with its parameters as a pytree and `probes` a dict {site: array} of
zero-valued additive probes the function adds at those sites (`x = x + probes[site]`; {} or None: no probes, then no
sub-module cotangents). The gradient w.r.t. `probes[site]` is dL/d(site) (`parity.jax_ling3.probes` explains why
-0.0 probes leave the forward bit-identical). Everything else (routing forced to the dump's experts, positions, the
layer's static spec) is closed over by the caller.

jax is imported lazily (a target module must import without jax).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# Sites whose cotangent is not a sub-module cotangent of the backward pass: the layer's own input and output (the
# cotangent fed in / dL/d input, returned separately), integer ids, and the states a prefill leaves behind (they do
# not reach the layer output, so their cotangent is zero by construction).
NOT_PROBED = frozenset({"input", "output", "mlp.gate.topk_idx", "attention.state", "attention.conv_state"})


def probe_shapes(fn: Callable, params: Any, hidden: Any) -> dict[str, Any]:
    """{site: jax.ShapeDtypeStruct} of the floating points `fn(params, hidden, None)` returns, less `NOT_PROBED`:
    the sites a backward pass can tap. Traced abstractly (no computation)."""
    import jax
    import jax.numpy as jnp

    _, pts = jax.eval_shape(lambda p, h: fn(p, h, None), params, hidden)
    return {k: v for k, v in pts.items() if k not in NOT_PROBED and jnp.issubdtype(v.dtype, jnp.floating)}


def zero_probes(shapes: dict[str, Any]) -> dict[str, Any]:
    """-0.0-filled probes of the given shapes/dtypes (x + (-0.0) == x for every x, so the forward is unchanged)."""
    import jax.numpy as jnp

    return {k: jnp.full(v.shape, -0.0, v.dtype) for k, v in shapes.items()}


def layer_vjp(fn: Callable, params: Any, hidden: Any, cotangent: Any, probes: dict | None = None
              ) -> tuple[Any, Any, dict[str, Any], Any]:
    """The VJP of one decoder layer: `fn(params, hidden, probes) -> (out, points)` (module doc).

    Returns (d_hidden, d_params (same pytree as params), {site: d_site} for every probe given, out). Traceable: call it
    inside `jax.jit` (the reference does, `parity.jax_ling3.backward`). `cotangent` must have out's shape and dtype
    (it is cast to out's dtype: a bf16 layer's cotangent is bf16, as torch's autograd gives it)."""
    import jax

    probes = dict(probes or {})

    def f(p, h, pr):
        out, _ = fn(p, h, pr)
        return out

    out, vjp = jax.vjp(f, params, hidden, probes)
    dp, dh, dpr = vjp(cotangent.astype(out.dtype))
    return dh, dp, dpr, out


def as_numpy(tree: Any) -> Any:
    """A pytree of jax arrays as numpy arrays (dicts stay dicts)."""
    import jax

    return jax.tree_util.tree_map(np.asarray, tree)
