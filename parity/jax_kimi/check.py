"""The JAX Kimi Linear layers against transformers' built-in `KimiLinearForCausalLM`, site by site (issue 34).

One forward of the built-in on a prompt records, per decoder layer, the sites `parity.model.kimi_family.SITES` names
(`parity.torch_ref.kimi_dump.capture_steps`: the norms, the attention's projections, gate and gated norm, the
router's output, the experts' sum, the MLP, the layer's input and output; decode steps too). Each JAX layer
(`parity.jax_kimi.layer.decoder_layer`) is then fed the built-in's own layer input (teacher forcing: a divergence is
the layer's, not carried in from an earlier one) and its points are judged at those sites under Ling3's calibrated
rules, looked up as a replay looks them up (the site, the tensor's dtype, the run's dtype as the compute dtype;
`parity.numerics`: they are per site class, which issue 34 §3 asks to carry over to the family). As in a layer
replay, a MoE layer is routed to the built-in's experts (its `mlp.gate` output): a near-tie decided the other way by
a last-bit difference of the router input would otherwise swap an expert and fail the MLP without a bug; the tokens
where the JAX router on its own input chooses another set are counted (`routing_flips`), and the router logits are
judged as a site. `mlp (teacher-forced)` feeds the JAX MLP the built-in's MLP input, so an MLP that only inherits an
upstream difference still passes there. Isolated and free modes, decode steps and the backward are below.

A bf16 site that fails its rule is then asked, as a replay asks (`parity.replay.shadows.precision_entry`, the rule's
`precision_ratio` and `precision_dump_peak`), whether the JAX side is the more precise one: the same computation in
fp32 on the same inputs (bf16 weights, exact in fp32) is the shadow; where the JAX error against it is within the
rule's ratio of the built-in's, and the built-in's own error looks like rounding, the site is a `variant` ("more
precise than the reference": e.g. fp32 accumulation where the built-in's oneDNN bf16 GEMM rounds otherwise), not a
failure.

The built-in's sites come from `parity.torch_ref.kimi_dump` (captured live, or read back from a Kimi dump: the same
HDF5 schema as Ling3's, DESIGN §4). Used by tools/kimi_check.py (a checkpoint directory, e.g. the real-shape
`48b-a3b` preset) and tests/test_jax_kimi.py (the tiny preset in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


def as_f32(t: Any) -> np.ndarray:
    """A torch or JAX tensor as a float32 numpy array (bf16 values are exact in float32)."""
    if hasattr(t, "detach"):
        return t.detach().float().numpy()
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(t, jnp.float32))


def dtype_name(t: Any) -> str:
    """"bfloat16" or "float32" (or another numpy name) of a torch tensor or an array."""
    return str(t.dtype).removeprefix("torch.")


def _jax_points(sites: dict[tuple[int, str], Any], i: int) -> dict[str, str]:
    """{site: JAX point} of every judged site of `kimi_family.SITES` captured at layer i."""
    from parity.model.kimi_family import SITES

    return {s.site: s.jax_point for s in SITES if s.judged and (i, s.site) in sites}


def judged_pairs(sites: dict[tuple[int, str], Any], i: int, pts: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{site: (the built-in's tensor, the JAX point)} of every judged site of `kimi_family.SITES` captured at layer i,
    in execution order. A site the JAX reference has no point for is a one-line `ParityError`."""
    from parity.errors import ParityError
    from parity.model.kimi_family import SITES, canonical

    out = {}
    for s in SITES:
        if not s.judged or (i, s.site) not in sites:
            continue
        if s.jax_point not in pts:
            raise ParityError(f"layer {i}: site {s.site!r} (module {s.module!r}) has no JAX point {s.jax_point!r}: "
                              f"parity.jax_kimi does not compute it (parity.model.kimi_family.SITES)")
        out[s.site] = (sites[(i, s.site)], canonical(s.site, pts[s.jax_point]))
    return out


def routing_flips(ref_idx: Any, test_idx: Any) -> int:
    """Tokens whose set of chosen experts differs (the order within a token carries no meaning)."""
    a = np.sort(np.asarray(ref_idx).reshape(-1, np.shape(ref_idx)[-1]), axis=-1)
    b = np.sort(np.asarray(test_idx).reshape(-1, np.shape(test_idx)[-1]), axis=-1)
    return int((a != b).any(-1).sum())


@dataclass
class SiteResult:
    """One site's verdict and, where a bf16 site failed its rule, the three-way precision entry (`precision_entry`:
    JAX and built-in errors against the fp32 shadow). `status`: pass, variant (more precise than the reference),
    fail, or not provided (a target that does not return the site); `passed` is false only for fail."""

    verdict: Any  # None: the judged implementation does not provide the site
    precision: dict | None = None

    @property
    def status(self) -> str:
        if self.verdict is None:
            return "not provided"
        if self.verdict.passed:
            return "pass"
        return "variant" if self.precision and self.precision["more_precise"] else "fail"

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def message(self) -> str:
        if self.verdict is None:
            return "not provided by the target"
        msg = self.verdict.message()
        if self.precision is not None:
            e = self.precision
            msg += (f"\nAgainst the fp32 shadow: JAX error {e['error']:.3g}, the built-in's {e['dump_error']:.3g} "
                    f"(ratio {e['ratio']:.3g}, allowed {e['allowed_ratio']}), the built-in's peak "
                    f"{e['dump_peak']:.3g}× row RMS (allowed {e['allowed_dump_peak']}): "
                    + ("more precise than the reference" if e["more_precise"] else "not explained by precision"))
        return msg


def _judge(pairs: dict[str, tuple[Any, Any]], i: int | None, dtype: str, mode: str,
           shadow: Callable[[], dict[str, Any]] | None = None, rules: Any = None) -> dict[str, SiteResult]:
    """{site: SiteResult} of (reference, test) pairs under `rules` (default the family's: Ling3's calibrated rules
    with Kimi's overlay, `kimi_family.rules()`) for `mode`, as a replay picks them: by the site, the reference
    tensor's dtype and the run's (`dtype`) as the compute dtype; a site name's first word picks the rule
    (`mlp (teacher-forced)` is judged as `mlp`). The test is laid out as the reference where only the layout differs
    (the built-in's [B,1,T,·] or [N,·] views of a [B,T,·] point)."""
    from parity.model import kimi_family
    from parity.numerics.compare import compare
    from parity.replay.shadows import precision_entry

    rules = kimi_family.rules() if rules is None else rules
    out, shadows = {}, None
    for site, (ref, test) in pairs.items():
        r, t, tdt = as_f32(ref), as_f32(test), dtype_name(ref)
        if r.shape != t.shape and r.size == t.size:
            t = t.reshape(r.shape)
        rule = rules.rule_for(site.split(" ")[0], mode, tdt, dtype)
        res = SiteResult(compare(r, t, rule, name=f"L{i}/{site}" if i is not None else f"model/{site}", dtype=tdt))
        if not res.verdict.passed and shadow is not None and dtype == "bfloat16" and rule.precision_ratio is not None:
            shadows = shadow() if shadows is None else shadows  # computed once, for the first failing site
            if site in shadows:
                res.precision = precision_entry(r, t, as_f32(shadows[site]).reshape(r.shape), rule.precision_ratio,
                                                rule.precision_dump_peak)
        out[site] = res
    return out


def _forced(sites: dict, i: int, shape: tuple[int, ...]):
    """The built-in's experts of layer i as [B, T, k] int32 (forced routing), or None for a dense layer."""
    import jax.numpy as jnp

    if (i, "mlp.gate.topk_idx") not in sites:
        return None
    return jnp.asarray(np.asarray(sites[(i, "mlp.gate.topk_idx")]).reshape(shape[0], shape[1], -1), jnp.int32)


def _own_routing_flips(p: dict, spec: Any, sites: dict, i: int, x_normed: Any) -> int:
    """Tokens where the JAX router, on the JAX post-attention norm `x_normed`, picks another set than the built-in."""
    from parity.jax_kimi.moe import route

    _, own, _ = route(x_normed.reshape(-1, x_normed.shape[-1]), p["mlp"], spec.model)
    return routing_flips(np.asarray(sites[(i, "mlp.gate.topk_idx")]), own)


def layer_verdicts(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any], i: int, dtype: str,
                   conv_kernel: str = "torch", jit: bool = False, target: Any = None, rules: Any = None
                   ) -> tuple[dict[str, SiteResult], int | None]:
    """Layer mode: ({site: SiteResult}, routing flips or None for a dense layer) of layer i fed the built-in's
    layer-i input, routed to the built-in's experts, at every judged site of `kimi_family.SITES` the layer has.
    `sites`: {(layer, canonical site): torch tensor or numpy array} (`kimi_dump`); `state_dict`: the built-in's
    (module names, as loaded); `dtype`: "float32" or "bfloat16"; `conv_kernel`: the short conv's rounding point
    (`parity.jax_kimi.spec`); `jit`: the reference layer jitted with the reference's XLA options
    (`decoder_layer_jit`: every bf16 rounding kept) instead of op by op. `target`: a Kimi target
    (`parity.targets.kimi`) judged instead of the reference — a site it does not return is `not provided`; without
    one the reference is, with `mlp (teacher-forced)` too. The routing flips and the fp32 shadow are the
    reference's in both cases (the shadow is the formula in fp32, whoever is judged)."""
    import jax.numpy as jnp

    from parity.jax_kimi.layer import decoder_layer, decoder_layer_jit
    from parity.jax_kimi.moe import mlp_block
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params
    from parity.model.kimi_family import canonical

    spec = layer_spec(cfg, i, dtype, conv_kernel)
    jdt = spec.model.jdtype
    p = layer_params(state_dict, i, spec)
    x = jnp.asarray(as_f32(sites[(i, "input")]), jdt)
    forced = _forced(sites, i, x.shape)
    if target is None:
        out, pts = (decoder_layer_jit() if jit else decoder_layer)(p, x, spec, None, forced)
        mlp_tf, _ = mlp_block(p["mlp"], jnp.asarray(as_f32(sites[(i, "mlp:in")]), jdt), spec, forced)
        pairs = judged_pairs(sites, i, pts)
        pairs["mlp (teacher-forced)"] = (sites[(i, "mlp")], mlp_tf)
        normed = pts["post_attention_layernorm"]
    else:
        out, pts = target.layer_forward(i, state_dict, np.asarray(x), None if forced is None else np.asarray(forced))
        pts = {"output": out, **pts}
        pairs = {s: (sites[(i, s)], pts[s]) for s in _jax_points(sites, i) if s in pts}
        normed = pts.get("post_attention_layernorm")
    flips = None
    if spec.moe and normed is not None:
        flips = _own_routing_flips(p, spec, sites, i, jnp.asarray(normed, jdt))

    def shadow() -> dict[str, Any]:  # the reference layer in fp32 on the same (upcast) inputs: its judged points
        s32 = layer_spec(cfg, i, "float32", conv_kernel)
        _, pts32 = decoder_layer(p, x.astype(jnp.float32), s32, None, forced)
        tf32, _ = mlp_block(p["mlp"], jnp.asarray(as_f32(sites[(i, "mlp:in")])), s32, forced)
        got = {site: canonical(site, pts32[t]) for site, t in _jax_points(sites, i).items() if t in pts32}
        return got | {"mlp (teacher-forced)": tf32}

    results = _judge(pairs, i, dtype, "layer", shadow, rules)
    if target is not None:
        results = {s: results.get(s, SiteResult(None)) for s in _jax_points(sites, i)}
    return results, flips


def isolated_verdicts(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any], i: int, dtype: str,
                      conv_kernel: str = "torch", rules: Any = None) -> dict[str, Any]:
    """Isolated mode: each sub-module of layer i fed the built-in's own input of it — the input norm its layer input,
    the attention the built-in's normed input, the post-attention norm the built-in's residual (input + attention,
    added in the dtype as the layer does), the MLP the built-in's MLP input (routed to the built-in's experts), the
    output the built-in's residual and MLP output — judged under the rules of isolated replay, a failing bf16 site
    asked whether it is the more precise one (module doc)."""
    import jax.numpy as jnp

    from parity.jax_kimi import kda, mla
    from parity.jax_kimi.moe import mlp_block
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params
    from parity.jax_ling3.norms import rms_norm

    def blocks(run_dtype: str) -> dict[str, Any]:  # every block on the built-in's own inputs, in run_dtype
        spec = layer_spec(cfg, i, run_dtype, conv_kernel)
        jdt, eps = spec.model.jdtype, spec.model.eps
        p = layer_params(state_dict, i, spec)

        def ref(site: str):
            return jnp.asarray(as_f32(sites[(i, site)]), jdt)

        attend = kda.kda_attention if spec.kind == "kda" else mla.mla_attention
        mid = (ref("input") + ref("attention")).astype(jdt)
        y, _ = mlp_block(p["mlp"], ref("mlp:in"), spec, _forced(sites, i, mid.shape))
        return {"input_layernorm": rms_norm(ref("input"), p["input_layernorm"], eps),
                "attention": attend(p["self_attn"], ref("input_layernorm"), spec)[0],
                "post_attention_layernorm": rms_norm(mid, p["post_attention_layernorm"], eps),
                "mlp": y, "output": (mid + ref("mlp")).astype(jdt)}

    pairs = {site: (sites[(i, site)], got) for site, got in blocks(dtype).items()}
    return _judge(pairs, i, dtype, "isolated", lambda: blocks("float32"), rules)


def free_verdicts(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any], dtype: str,
                  conv_kernel: str = "torch", jit: bool = False, rules: Any = None, ids: Any = None
                  ) -> list[tuple[dict[str, Any], int | None]]:
    """Free mode: the JAX layers chained from the built-in's layer-0 input, each fed the previous JAX layer's output
    and routed by its own router (nothing forced), judged at every layer under the rules of free replay; per layer
    ({site: Verdict}, routing flips or None). With the prompt's `ids` and model-level sites in `sites`, one element
    more: the model-level verdicts (`model_verdicts`: the final norm and the head on the chain's own output)."""
    import jax.numpy as jnp

    from parity.jax_kimi.layer import decoder_layer, decoder_layer_jit
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    out = []
    x = None
    for i in range(cfg.num_hidden_layers):
        spec = layer_spec(cfg, i, dtype, conv_kernel)
        p = layer_params(state_dict, i, spec)
        x = jnp.asarray(as_f32(sites[(i, "input")]), spec.model.jdtype) if x is None else x
        y, pts = (decoder_layer_jit() if jit else decoder_layer)(p, x, spec)
        pairs = judged_pairs(sites, i, pts)
        flips = None
        if spec.moe:
            flips = routing_flips(np.asarray(sites[(i, "mlp.gate.topk_idx")]), pts["mlp.gate.topk_idx"])
        out.append((_judge(pairs, i, dtype, "free", rules=rules), flips))
        x = y
    if ids is not None and (None, "logits") in sites:
        out.append((model_verdicts(state_dict, cfg, [sites], ids, dtype, "free", rules=rules, final_outputs=[x]),
                    None))
    return out


def model_verdicts(state_dict: Any, cfg: Any, steps: list[dict[tuple[int | None, str], Any]], ids: Any,
                   dtype: str, mode: str, rules: Any = None, final_outputs: list[Any] | None = None
                   ) -> dict[str, SiteResult]:
    """The model-level sites (`kimi_family.MODEL_SITES`) of each step in `steps` ([prefill sites, decode step 1
    sites, ...]; `ids` [1, prompt + steps - 1] the tokens): `embed` = the embedding table at the step's ids,
    `final_norm` = the final RMSNorm (`KimiLinearRMSNorm`, as the layers' norms) of the last layer's output — the
    built-in's (layer, isolated mode) or the JAX chain's own (`final_outputs`, free mode) —, `logits` = the head
    (`lm_head`, a bias-free linear in the dtype: fp32 sums rounded once) on the built-in's final norm, or on the JAX
    one in free mode. Decode steps' sites are `decode k/<site>`. A dump made before model-level sites gives {}."""
    import jax.numpy as jnp

    from parity.jax_ling3.model import embed
    from parity.jax_ling3.norms import rms_norm
    from parity.jax_ling3.ops import linear

    jdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    table = jnp.asarray(as_f32(state_dict["model.embed_tokens.weight"]), jdt)
    w_norm = jnp.asarray(as_f32(state_dict["model.norm.weight"]), jdt)
    head = jnp.asarray(as_f32(state_dict["lm_head.weight"]), jdt).T  # [D, V]: JAX layout
    last = cfg.num_hidden_layers - 1
    ids = np.asarray(ids).reshape(1, -1)
    prompt = ids.shape[1] - (len(steps) - 1) if final_outputs is None else None
    out: dict[str, SiteResult] = {}
    for k, sites in enumerate(steps):
        if (None, "logits") not in sites:
            continue
        n = sites[(None, "embed")].shape[1]
        tok = ids[:, :n] if k == 0 else ids[:, prompt + k - 1:prompt + k]
        own = final_outputs is not None
        x = final_outputs[k] if own else jnp.asarray(as_f32(sites[(last, "output")]), jdt)
        fn = rms_norm(x, w_norm, cfg.rms_norm_eps)
        fn_in = fn if own else jnp.asarray(as_f32(sites[(None, "final_norm")]), jdt)
        # Ling3's `model.head` would upcast the logits (facts §6); the built-in's stay in the dtype: linear alone
        got = {"embed": embed(table, jnp.asarray(tok)), "final_norm": fn, "logits": linear(fn_in, head)}
        res = _judge({s: (sites[(None, s)], v) for s, v in got.items()}, None, dtype, mode, rules=rules)
        out |= {(f"decode {k}/{s}" if k else s): r for s, r in res.items()}
    return out


def grad_verdicts(model: Any, ids: Any, sites: dict[tuple[int, str], Any], i: int, dtype: str, seed: int = 0,
                  conv_kernel: str = "torch", rules: Any = None) -> dict[str, SiteResult]:
    """Backward, layer mode: layer i of the built-in (torch autograd) and of the JAX reference (`jax.vjp` of
    `decoder_layer`, routed to the built-in's experts) on the built-in's layer input and one seeded cotangent; their
    gradients of the layer input (`backward/input`) and of every trainable parameter (`backward/grad.<param>`),
    judged under Ling3's
    calibrated gradient rules (`backward/grad.*`, `backward/grad.mlp.experts.*`, `backward/input`) as a `--grads`
    replay picks them. The built-in's layer runs inside the model's own forward on `ids` (its input replaced by the
    captured one, so it gets the model's causal mask: called alone, its MLA would attend to every token), and its
    parameter gradients are put in the JAX layout by the same reader as its weights (`layer_params`: transposes,
    expert stacks), so both sides are compared leaf by leaf."""
    import torch

    cfg = model.config
    layer = model.model.layers[i]
    x = sites[(i, "input")].detach().clone().requires_grad_(True)
    g = torch.Generator().manual_seed(seed + i)
    cot = torch.randn(x.shape, generator=g).to(x.dtype)
    got: dict[str, Any] = {}

    def feed(m, args, kwargs):  # the captured input in place of the model's own (the same values, now a leaf)
        if args:
            return (x,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def keep(m, args, kwargs, out) -> None:
        got["out"] = out[0] if isinstance(out, tuple) else out

    hooks = [layer.register_forward_pre_hook(feed, with_kwargs=True),
             layer.register_forward_hook(keep, with_kwargs=True)]
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            model.model(ids)
    finally:
        for h in hooks:
            h.remove()
    got["out"].backward(cot)
    prefix = f"model.layers.{i}."
    grads = {prefix + n: (t.grad if t.grad is not None else torch.zeros_like(t))
             for n, t in [*layer.named_parameters(), *layer.named_buffers()]}
    model.zero_grad(set_to_none=True)

    pairs = _grad_pairs(model.state_dict(), cfg, sites, i, dtype, cot, grads, x.grad, conv_kernel)
    return _judge(pairs, i, dtype, "layer", rules=rules)  # the sites' `backward/` prefix picks the gradient rules


def _grad_pairs(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any], i: int, dtype: str, cot: Any,
                grads: dict[str, Any], input_grad: Any, conv_kernel: str) -> dict[str, tuple[Any, Any]]:
    """{"backward/input" | "backward/grad.<JAX param path>": (the built-in's gradient, the reference's)} of layer i:
    the reference's `jax.vjp` of `decoder_layer` (routed to the built-in's experts) at the built-in's layer input,
    fed the cotangent `cot`; `grads`: the built-in's parameter gradients by state-dict name (`model.layers.{i}.…`),
    read into the JAX layout by the same reader as its weights (`layer_params`: transposes, expert stacks)."""
    import jax
    import jax.numpy as jnp

    from parity.jax_kimi.layer import decoder_layer
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    spec = layer_spec(cfg, i, dtype, conv_kernel)
    jdt = spec.model.jdtype
    p = layer_params(state_dict, i, spec)
    xj = jnp.asarray(as_f32(sites[(i, "input")]), jdt)
    forced = _forced(sites, i, xj.shape)
    _, pullback = jax.vjp(lambda p, x: decoder_layer(p, x, spec, None, forced)[0], p, xj)
    dp, dx = pullback(jnp.asarray(as_f32(cot), jdt))
    ref_dp = layer_params(grads, i, spec)
    pairs = {} if input_grad is None else {"backward/input": (input_grad, dx)}
    for (path, want), (_, test) in zip(jax.tree_util.tree_flatten_with_path(ref_dp)[0],
                                       jax.tree_util.tree_flatten_with_path(dp)[0]):
        name = ".".join(str(k.key) for k in path).replace("experts_", "experts.")
        if name.endswith("expert_bias"):  # a buffer (e_score_correction_bias): selection only, not trained
            continue
        pairs[f"backward/grad.{name}"] = (want, test)
    return pairs


def dumped_grad_verdicts(state_dict: Any, cfg: Any, sites: dict[tuple[int, str], Any],
                         backward: dict[tuple[int, str], Any], i: int, dtype: str, conv_kernel: str = "torch",
                         rules: Any = None) -> dict[str, SiteResult]:
    """Backward, layer mode, from a Kimi dump's backward phase (`kimi_dump.capture_backward`: one training step's
    loss, not `grad_verdicts`' seeded cotangent): layer i's VJP fed the dumped dL/d(output), its input and parameter
    gradients judged as `grad_verdicts` judges them. A layer the dump has no backward for gives {}."""
    if (i, "output") not in backward:
        return {}
    prefix = f"model.layers.{i}."
    grads = {k: np.zeros(tuple(v.shape), np.float32) for k, v in state_dict.items() if k.startswith(prefix)}  # buffers
    grads |= {prefix + name[len("grad."):]: a for (j, name), a in backward.items() if j == i and name.startswith("grad.")}
    pairs = _grad_pairs(state_dict, cfg, sites, i, dtype, backward[(i, "output")], grads, backward.get((i, "input")),
                        conv_kernel)
    return _judge(pairs, i, dtype, "layer", rules=rules)


# the points a layer kind carries from one step to the next (`decoder_layer`'s state argument)
STATE_POINTS = {"kda": ("self_attn.recurrent_state", "self_attn.conv_state"),
                "mla": ("self_attn.k_nope_cache", "self_attn.k_rot_cache", "self_attn.v_cache")}


def decode_verdicts(state_dict: Any, cfg: Any, steps: list[dict[tuple[int, str], Any]], i: int, dtype: str,
                    conv_kernel: str = "torch", rules: Any = None) -> list[dict[str, SiteResult]]:
    """Decode, layer mode: per decode step k >= 1, {site: SiteResult} of the reference layer i fed the built-in's
    step-k layer input (routed to the built-in's step-k experts) and continuing from its *own* state — its KDA
    recurrent and conv state, or its MLA key/value cache — after its prefill on the built-in's prefill input and its
    earlier steps (the built-in's cache is not read). Judged as the prefill is: a bf16 site that fails its rule is
    asked whether it is the more precise side, against the reference's fp32 chain on the same inputs (its prefill and
    steps continued from its own fp32 state; computed once, when a site first fails); MLA's `attention.kv_b_proj` at
    the new tokens (the built-in re-expands every cached token's latent each step)."""
    import jax.numpy as jnp

    from parity.jax_kimi.layer import decoder_layer
    from parity.jax_kimi.spec import layer_spec
    from parity.jax_kimi.weights import layer_params

    spec = layer_spec(cfg, i, dtype, conv_kernel)
    jdt = spec.model.jdtype
    p = layer_params(state_dict, i, spec)
    names = STATE_POINTS[spec.kind]

    def chain(run_spec, upto: int):  # the reference through steps 0..upto on the built-in's inputs, its own state
        state, got = None, []
        for k, sites in enumerate(steps[:upto + 1]):
            x = jnp.asarray(as_f32(sites[(i, "input")]), run_spec.model.jdtype)
            _, pts = decoder_layer(p, x, run_spec, state, _forced(sites, i, x.shape))
            state = tuple(pts[n] for n in names)
            got.append(pts)
        return got

    def pairs_at(k: int, pts: dict) -> dict:
        pairs = judged_pairs(steps[k], i, pts)
        if "attention.kv_b_proj" in pairs:  # the built-in expands its whole cached latent at every step
            ref, test = pairs["attention.kv_b_proj"]  # [B, 1, S, ·]; the JAX point is the new token's [B, 1, ·]
            pairs["attention.kv_b_proj"] = (ref[..., -test.shape[-2]:, :], test)
        return pairs

    shadow32: list = []  # the fp32 chain, computed at the first failing bf16 site

    def shadow(k: int) -> dict[str, Any]:
        if not shadow32:
            shadow32.extend(chain(layer_spec(cfg, i, "float32", conv_kernel), len(steps) - 1))
        return {site: t for site, (_, t) in pairs_at(k, shadow32[k]).items()}

    return [_judge(pairs_at(k, pts), i, dtype, "layer", lambda k=k: shadow(k), rules)
            for k, pts in enumerate(chain(spec, len(steps) - 1)) if k]
