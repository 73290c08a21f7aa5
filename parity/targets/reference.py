"""`reference`: the suite's own pure-JAX Ling3 (`parity.jax_ling3`) as a target (DESIGN §7).

It is also the template for an external adapter: convert HF tensors in `load_layer`, run one decoder layer in
`layer_forward`, return the canonical points as numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.targets.base import LayerResult, Target

# Decode steps a prefill's MLA latent cache leaves room for (the dump's decode steps must fit).
DECODE_ROOM = 128


class ReferenceTarget(Target):
    name = "reference"
    capabilities = frozenset({"q_lora", "swiglu_clamp", "absorbed_decode", "forced_routing", "kda_chunked",
                              "kda_recurrent", "decode", "mesh"})

    def __init__(self, *, clamp: bool = True, kda_mode: str = "auto", mla_absorbed: bool = True) -> None:
        self.clamp, self.kda_mode, self.mla_absorbed = clamp, kda_mode, mla_absorbed
        self.params: dict[int, Any] = {}
        self.globals: dict | None = None

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import jax  # noqa: F401
        except ImportError as e:
            return False, f"jax is not installed ({e})"
        return True, ""

    def build(self, config, dtype: str, mesh=None) -> None:
        from parity.jax_ling3.spec import dtype_name, dtype_of

        self.cfg = config
        self.dtype = dtype_name(dtype_of(dtype))
        self.mesh = mesh
        self._place = None
        if mesh is not None:
            from parity.jax_ling3.sharding import placer

            self._place = placer(mesh)

    def spec(self, i: int):
        from parity.jax_ling3.spec import layer_spec

        return layer_spec(self.cfg, i, self.dtype, clamp=self.clamp, kda_mode=self.kda_mode,
                          mla_absorbed=self.mla_absorbed)

    def load_globals(self, hf_tensors: dict[str, np.ndarray]) -> None:
        from parity.jax_ling3.model import to_device
        from parity.jax_ling3.weights import convert_globals

        if self.globals is None:
            self.globals = to_device(convert_globals(self.cfg, hf_tensors, self.dtype))

    def load_layer(self, i: int, hf_tensors: dict[str, np.ndarray]) -> None:
        from parity.jax_ling3.model import to_device
        from parity.jax_ling3.weights import convert_layer

        self.params[i] = to_device(convert_layer(self.cfg, i, hf_tensors, self.dtype), self._place)

    def unload_layer(self, i: int) -> None:
        self.params.pop(i, None)

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        import jax.numpy as jnp

        from parity.jax_ling3.model import embed_jit

        return np.asarray(embed_jit(self.globals["embed"], jnp.asarray(input_ids, jnp.int32)))

    def head(self, hidden: np.ndarray) -> dict[str, np.ndarray]:
        import jax.numpy as jnp

        from parity.jax_ling3.model import head_jit
        from parity.jax_ling3.spec import dtype_of

        h = jnp.asarray(hidden, dtype_of(self.dtype))
        out = head_jit(self.globals["final_norm"], self.globals["lm_head"], h, float(self.cfg.rms_norm_eps))
        return {k: np.asarray(v) for k, v in out.items()}

    def layer_forward(self, i: int, hidden: np.ndarray, positions: np.ndarray, state: Any = None,
                      forced_topk: np.ndarray | None = None) -> LayerResult:
        import jax.numpy as jnp

        from parity.jax_ling3.layer import decoder_layer_jit
        from parity.jax_ling3.mla import init_mla_cache
        from parity.jax_ling3.spec import dtype_of

        spec = self.spec(i)
        h = jnp.asarray(hidden, dtype_of(self.dtype))
        B, T = h.shape[:2]
        if state is None and spec.kind == "mla":
            state = init_mla_cache(B, T + DECODE_ROOM, spec)
        fi = None if forced_topk is None else jnp.asarray(forced_topk, jnp.int32)
        out, pts, new_state = decoder_layer_jit(self.params[i], h, jnp.asarray(positions, jnp.int32), spec, state, fi)
        return LayerResult(np.asarray(out), {k: np.asarray(v) for k, v in pts.items()}, new_state)
