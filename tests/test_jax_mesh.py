"""KDA / MLA / MoE layers of the bundled tiny checkpoint, run with params sharded on a mesh of 8 simulated CPU devices
(experts over "expert", heads over "head"), equal the single-device results (fp32). Runs in a subprocess because
XLA_FLAGS must be set before jax initialises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from parity.jax_ling3.weights import CheckpointReader
    from parity.jax_ling3.spec import layer_spec
    from parity.jax_ling3.layer import decoder_layer_jit
    from parity.jax_ling3.sharding import make_mesh, place_layer
    from parity.jax_ling3.testing import assert_rel_close
    r = CheckpointReader(sys.argv[2])
    mesh = make_mesh(8)
    assert dict(mesh.shape) == {"expert": 4, "head": 2}
    h = jnp.asarray(np.random.default_rng(0).standard_normal((1, 9, r.config.hidden_size)), jnp.float32)
    for i in (1, 3):  # KDA + MoE, MLA (q-LoRA) + MoE
        spec = layer_spec(r.config, i, "float32")
        p = r.layer_params(i, "float32")
        ref, ref_pts, _ = decoder_layer_jit(jax.tree_util.tree_map(jnp.asarray, p), h, jnp.arange(9), spec)
        ps = place_layer(p, mesh)
        assert len(ps["mlp"]["experts_gate"].sharding.device_set) == 8
        assert ps["mlp"]["experts_gate"].addressable_shards[0].data.shape[0] == r.config.num_experts // 4
        out, pts, _ = decoder_layer_jit(ps, h, jnp.arange(9), spec)
        for site in ("attention.core", "attention", "mlp.routed", "mlp", "output"):
            assert_rel_close(pts[site], ref_pts[site], 1e-5, f"layer {i} {site} sharded vs single device")
        np.testing.assert_array_equal(np.asarray(pts["mlp.gate.topk_idx"]), np.asarray(ref_pts["mlp.gate.topk_idx"]))
    print("OK")
""")


def test_layers_on_an_8_device_mesh_match_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(ROOT / "dumps" / "ckpt" / "tiny")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-1000:] + out.stderr[-3000:]
