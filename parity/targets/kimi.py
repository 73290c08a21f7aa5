"""Kimi Linear targets: the JAX implementations of Kimi Linear's decoder layers that `tools/kimi_check.py --target`
judges against transformers' built-in (issue 34; docs/porting.md, "A Kimi Linear target").

A Kimi target is a class with
    available() -> (bool, str)                 classmethod: can it run here, and why not
    build(config, dtype)                       the built-in's KimiLinearConfig; "float32" or "bfloat16"
    layer_forward(i, state_dict, hidden, forced_idx) -> (out, points)
        state_dict: the built-in's tensors as transformers loads them (module names, `model.layers.{i}.…`), from
        which the port builds its own parameters; hidden: [B, T, D] numpy in the dtype (bf16 as ml_dtypes'); forced_idx:
        [B, T, k] int32, the experts a MoE layer must route to (None: its own router). Returns the layer output and
        a dict of intermediate points named by `parity.model.kimi_family.SITES` sites (`attention`, `mlp`, ...),
        each laid out as the dump holds it (`kimi_family.canonical`: the KDA conv history [3, B, P, W]);
        a site it does not return is listed as not provided, not failed.
It is named `package.module:ClassName`, as a Ling3 target is (`parity.targets.resolve`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np


class KimiReferenceTarget:
    """The suite's own JAX Kimi Linear (`parity.jax_kimi`), jitted with the reference's XLA options."""

    name = "kimi-reference"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def build(self, config: Any, dtype: str) -> None:
        self.config, self.dtype = config, dtype

    def layer_forward(self, i: int, state_dict: Any, hidden: np.ndarray, forced_idx: np.ndarray | None
                      ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        import jax.numpy as jnp

        from parity.jax_kimi.layer import decoder_layer_jit
        from parity.jax_kimi.spec import layer_spec
        from parity.jax_kimi.weights import layer_params
        from parity.model.kimi_family import SITES, canonical

        spec = layer_spec(self.config, i, self.dtype)
        p = layer_params(state_dict, i, spec)
        forced = None if forced_idx is None else jnp.asarray(forced_idx, jnp.int32)
        with self.planted():
            out, pts = decoder_layer_jit()(p, jnp.asarray(hidden, spec.model.jdtype), spec, None, forced)
        got = {s.site: np.asarray(canonical(s.site, pts[s.jax_point])) for s in SITES
               if s.judged and s.jax_point in pts}
        return np.asarray(out), got

    @contextlib.contextmanager
    def planted(self) -> Iterator[None]:
        """The reference as it is (a planted porting bug overrides this)."""
        yield


class KimiPlantedGateActivation(KimiReferenceTarget):
    """A planted porting bug (issue 34 §4): a SiLU between the low-rank projections, b(silu(a(x))), where the
    built-in has none — in the decay gate (f_a, f_b) and the output gate (g_a, g_b), which share `low_rank`.
    `--target parity.targets.kimi:KimiPlantedGateActivation`: its first failing site is layer 0's `attention.gate`."""

    name = "kimi-planted-gate-activation"

    @contextlib.contextmanager
    def planted(self) -> Iterator[None]:
        from parity.jax_kimi import kda
        from parity.jax_ling3.ops import linear, silu

        orig = kda.low_rank
        kda.low_rank = lambda x, w_a, w_b: linear(silu(linear(x, w_a)), w_b)
        try:
            yield
        finally:
            kda.low_rank = orig
