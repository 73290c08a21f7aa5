"""Optional device-mesh placement: experts over one mesh axis, heads over another (DESIGN §7, §9).

Parameters are placed with `NamedSharding`; the jitted layer functions are unchanged — XLA's SPMD partitioner
propagates the shardings (the routed-expert einsums shard over E, the KDA projections over heads).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXPERT, HEAD = "expert", "head"

# JAX-layout param name -> PartitionSpec (see weights.convert_layer for the layouts)
_SPECS = {
    "experts_gate": P(EXPERT, None, None), "experts_up": P(EXPERT, None, None), "experts_down": P(EXPERT, None, None),
    # KDA: head-major projection columns [D, H·d]; o_proj rows [H·d, D]
    "q_proj": P(None, HEAD), "k_proj": P(None, HEAD), "v_proj": P(None, HEAD), "f_proj": P(None, HEAD),
    "o_proj": P(HEAD, None),
    # MLA: per-head output columns / input rows
    "q_b_proj": P(None, HEAD), "kv_b_proj": P(None, HEAD), "dense": P(HEAD, None),
}


def make_mesh(n_devices: int | None = None, experts: int | None = None) -> Mesh:
    """A 2-D mesh ("expert", "head") over the first n_devices devices; `experts` = size of the expert axis
    (default: the largest power of two ≤ sqrt-ish split, i.e. n/2 when n ≥ 2)."""
    devs = jax.devices()
    n = len(devs) if n_devices is None else n_devices
    if n > len(devs):
        raise ValueError(f"make_mesh({n}): only {len(devs)} devices (set XLA_FLAGS=--xla_force_host_platform_"
                         f"device_count={n} before jax starts for simulated CPU devices)")
    e = experts or (n // 2 if n >= 2 and n % 2 == 0 else n)
    if n % e:
        raise ValueError(f"make_mesh: expert axis {e} does not divide {n} devices")
    return Mesh(np.array(devs[:n]).reshape(e, n // e), (EXPERT, HEAD))


def mesh_from_spec(spec: str) -> Mesh:
    """`--parity-mesh` values: "auto" (every device, expert axis n/2), "N" (the first N devices) or "ExH" (an expert
    axis of E and a head axis of H devices, e.g. "4x2" on a v5e-8 or 8 simulated CPU devices)."""
    s = str(spec).strip().lower()
    try:
        if s == "auto":
            return make_mesh()
        if "x" in s:
            e, h = (int(v) for v in s.split("x"))
            return make_mesh(e * h, experts=e)
        return make_mesh(int(s))
    except ValueError as err:
        if "devices" in str(err) or "divide" in str(err):
            raise ValueError(f"--parity-mesh {spec!r}: {err}") from None
        raise ValueError(f"--parity-mesh {spec!r}: expected 'auto', a device count N, or EXPERTSxHEADS such as 4x2")


def _spec_for(name: str, arr, mesh: Mesh) -> P:
    spec = _SPECS.get(name)
    if spec is None or arr.ndim != len(spec):
        return P()
    for dim, axis in zip(arr.shape, spec):  # fall back to replication when a dim does not divide
        if axis is not None and dim % mesh.shape[axis]:
            return P()
    return spec


def place_layer(params: dict, mesh: Mesh) -> dict:
    """Put one layer's params (numpy, JAX layout) on the mesh: experts sharded over "expert", head-major
    projections over "head", everything else replicated."""

    def place(tree):
        out = {}
        for k, v in tree.items():
            out[k] = place(v) if isinstance(v, dict) else jax.device_put(v, NamedSharding(mesh, _spec_for(k, v, mesh)))
        return out

    return place(params)


def placer(mesh: Mesh):
    """`Ling3Model(place=placer(mesh))`."""
    return lambda params: place_layer(params, mesh)


__all__ = ["make_mesh", "mesh_from_spec", "place_layer", "placer", "EXPERT", "HEAD", "math"]
