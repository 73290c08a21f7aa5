"""Probe a loaded PyTorch Ling3 model for its behaviour on the semantic forks of `parity.model.semantics` — measured on the
model, never assumed from its class name.

SwiGLU clamp: one routed expert (of a layer whose `expert_swiglu_limit_list` entry is set) and the shared expert (of a
layer whose `share_expert_swiglu_limit_list` entry is set) are called directly on inputs scaled so that
|up(x)| and silu(gate(x)) reach ~20·L; the output is compared with the clamped and the unclamped SwiGLU computed in
fp32 from the module's own weights. The closer one (by far: the two differ by O(1) relative, the module's own
rounding is ≤ 1e-2) decides `applied` / `ignored`.

KDA chunk precision (`probe_kda_chunk`): the implementation of the KDA layers' chunk entry point and the compute dtype
(fla's kernels round their intermediates to the input dtype; `chunk_precision_of`); the dump overwrites it with what it
observed on the chunk path (`observed_chunk_precision`) when its prompt ran that path.

KDA gate / beta precision: the KDA recurrence entry points of the attention module's Python module
(`chunk_kda` / `fused_recurrent_kda` — the official file and the twin with fla or the CPU stand-ins —,
`chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention` — transformers' built-in —, `kda_recurrent` /
`kda_chunked` — the twin's pure-PyTorch path) are wrapped for one short forward (8 tokens) and report the dtype of the
`g` and `beta` they receive. A call with `use_gate_in_kernel=True` receives the raw f_proj output and computes the gate
inside the kernel, in fp32 (fla's kernels and the stand-ins alike, facts §8): its gate precision is float32.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from parity.model.semantics import SEMANTICS_VERSION, departures

KDA_ENTRY_POINTS = ("chunk_kda", "fused_recurrent_kda", "chunk_kimi_delta_attention",
                    "recurrent_kimi_delta_attention", "kda_recurrent", "kda_chunked")
PROBE_TOKENS = 8
_DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def _layers(model) -> Any:
    root = getattr(model, "model", model)
    return root.layers


def _swiglu_ref(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, limit: float | None):
    g, u = x @ wg.T, x @ wu.T
    a = F.silu(g)
    if limit:
        a, u = a.clamp(max=limit), u.clamp(-limit, limit)
    return (a * u) @ wd.T


def _expert_call(mlp, e: int = 0):
    """(call(x) -> y, (Wg, Wu, Wd) fp32) for routed expert e of an MoE block, or the shared expert when e is None."""
    if e is None:
        m = mlp.shared_experts
        return m, (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
    ex = mlp.experts
    if isinstance(ex, torch.nn.ModuleList):  # official file / twin: one SwiGLU module per expert
        m = ex[e]
        return m, (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
    # transformers' built-in: 3-D gate_up_proj [E, 2I, D] / down_proj [E, D, I], called with (x, top-k ids, weights)
    wg, wu = ex.gate_up_proj[e].chunk(2, dim=0)

    def call(x):
        n = x.shape[0]
        return ex(x, torch.full((n, 1), e, dtype=torch.long, device=x.device), torch.ones(n, 1, dtype=x.dtype,
                                                                                       device=x.device))
    return call, (wg, wu, ex.down_proj[e])


@torch.no_grad()
def probe_swiglu(fn, weights, limit: float, hidden: int, dtype: torch.dtype, device) -> dict:
    """`applied` / `ignored` / `undetermined` for one SwiGLU callable with clamp limit `limit` (module docstring)."""
    wg, wu, wd = (w.detach().float() for w in weights)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(16, hidden, generator=gen).to(device)
    scale = 20.0 * limit / float((x0 @ wu.T).abs().max().clamp_min(1e-30))
    x = (x0 * scale).to(dtype)
    y = fn(x).float()
    xf = x.float()
    ref_c, ref_p = _swiglu_ref(xf, wg, wu, wd, limit), _swiglu_ref(xf, wg, wu, wd, None)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    d_c, d_p, sep = rel(y, ref_c), rel(y, ref_p), rel(ref_c, ref_p)
    verdict = "undetermined"
    if d_c < 0.05 and d_c < 0.1 * sep:
        verdict = "applied"
    elif d_p < 0.05 and d_p < 0.1 * sep:
        verdict = "ignored"
    return {"verdict": verdict, "limit": limit, "rel_err_vs_clamped": d_c, "rel_err_vs_unclamped": d_p,
            "clamped_vs_unclamped": sep}


def probe_clamp(model, cfg) -> dict:
    """The `swiglu_clamp` fork: routed and shared probes (module docstring)."""
    layers = _layers(model)
    p = next(model.parameters())
    out: dict[str, Any] = {}
    for kind, limit_of in (("routed", cfg.expert_swiglu_limit), ("shared", cfg.shared_swiglu_limit)):
        L = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i) and limit_of(i)), None)
        if L is None or (kind == "shared" and not cfg.has_shared_expert):
            out[kind] = {"verdict": "not-configured"}
            continue
        fn, weights = _expert_call(layers[L].mlp, 0 if kind == "routed" else None)
        out[kind] = {"layer": L, **probe_swiglu(fn, weights, float(limit_of(L)), cfg.hidden_size, p.dtype,
                                                p.device)}
    verdicts = {v["verdict"] for v in out.values()} - {"not-configured"}
    if not verdicts:
        value = "not-configured"
    elif len(verdicts) == 1:
        value = verdicts.pop()
    else:
        value = "mixed"
    return {"value": value, "probe": out}


def _recording(orig, entry: str, records: list):
    """A wrapper of a KDA entry point that records the dtypes of the `g` and `beta` it receives, then calls it."""
    try:
        sig = inspect.signature(orig)
    except (TypeError, ValueError):
        sig = None

    def wrapper(*args, **kwargs):
        bound: dict = {}
        if sig is not None:
            try:
                bound = dict(sig.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                bound = {}
        # (q, k, v, g, beta, ...) is the positional order of every entry point (fla, the built-in, the twin)
        g = bound.get("g", kwargs.get("g", args[3] if len(args) > 3 else None))
        beta = bound.get("beta", kwargs.get("beta", args[4] if len(args) > 4 else None))
        records.append({"entry": entry, "g": _dtype_name(g), "beta": _dtype_name(beta),
                        "use_gate_in_kernel": bool(bound.get("use_gate_in_kernel",
                                                             kwargs.get("use_gate_in_kernel", False))),
                        "lower_bound": bound.get("lower_bound", kwargs.get("lower_bound", _ABSENT))})
        return orig(*args, **kwargs)

    return wrapper


_ABSENT = "absent"  # the entry point was not given a lower_bound argument


def gate_form_of(lower_bound) -> str:
    """`kda_gate_form` of a lower bound: fla picks the form by `lower_bound is None` (facts §3.5)."""
    return "softplus" if lower_bound is None else "lower-bound"


def probe_gate_form(model, cfg, records: list[dict]) -> dict:
    """The KDA decay gate form the runtime used: the `lower_bound` a kernel that computes the gate was given
    (use_gate_in_kernel), else the KDA attention module's own `lower_bound` (the twin's pure-PyTorch path, the
    built-in), else the config's `kda_lower_bound` — the probe string says which."""
    if not any(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers)):
        return {"value": "not-applicable", "lower_bound": None, "probe": "no KDA layer"}
    r = next((r for r in records if r["use_gate_in_kernel"] and r["lower_bound"] != _ABSENT), None)
    if r is not None:
        lb, how = r["lower_bound"], f"lower_bound={r['lower_bound']!r} passed to {r['entry']} (gate in the kernel)"
    else:
        layers = _layers(model)
        attn = next((getattr(layers[i], "attention", None) or getattr(layers[i], "self_attn", None)
                     for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"), None)
        if attn is not None and hasattr(attn, "lower_bound"):
            lb, how = attn.lower_bound, f"{type(attn).__name__}.lower_bound = {attn.lower_bound!r}"
        else:
            lb, how = cfg.kda_lower_bound, f"config kda_lower_bound = {cfg.kda_lower_bound!r} (not observed)"
    lb = None if lb is None else float(lb)
    return {"value": gate_form_of(lb), "lower_bound": lb, "probe": how}


def _dtype_name(t) -> str:
    dt = getattr(t, "dtype", None)
    return _DT.get(dt, str(dt))


@contextmanager
def _observe_kda(model, cfg, records: list):
    """Wrap the KDA entry points found in the Python modules of the model's KDA attention modules."""
    layers = _layers(model)
    pymods = set()
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_kind(i) == "kda":
            attn = getattr(layers[i], "attention", None) or getattr(layers[i], "self_attn", None)
            if attn is not None and type(attn).__module__ in sys.modules:
                pymods.add(sys.modules[type(attn).__module__])
    undo = []
    for mod in pymods:
        for name in KDA_ENTRY_POINTS:
            orig = getattr(mod, name, None)
            if not callable(orig):
                continue
            setattr(mod, name, _recording(orig, f"{mod.__name__}.{name}", records))
            undo.append((mod, name, orig))
    try:
        yield
    finally:
        for mod, name, orig in reversed(undo):
            setattr(mod, name, orig)


@torch.no_grad()
def probe_kda(model, cfg, input_ids: torch.Tensor) -> dict:
    """The KDA gate / beta precision forks from one short forward (module docstring)."""
    if not any(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers)):
        return {"gate": "not-applicable", "beta": "not-applicable", "probe": "no KDA layer",
                "form": probe_gate_form(model, cfg, [])}
    records: list[dict] = []
    ids = torch.as_tensor(input_ids)[:1, :PROBE_TOKENS]
    with _observe_kda(model, cfg, records):
        model(input_ids=ids, use_cache=False)
    if not records:
        return {"gate": "undetermined", "beta": "undetermined",
                "probe": f"no KDA entry point among {KDA_ENTRY_POINTS} was called",
                "form": probe_gate_form(model, cfg, [])}
    r = records[0]
    form = probe_gate_form(model, cfg, records)
    gate = "float32" if r["use_gate_in_kernel"] else r["g"]
    how = (f"{r['entry']} received g {r['g']}" + (" with use_gate_in_kernel=True (gate computed in the kernel, fp32)"
                                                  if r["use_gate_in_kernel"] else " (already gated)")
           + f" and beta {r['beta']}; {len(records)} KDA call(s) on a {ids.shape[1]}-token forward")
    return {"gate": gate, "beta": r["beta"], "probe": how, "form": form}


CHUNK_ENTRY_POINTS = ("chunk_kda", "chunk_kimi_delta_attention", "kda_chunked")


def chunk_precision_of(impl: str, compute_dtype: torch.dtype, stand_in_mode: str) -> str:
    """The `kda_chunk_precision` fork's value for a chunk entry point of implementation `impl`
    (`parity.torch_ref.kernels.implementation_of`: 'fla' | 'stand-in' | 'torch:<module>'): fla's Triton kernels keep
    their intermediates in the input dtype, the stand-ins do so only in their "kernel" mode, the pure-PyTorch paths
    (the twin's, transformers' fallback) upcast to fp32. An fp32 run is fp32 whatever ran."""
    dt = _DT.get(compute_dtype, str(compute_dtype))
    if dt == "float32":
        return "float32"
    if impl == "fla":
        return dt
    if impl == "stand-in":
        return dt if stand_in_mode == "kernel" else "float32"
    if impl.startswith("torch:"):
        return "float32"
    return "undetermined"


def probe_kda_chunk(model, cfg) -> dict:
    """The `kda_chunk_precision` fork: which implementation the KDA layers' chunk entry point resolves to (the twin
    without fla calls its own `kda_chunked`), and the model's compute dtype. The dump replaces the value with the
    implementation observed on the chunk path when the prompt exercised it (`observed_chunk_precision`)."""
    from parity.torch_ref import fla_cpu
    from parity.torch_ref.kernels import implementation_of

    if not any(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers)):
        return {"value": "not-applicable", "probe": "no KDA layer"}
    dtype = next(model.parameters()).dtype
    layers = _layers(model)
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_kind(i) != "kda":
            continue
        attn = getattr(layers[i], "attention", None) or getattr(layers[i], "self_attn", None)
        mod = sys.modules.get(type(attn).__module__) if attn is not None else None
        if mod is None:
            continue
        names = ("kda_chunked",) if getattr(attn, "use_fla", True) is False else CHUNK_ENTRY_POINTS
        fn = next((getattr(mod, n) for n in names if callable(getattr(mod, n, None))), None)
        if fn is None:
            continue
        impl = implementation_of(fn)
        mode = fla_cpu.get_chunk_precision()
        return {"value": chunk_precision_of(impl, dtype, mode),
                "probe": {"entry": f"{mod.__name__}.{getattr(fn, '__name__', '?')}", "implementation": impl,
                          "compute_dtype": _DT.get(dtype, str(dtype)), "stand_in_mode": mode, "observed": False}}
    return {"value": "undetermined", "probe": f"no KDA chunk entry point among {CHUNK_ENTRY_POINTS} was found"}


def observed_chunk_precision(sem: dict, impl: str, compute_dtype: torch.dtype) -> dict:
    """`sem` with `kda_chunk_precision` set from the implementation the dump observed on its chunk path (its
    `kernels.kda_paths['chunk_kda']`, parity.torch_ref.kernels), so the attr says what ran, not what was resolved."""
    from parity.torch_ref import fla_cpu

    mode = fla_cpu.get_chunk_precision()
    out = dict(sem, kda_chunk_precision=chunk_precision_of(impl, compute_dtype, mode))
    out["probes"] = dict(sem.get("probes") or {}, kda_chunk={"implementation": impl, "observed": True,
                                                             "compute_dtype": _DT.get(compute_dtype,
                                                                                      str(compute_dtype)),
                                                             "stand_in_mode": mode})
    out["departures"] = [d["fork"] for d in departures(out)]
    return out


def probe(model, cfg, input_ids: torch.Tensor) -> dict:
    """The `semantics` root attr of a dump (parity.model.semantics): every fork's value, how it was measured, and the
    forks where it departs from the intended behaviour."""
    clamp = probe_clamp(model, cfg)
    kda = probe_kda(model, cfg, input_ids)
    chunk = probe_kda_chunk(model, cfg)
    sem = {"version": SEMANTICS_VERSION, "swiglu_clamp": clamp["value"], "kda_gate_precision": kda["gate"],
           "kda_beta_precision": kda["beta"], "kda_chunk_precision": chunk["value"],
           "kda_gate_form": kda["form"]["value"], "kda_lower_bound": kda["form"]["lower_bound"],
           "probes": {"swiglu_clamp": clamp["probe"], "kda": kda["probe"], "kda_chunk": chunk["probe"],
                      "kda_gate_form": kda["form"]["probe"]}}
    sem["departures"] = [d["fork"] for d in departures(sem)]
    return sem


__all__ = ["probe", "probe_clamp", "probe_kda", "probe_kda_chunk", "probe_swiglu", "chunk_precision_of",
           "observed_chunk_precision"]
