"""Per-tensor rel-L2 of the JAX VJP vs the twin autograd (fp32), worst per (layer kind, decay path or not): the survey
behind tests/test_backward_replay.py's fp32 criterion. Not a test: `PYTHONPATH=. python tests/measure_grad_rel_l2.py`."""
import sys, numpy as np
sys.path.insert(0, "tests")
from backward_twin import twin_backward
from parity.jax_ling3.weights import CheckpointReader
from parity.targets.reference import ReferenceTarget
def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64); n = np.linalg.norm(a)
    return np.linalg.norm(a - b) / n if n else (0.0 if not np.any(b) else np.inf)
worst = {}
for ck, T, seed in [(c, T, s) for c in ("tiny", "tiny-flash") for T, seeds in ((100, (11, 12, 13)), (40, (11,)), (130, (14,))) for s in seeds]:
    p = f"dumps/ckpt/{ck}"
    tb = twin_backward(p, "float32", T, seed)
    r = CheckpointReader(p); cfg = r.config
    t = ReferenceTarget(); t.build(cfg, "float32")
    for i in range(cfg.num_hidden_layers):
        t.load_layer(i, r.hf_tensors(i))
        b = t.layer_backward(i, tb.inputs[i], np.arange(T), tb.grads[i]["output"], tb.topk[i])
        pairs = [("input", tb.grads[i]["input"], b.input_grad)] + [(s, v, b.points[s]) for s, v in tb.grads[i].items() if s in b.points] + [("grad." + k, v, b.param_grads[k]) for k, v in tb.param_grads[i].items()]
        for s, a, bb in pairs:
            key = (cfg.layer_kind(i), "decay" if s in ("attention.gate", "attention.f_proj", "grad.attention.f_proj.weight", "grad.attention.A_log", "grad.attention.dt_bias") else "other")
            e = rel(a, bb)
            if e > worst.get(key, (0, ""))[0]: worst[key] = (e, f"{ck}/T{T}/s{seed}/L{i}/{s}")
        t.unload_layer(i)
    print(ck, T, seed, {k: (f"{v[0]:.3g}", v[1]) for k, v in worst.items()}, flush=True)
