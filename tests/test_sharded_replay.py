"""`run_replay` of the bundled bf16 tiny dump with the reference target's params sharded on a mesh of 8 simulated CPU
devices ("expert" x "head" = 4 x 2) gives the same verdict per point as unsharded (DESIGN §7, §9). Layers 1 (KDA+MoE)
and 3 (MLA+MoE) only, to keep it fast. A subprocess, because XLA_FLAGS must be set before jax initialises.

`run_replay` builds the target without a mesh (`target.build(config, dtype)`), so the script passes a
ReferenceTarget whose build() adds the mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "dumps" / "tiny-bf16.h5"

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax
    assert len(jax.devices()) == 8, jax.devices()
    from parity.jax_ling3.sharding import mesh_from_spec
    from parity.replay import run_replay
    from parity.targets.reference import ReferenceTarget

    class MeshTarget(ReferenceTarget):  # records where each layer's experts live
        seen = set()

        def load_layer(self, i, hf):
            super().load_layer(i, hf)
            self.seen.add(len(self.params[i]["mlp"]["experts_gate"].sharding.device_set))

    def statuses(rep):
        return {(p["phase"], p["step"], p["layer"], p["site"]): p["status"] for p in rep["points"]}

    layers = [1, 3]
    plain = run_replay(sys.argv[2], layers=layers)
    tgt = MeshTarget()
    sharded = run_replay(sys.argv[2], target=tgt, layers=layers, mesh="4x2")  # as `pytest parity --parity-mesh 4x2`
    assert tgt.seen == {8}, tgt.seen  # the sharded run really had its experts spread over the mesh
    a, b = statuses(plain), statuses(sharded)
    assert len(a) > 50 and a.keys() == b.keys(), (len(a), sorted(set(a) ^ set(b))[:5])
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not diff, f"{len(diff)} points changed status sharded vs unsharded: {list(diff.items())[:5]}"
    assert {s for s in a.values()} & {"pass", "fail"}, set(a.values())
    # perturbation: a different set of statuses must be detected by the same comparison
    k0 = next(iter(a))
    assert {**a, k0: "fail" if a[k0] != "fail" else "pass"} != b
    for bad in ("4x4", "16", "wide"):  # one clear line, not a jax traceback
        try:
            mesh_from_spec(bad)
        except ValueError as e:
            assert str(e).startswith(f"--parity-mesh {bad!r}: "), e
        else:
            raise AssertionError(bad)
    print("OK", len(a), sorted(set(a.values())))
""")


@pytest.mark.skipif(not DUMP.exists(), reason=f"{DUMP} not present")
def test_sharded_replay_gives_the_same_verdicts():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(DUMP)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-1500:] + out.stderr[-3000:]


def test_bad_parity_mesh_is_one_usage_error():
    out = subprocess.run([sys.executable, "-m", "pytest", "parity", "-q", "-p", "no:cacheprovider", "--parity-dump",
                          str(DUMP), "--parity-mesh", "64x64"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 4, out.stdout[-1000:] + out.stderr[-1000:]  # pytest's usage-error exit code
    assert "--parity-mesh '64x64': make_mesh(4096): only" in out.stderr and "passed" not in out.stdout
