"""The protocol's point table (docs/points.md), generated from the site graph (`parity.model.points.SITE_GRAPH`).

`python tools/points_table.py > docs/points.md` writes it; `tests/test_points_table.py` regenerates it and compares,
and checks the shape and dtype columns against the bundled golden dumps (so the table is true of real dumps, not only
of this file).

What comes from the graph: the sites, their order, layer kinds, numerics classes, the isolated `submodule` inputs
(`Site.inputs` restricted to the sites the layer has, as `observe_isolated` feeds them), the decode-step `state`
(`Site.carry` / `Site.history`), `positions`, aliases. What this module adds, because the graph does not hold it: the
symbolic shape of each site (`SHAPES`) and its dtype rule in a bf16 dump (`DTYPE_RULES`).
"""

from __future__ import annotations

from parity.model.points import (BACKWARD_MODEL_SITES, MODEL_SITE_CLASSES, MODEL_SITES_AFTER, MODEL_SITES_BEFORE,
                                 NO_COTANGENT, SITE_GRAPH, Site, canonical_shape)

# Dimension names: B batch, T tokens of the step, D hidden_size, H heads, d KDA head_dim (K = V = d), P = H·d,
# W short_conv_kernel_size, c kv_lora_rank, r qk_rope_head_dim, n qk_nope_head_dim, v v_head_dim, Q q_lora_rank,
# I intermediate_size (dense) / moe_intermediate_size, E num_experts, k num_experts_per_tok, Vocab vocab_size.
DIMS = {"B": "batch", "T": "tokens of the step (prefill: the prompt; decode: 1)", "D": "hidden_size",
        "H": "num_attention_heads", "d": "KDA head_dim", "P": "H·d (KDA projection width)",
        "W": "short_conv_kernel_size", "c": "kv_lora_rank", "r": "qk_rope_head_dim", "n": "qk_nope_head_dim",
        "v": "v_head_dim", "Q": "q_lora_rank", "I": "intermediate_size", "E": "num_experts",
        "k": "num_experts_per_tok", "Vocab": "vocab_size"}

# (layer kind or "*", site) -> symbolic shape; a dimension is a product of names joined by "·" or a sum "c+r".
SHAPES: dict[tuple[str, str], str] = {
    ("*", "input"): "B,T,D", ("*", "input_layernorm"): "B,T,D",
    ("kda", "attention.q_proj"): "B,T,P", ("kda", "attention.k_proj"): "B,T,P", ("kda", "attention.v_proj"): "B,T,P",
    ("kda", "attention.q_conv1d"): "B,T,P", ("kda", "attention.k_conv1d"): "B,T,P",
    ("kda", "attention.v_conv1d"): "B,T,P", ("kda", "attention.f_proj"): "B,T,P",
    ("kda", "attention.b_proj"): "B,T,H", ("kda", "attention.g_proj"): "B,T,P",
    ("kda", "attention.o_proj"): "B,T,D",
    ("mla", "attention.q_a_proj"): "B,T,Q", ("mla", "attention.q_a_layernorm"): "B,T,Q",
    ("mla", "attention.q_b_proj"): "B,T,H·(n+r)", ("mla", "attention.q_proj"): "B,T,H·(n+r)",
    ("mla", "attention.kv_a_proj_with_mqa"): "B,T,c+r", ("mla", "attention.kv_a_layernorm"): "B,T,c",
    ("mla", "attention.g_proj"): "B,T,H", ("mla", "attention.dense"): "B,T,D",
    ("*", "attention"): "B,T,D", ("*", "post_attention_layernorm"): "B,T,D",
    ("*", "mlp.gate_proj"): "B,T,I", ("*", "mlp.up_proj"): "B,T,I", ("*", "mlp.down_proj"): "B,T,D",
    ("*", "mlp"): "B,T,D", ("*", "mlp.routed"): "B,T,D", ("*", "mlp.shared_experts"): "B,T,D", ("*", "output"): "B,T,D",
    ("*", "mlp.gate.topk_idx"): "B,T,k", ("*", "mlp.gate.topk_weight"): "B,T,k",
    ("model", "embed"): "B,T,D", ("model", "final_norm"): "B,T,D", ("model", "logits"): "B,T,Vocab",
}
# Canonical (reshaped) shapes: `canonical_shape`'s names, spelled with this table's dimension names.
_CANON_NAMES = {"K": "d", "V": "d", "HV": "H·v", "HNV": "H·(n+v)", "QKV": "3", "E": "E"}
_CANON_KDA_V = {"attention.core", "attention.o_norm"}

# (layer kind or "*", site) -> the dtype in a bf16 dump ("compute" = the dump's compute dtype, bf16 or fp32).
DTYPE_RULES: dict[tuple[str, str], str] = {
    ("kda", "attention.gate"): "float32 (the decay enters the recurrence in fp32, facts §8)",
    ("kda", "attention.beta"): "float32 (facts §8)",
    ("kda", "attention.state"): "float32 (the recurrent state, facts §8)",
    ("*", "mlp.gate.logits"): "float32 (router in fp32, facts §5)",
    ("*", "mlp.gate.topk_idx"): "int32 (ascending expert id per token)",
    ("*", "mlp.gate.topk_weight"): "float32 (facts §5)",
}


def shape_of(kind: str, site: str) -> str:
    """Symbolic shape of a site in a layer of `kind` ("kda" | "mla" | "model")."""
    for key in ((kind, site), ("*", site)):
        if key in SHAPES:
            return SHAPES[key]
    names = _canonical_names(kind, site)
    if names is None:
        raise KeyError(f"points_doc: no shape for site {site!r} of a {kind} layer; add it to SHAPES")
    return names


def _canonical_names(kind: str, site: str) -> str | None:
    class _Cfg:  # any sizes: only the names are read
        num_attention_heads = head_dim = kda_proj_size = short_conv_kernel_size = v_head_dim = 1
        qk_nope_head_dim = num_experts_per_tok = num_experts = 1

        @staticmethod
        def layer_kind(i):
            return kind

    got = canonical_shape(_Cfg, 0, site, 1, 1)
    if got is None:
        return None
    return ",".join(_CANON_NAMES.get(x, x) for x in got[1].split(","))


def dtype_of(kind: str, site: str) -> str:
    for key in ((kind, site), ("*", site)):
        if key in DTYPE_RULES:
            return DTYPE_RULES[key]
    return "compute"


def _kinds(s: Site) -> str:
    return {"layer": "every", "mla/q_lora": "mla (q-LoRA)", "mla/no_q_lora": "mla (no q-LoRA)"}.get(s.kind, s.kind)


def _inputs(s: Site) -> str:
    """The `submodule` inputs as `observe_isolated` feeds them (inputs the layer lacks are dropped there)."""
    if s.alias:
        return "— (not recomputed: " + s.alias + ")"
    out = [f"`{x}`" for x in s.inputs]
    if s.name == "attention.core" and s.kind == "mla":
        out = ["`attention.q_b_proj` or `attention.q_proj` (by q-LoRA)"] + [f"`{x}`" for x in s.inputs[2:]]
    if s.positions:
        out.append("`positions` (int [T], absolute)")
    return ", ".join(out) or "—"


def _state(s: Site) -> str:
    if s.carry:
        return "previous step's " + ", ".join(f"`{x}`" for x in s.carry)
    if s.history:
        return "every earlier token's " + ", ".join(f"`{x}`" for x in s.history) + " ([B,S,·], S earlier tokens)"
    return ""


def _site_kind_for_shape(s: Site) -> str:
    return "mla" if s.kind.startswith("mla") else ("kda" if s.kind == "kda" else "*")


def table_markdown() -> str:
    """The whole docs/points.md page."""
    L = ["# Canonical points",
         "",
         "<!-- generated by `python tools/points_table.py > docs/points.md` from parity/model/points.py "
         "(SITE_GRAPH) and parity/model/points_doc.py; tests/test_points_table.py fails when it is stale -->",
         "",
         "A point is `(phase, step, layer, site)` (DESIGN §3). Phases: `prefill` (step 0), `decode` (steps 1..N, T = 1),",
         "`backward` (the cotangent of a forward site, or `grad.<param>`). The rows below are the per-layer sites in",
         "execution order; a target's `layer_forward` returns them, its `submodule` (capability `isolated`) computes one",
         "of them from the dumped tensors in the **inputs** column (same phase and step, in the dump's dtypes) and, at",
         "decode steps, the **state** column (dumped tensors of earlier steps of the same layer). Model-level sites",
         "and the dimension names follow the table. Shapes are the dump's canonical shapes",
         "(`parity.model.points.canonical_shape`); dtype is the tensor's dtype in a bf16 dump (`compute`: bf16 in a",
         "bf16 dump, fp32 in an fp32 dump).",
         "",
         "| # | site | layers | shape | dtype (bf16 dump) | class | `submodule` inputs | decode-step state |",
         "|---|---|---|---|---|---|---|---|"]
    for n, s in enumerate(SITE_GRAPH, 1):
        k = _site_kind_for_shape(s)
        kind = "kda" if k == "*" else k
        L.append(f"| {n} | `{s.name}` | {_kinds(s)} | [{shape_of(kind, s.name)}] | {dtype_of(kind, s.name)} | "
                 f"{s.cls} | {_inputs(s)} | {_state(s)} |")
    L += ["",
          "## Model-level sites (layer `model`)",
          "",
          "| site | when | shape | dtype | class |",
          "|---|---|---|---|---|"]
    for site in MODEL_SITES_BEFORE + MODEL_SITES_AFTER:
        when = "before layer 0" if site in MODEL_SITES_BEFORE else "after the last layer"
        L.append(f"| `{site}` | {when} | [{shape_of('model', site)}] | {dtype_of('model', site)} | "
                 f"{MODEL_SITE_CLASSES[site]} |")
    L += ["",
          "## State conventions",
          "",
          "- `attention.conv_state` [3,B,P,W]: the q, k, v short-conv histories stacked in that order, each the last W",
          "  inputs of the conv (the projections' outputs, oldest first; fla's convention). After the prefill it holds",
          "  the prompt's last W tokens (zero-padded on the left for a prompt shorter than W).",
          "- `attention.state` [B,H,d,d] fp32: the KDA recurrent state S after the step, keys along the first d,",
          "  values along the second (o_t = Sᵀ(s·q_t), facts §3.6).",
          "- MLA keeps no state point: a decode step's `attention.core` is fed, as `state`, every earlier token's",
          "  tensors of its decode-step state column (the cache, for the expanded and the absorbed form),",
          "  concatenated along T.",
          "- Aliases (`input`, `attention`, `mlp` of a dense layer) are compared in layer / free mode, never recomputed",
          "  in isolated mode.",
          "",
          "## Backward phase",
          "",
          "`Point('backward', 0, layer, site)`: the cotangent dL/d(site) in the site's canonical shape, for every forward",
          "site except " + ", ".join(f"`{x}`" for x in NO_COTANGENT) + "; and `grad.<HF name relative to "
          "model.layers.{i}.>` for each parameter. Model level: " + ", ".join(f"`{x}`" for x in BACKWARD_MODEL_SITES)
          + ".",
          "",
          "## Dimension names",
          "",
          "| name | is |",
          "|---|---|"]
    L += [f"| {k} | {v} |" for k, v in DIMS.items()]
    return "\n".join(L) + "\n"


def eval_shape(sym: str, cfg, batch: int, seq: int) -> tuple[int, ...]:
    """A symbolic shape of this table evaluated for a config (the test compares it with real dumps)."""
    env = {"B": batch, "T": seq, "D": cfg.hidden_size, "H": cfg.num_attention_heads, "d": cfg.head_dim,
           "P": cfg.kda_proj_size, "W": cfg.short_conv_kernel_size, "c": cfg.kv_lora_rank, "r": cfg.qk_rope_head_dim,
           "n": cfg.qk_nope_head_dim, "v": cfg.v_head_dim, "Q": cfg.q_lora_rank or 0, "E": cfg.num_experts,
           "k": cfg.num_experts_per_tok, "I": cfg.intermediate_size, "Vocab": cfg.vocab_size}
    return tuple(int(eval(x.replace("·", "*"), {"__builtins__": {}}, env)) for x in sym.split(","))


__all__ = ["SHAPES", "DTYPE_RULES", "DIMS", "shape_of", "dtype_of", "table_markdown", "eval_shape"]
