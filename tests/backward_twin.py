"""The twin's torch-autograd gradients of one prefill, per layer, read with plain torch hooks (test helper, issue 26).

Independent of the dump side (`parity.torch_ref.backward`): every tensor of interest is retained with `retain_grad`
from a forward hook on the twin's own modules (official names; the twin's `tap_*` identities where the value is
computed inline), the loss is written out here, and `loss.backward()` fills `.grad`. Sites follow the canonical names
and shapes (`parity.model.points.canonical_shape`); the top-k weight's cotangent is put in canonical order (ascending
expert id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# site -> (module path relative to model.layers.{i}, "output" | "input", tuple index or None), by layer/MLP kind
_COMMON = {"input_layernorm": ("input_layernorm", "output", None), "attention": ("attention", "output", 0),
           "post_attention_layernorm": ("post_attention_layernorm", "output", None), "mlp": ("mlp", "output", None)}
_KDA = {**{f"attention.{n}": (f"attention.{n}", "output", None)
           for n in ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj", "o_norm", "o_proj")},
        **{f"attention.{n}_conv1d": (f"attention.{n}_conv1d", "output", 0) for n in "qkv"},
        "attention.gate": ("attention.tap_gate", "output", None), "attention.beta": ("attention.tap_beta", "output", None),
        "attention.core": ("attention.tap_core", "output", None)}
_MLA = {**{f"attention.{n}": (f"attention.{n}", "output", None)
           for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                     "kv_b_proj", "g_proj", "dense")},
        "attention.core": ("attention.tap_core", "output", None), "attention.gate": ("attention.tap_gate", "output", None),
        "attention.dense:in": ("attention.dense", "input", 0)}
_DENSE = {f"mlp.{n}": (f"mlp.{n}", "output", None) for n in ("gate_proj", "up_proj", "down_proj")}
_MOE = {"mlp.gate.logits": ("mlp.gate.tap_logits", "output", None),
        "mlp.gate.topk_weight": ("mlp.gate.tap_topk_weight", "output", None),
        "mlp.gate.topk_idx": ("mlp.gate.tap_topk_idx", "output", None),
        "mlp.routed": ("mlp.tap_routed", "output", None), "mlp.shared_experts": ("mlp.shared_experts", "output", None)}


@dataclass
class TwinBackward:
    config: object
    input_ids: np.ndarray
    loss: float
    d_logits: np.ndarray
    logits: np.ndarray
    embed_out_grad: np.ndarray  # dL/d(embedding output)
    final_norm_grad: np.ndarray
    last_output: np.ndarray  # the last layer's output (head input)
    inputs: list = field(default_factory=list)  # per layer: forward input [B,T,D]
    grads: list = field(default_factory=list)  # per layer: {site: cotangent} incl. "input", "output"
    topk: list = field(default_factory=list)  # per layer: topk_idx (canonical order) or None
    param_grads: list = field(default_factory=list)  # per layer: {HF suffix: grad}
    global_grads: dict = field(default_factory=dict)  # full HF name -> grad


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def twin_backward(ckpt: Path, dtype: str, T: int, seed: int = 0) -> TwinBackward:
    """Load the twin (remote code, CPU, `dtype`), run a prefill of T random ids and `loss.backward()` of the contract's
    loss (mean next-token CE in fp32 over t = 0..T-2); everything read with hooks."""
    from parity.torch_ref.loader import load_model

    lm = load_model(ckpt, "remote", dtype=dtype)
    model, cfg = lm.model, lm.config
    for p in model.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    kept: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def keep(key, t):
        if key[0] is None and key in kept:
            return  # the official forward calls the embedding / norm again for its MTP layers: keep the main stack's
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.retain_grad()
        kept[key] = t

    layers = model.model.layers
    for i in range(cfg.num_hidden_layers):
        lay = layers[i]
        handles.append(lay.register_forward_pre_hook(lambda m, a, kw, i=i: keep((i, "input"), a[0] if a else
                                                                                  kw["hidden_states"]),
                                                     with_kwargs=True))
        handles.append(lay.register_forward_hook(lambda m, a, o, i=i: keep((i, "output"), o[0])))
        table = {**_COMMON, **(_KDA if cfg.layer_kind(i) == "kda" else _MLA), **(_MOE if cfg.is_moe(i) else _DENSE)}
        for site, (path, io, idx) in table.items():
            try:
                mod = lay.get_submodule(path)
            except AttributeError:
                continue
            pick = (lambda v, idx=idx: v if idx is None else v[idx])
            if io == "output":
                handles.append(mod.register_forward_hook(lambda m, a, o, i=i, s=site, pick=pick: keep((i, s), pick(o))))
            else:
                handles.append(mod.register_forward_pre_hook(lambda m, a, i=i, s=site, pick=pick: keep((i, s), pick(a))))
    emb = {}
    handles.append(model.model.word_embeddings.register_forward_hook(lambda m, a, o: keep((None, "embed"), o)))
    handles.append(model.model.norm.register_forward_hook(lambda m, a, o: keep((None, "final_norm"), o)))
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits
    logits.retain_grad()
    lf = logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(lf.reshape(-1, lf.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    res = TwinBackward(cfg, ids.numpy(), float(loss.detach()), _np(logits.grad.float()), _np(logits.float()),
                       _np(kept[(None, "embed")].grad), _np(kept[(None, "final_norm")].grad),
                       _np(kept[(cfg.num_hidden_layers - 1, "output")]))
    named = dict(model.named_parameters())
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        grads, topk = {}, None
        for (li, site), t in kept.items():
            if li != i:
                continue
            if site == "mlp.gate.topk_idx":
                topk = t.detach().numpy()
            elif t.grad is not None:
                grads[site] = _np(t.grad)
        if topk is not None and "mlp.gate.topk_weight" in grads:  # canonical order: ascending expert id
            order = np.argsort(topk, axis=-1)
            grads["mlp.gate.topk_weight"] = np.take_along_axis(grads["mlp.gate.topk_weight"], order, -1)
        res.inputs.append(_np(kept[(i, "input")]))
        res.grads.append(grads)
        res.topk.append(None if topk is None else np.sort(topk, axis=-1).astype(np.int32))
        res.param_grads.append({k[len(pre):]: (_np(p.grad) if p.grad is not None else np.zeros(p.shape, np.float32))
                                for k, p in named.items() if k.startswith(pre)})
    res.global_grads = {k: _np(named[k].grad) for k in ("model.word_embeddings.weight", "model.norm.weight",
                                                        "lm_head.weight")}
    lm.release()
    return res
