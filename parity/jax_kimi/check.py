"""The JAX Kimi Linear layers against transformers' built-in `KimiLinearForCausalLM`, site by site (issue 34).

One forward of the built-in on a prompt records, per decoder layer, its input and output and the outputs of its
`input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp` modules (and the MLP's input, the router's
output), named by the canonical sites (`parity.torch_ref.kimi_dump.capture_sites`). Each JAX layer
(`parity.jax_kimi.layer.decoder_layer`) is then fed the built-in's own layer input (teacher forcing: a divergence is
the layer's, not carried in from an earlier one) and its points are judged at those sites under Ling3's calibrated
layer-mode rules for the dtype (`parity.numerics`: the rules a replay applies; they are per site class, which issue 34
§3 asks to carry over to the family). As in a layer replay, a MoE layer is routed to the built-in's experts (its
`mlp.gate` output): a near-tie decided the other way by a last-bit difference of the router input would otherwise
swap an expert and fail the MLP without a bug; the tokens where the JAX router on its own input chooses another set
are counted (`routing_flips`), and the router logits are judged as a site. `mlp (teacher-forced)` feeds the JAX MLP
the built-in's MLP input, so an MLP that only inherits an upstream difference still passes there.

The built-in's sites come from `parity.torch_ref.kimi_dump` (captured live, or read back from a Kimi dump: the same
HDF5 schema as Ling3's, DESIGN §4). Used by tools/kimi_check.py (a checkpoint directory, e.g. the real-shape
`48b-a3b` preset) and tests/test_jax_kimi.py (the tiny preset in memory).
"""

from __future__ import annotations

from typing import Any

import numpy as np

def as_f32(t: Any) -> np.ndarray:
    """A torch or JAX tensor as a float32 numpy array (bf16 values are exact in float32)."""
    if hasattr(t, "detach"):
        return t.detach().float().numpy()
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(t, jnp.float32))


# the sites judged, in this order: the canonical site -> the JAX point that holds it
JUDGED = {"input_layernorm": "input_layernorm", "attention": "self_attn",
          "post_attention_layernorm": "post_attention_layernorm", "mlp": "mlp"}


def routing_flips(ref_idx: Any, test_idx: Any) -> int:
    """Tokens whose set of chosen experts differs (the order within a token carries no meaning)."""
    a = np.sort(np.asarray(ref_idx).reshape(-1, np.shape(ref_idx)[-1]), axis=-1)
    b = np.sort(np.asarray(test_idx).reshape(-1, np.shape(test_idx)[-1]), axis=-1)
    return int((a != b).any(-1).sum())


def layer_verdicts(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any], i: int, dtype: str,
                   conv_kernel: str = "torch", jit: bool = False) -> tuple[dict[str, Any], int | None]:
    """({site: Verdict}, routing flips or None for a dense layer) of JAX layer i fed the built-in's layer-i input,
    routed to the built-in's experts: every `JUDGED` site, `output`, `mlp (teacher-forced)` and for a MoE layer
    `mlp.gate.logits`. `sites`: {(layer, canonical site): torch tensor or numpy array} (`kimi_dump`). `state_dict`: the built-in's (module names, as loaded); `dtype`: "float32" or
    "bfloat16"; `conv_kernel`: the short conv's rounding point (`parity.jax_kimi.spec`); `jit`: the layer jitted with
    the reference's XLA options (`decoder_layer_jit`: every bf16 rounding kept) instead of op by op."""
    import jax.numpy as jnp

    from parity.jax_kimi.layer import decoder_layer, decoder_layer_jit
    from parity.jax_kimi.moe import mlp_block, route
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params
    from parity.numerics.compare import compare
    from parity.numerics.tolerances import default_rules

    rules = default_rules()
    spec = layer_spec(cfg, i, dtype, conv_kernel)
    jdt = spec.model.jdtype
    p = layer_params(state_dict, i, spec)
    x = jnp.asarray(as_f32(sites[(i, "input")]), jdt)
    forced = None
    if spec.moe:
        forced = jnp.asarray(np.asarray(sites[(i, "mlp.gate.topk_idx")]).reshape(x.shape[0], x.shape[1], -1),
                             jnp.int32)
    out, pts = (decoder_layer_jit() if jit else decoder_layer)(p, x, spec, None, forced)
    mlp_tf, _ = mlp_block(p["mlp"], jnp.asarray(as_f32(sites[(i, "mlp:in")]), jdt), spec, forced)
    pairs = {site: (sites[(i, site)], pts[name]) for site, name in JUDGED.items()}
    pairs["output"] = (sites[(i, "output")], out)
    pairs["mlp (teacher-forced)"] = (sites[(i, "mlp")], mlp_tf)
    flips = None
    if spec.moe:
        logits = pts["mlp.gate.logits"].reshape(-1, spec.model.num_experts)
        pairs["mlp.gate.logits"] = (sites[(i, "mlp.gate.logits")], logits)
        xn = pts["post_attention_layernorm"]
        _, own, _ = route(xn.reshape(-1, xn.shape[-1]), p["mlp"], spec.model)  # the JAX router's own choice
        flips = routing_flips(np.asarray(sites[(i, "mlp.gate.topk_idx")]), own)
    verdicts = {site: compare(as_f32(ref), as_f32(test), rules.rule_for(site.split(" ")[0], "layer", dtype),
                              name=f"L{i}/{site}", dtype=dtype) for site, (ref, test) in pairs.items()}
    return verdicts, flips
