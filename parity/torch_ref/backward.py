"""The backward phase of a dump (`tools/dump_hf.py --grads`, issue 26; the contract in DESIGN §4).

After the prefill forward — the same forward the prefill points come from, run with autograd on — one backward pass
of the loss `next_token_ce_mean_fp32` (`next_token_ce`) through the same runtime records:
- activation cotangents: dL/d(the tensor of a canonical forward site), as `Point("backward", 0, layer, site)` with the
  forward point's canonical shape and dtype (`mlp.gate.topk_weight` in the forward's canonical top-k order). They are
  read by tensor hooks that `CotangentRecorder` registers when the forward capture emits a live tensor (one that
  requires grad); a site whose forward value does not require grad (computed by the capture under no_grad, integer
  routing ids) or whose tensor is not on the loss's path gets no point, only an unavailable entry with the reason;
- the model-level cotangents `logits` (dL/d the fp32 logits of the loss), `final_norm` and `embed`;
- weight gradients of every parameter under its HF (official checkpoint) name: `grad.<name relative to
  model.layers.{i}.>` per layer, `grad.<full name>` at model level (`hf_param_grads`; the built-in `bailing_hybrid`'s
  renamed and merged parameters are mapped back, `native_to_hf`).
Routing in the backward is the forward's: torch does not differentiate the discrete top-k.

The MTP loss (issue 33, `--mtp-loss-scale F`, opt-in): the loss becomes the official `BailingMoeV3ForCausalLM.forward`'s
training `loss` with `labels = input_ids` and `mtp_loss_scaling_factor = F` (`MTP_LOSS_DEFINITION`, `mtp_ce`), and MTP
layer j's backward points are written like a main layer's in the group `MTP{j}` (`MtpPoint("backward", 0, j, site)`,
sites `parity.model.mtp_points.mtp_backward_sites`), plus `hnorm:in` (`watch_mtp_hidden`). Without it the MTP layer is
off the loss's path: its parameters get no gradient and no backward points are written for it (dumps before issue 33).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from parity.errors import ParityError
from parity.model.mtp_points import MtpPoint
from parity.model.points import Point
from parity.torch_ref.capture import Capture, to_numpy

LOSS_NAME = "next_token_ce_mean_fp32"
LOSS_DEFINITION = ("L = mean over positions t = 0..T-2 of the prompt of CE(logits[b, t].float(), input_ids[b, t+1]) "
                   "(natural log, fp32 logits, mean over B*(T-1) terms); prefill only")

# Why a site of a backward pass has no cotangent (unavailable table, keys `backward/L03/<site>`).
NO_GRAD_DERIVED = ("its forward value is derived by the capture under no_grad ({module}), outside the runtime's "
                   "autograd graph: no cotangent to read")
NO_GRAD_VALUE = "its forward value does not require grad ({module}: integer routing ids or a detached tensor)"
OFF_PATH = ("its tensor ({module}) is not on the loss's autograd path in this runtime (the runtime computes it for "
            "observation only, or recomputes the value elsewhere and uses that copy)")
# Sites that have no cotangent in any runtime, by what they are.
NO_COTANGENT = {
    "mlp.gate.topk_idx": "integer routing ids: no cotangent (the discrete top-k is not differentiated; routing in the "
                         "backward is the forward's)",
    "attention.state": "the recurrent state after the prefill only feeds the cache (decode steps): the prefill's loss "
                       "does not depend on it, no cotangent",
    "attention.conv_state": "the conv state after the prefill only feeds the cache (decode steps): the prefill's loss "
                            "does not depend on it, no cotangent",
}


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The contract's loss (LOSS_DEFINITION): mean next-token cross-entropy over the prompt, fp32. logits [B,T,V]."""
    B, T, V = logits.shape
    if T < 2:
        raise ParityError(f"--grads: a prompt of {T} token(s) has no next-token target; expected at least 2 tokens")
    lf = logits.float()
    return F.cross_entropy(lf[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1).to(lf.device), reduction="mean")


# The MTP term (issue 33). Read from the official file (sha256 c2509bf7…, `BailingMoeV3ForCausalLM.forward`, lines
# ~1583-1607): for MTP layer i, `mtp_logits = lm_head(mtp_hidden_states[i]).float()`; `shift_labels_mtp` = labels
# rolled left by one more position per MTP layer with -100 filled in (`roll_tensor(..., fill_value=-100)`); then
# `self.loss_function` — transformers' ForCausalLMLoss — shifts once more (pads -100 and takes labels[..., 1:]) on
# the *flattened* labels and takes the mean CE over the non-ignored entries; `loss += mtp_loss_scaling_factor *
# mtp_loss`. So with labels = input_ids and one MTP layer (B = 1) the MTP layer's logits at position t are scored
# against the token two positions on, t = 0..T-3. Its input ids are shifted by one only (facts §2): position t sees
# token t+1 and the main state at t, and predicts token t+2.
MTP_LOSS_NAME = "mtp_next_next_token_ce_mean_fp32"
MTP_LOSS_DEFINITION = ("L = backward.value + scale * mtp, mtp = mean over positions t = 0..T-3 of the prompt of "
                       "CE(mtp_logits[0, t], input_ids[0, t+2]) with mtp_logits = lm_head(MTP0 final_layernorm "
                       "output).float() (natural log, fp32 logits, mean over T-2 terms; B = 1, one MTP layer); prefill "
                       "only. The official BailingMoeV3ForCausalLM.forward's `loss` with labels = input_ids and "
                       "mtp_loss_scaling_factor = scale (its `mtp_loss[0]` = mtp); mtp_loss.value = mtp, "
                       "mtp_loss.total = L")
IGNORE_INDEX = -100  # transformers' ignore_index, as the official loss uses it


def check_mtp_loss(scale: float, batch: int, seq: int, n_mtp: int, has_mtp_layer: bool) -> None:
    """Refuse an MTP loss the definition does not cover, in one line naming the option and what was expected."""
    import math

    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ParityError(f"--mtp-loss-scale {scale!r}: expected a finite number > 0 (without the option the MTP "
                          "loss is not included)")
    if n_mtp != 1 or not has_mtp_layer:
        raise ParityError(f"--mtp-loss-scale: the checkpoint declares num_nextn_predict_layers = {n_mtp}"
                          f"{'' if has_mtp_layer else ' and the runtime has no MTP layer'}; expected exactly one MTP "
                          "layer the runtime runs (the official forward's MTP loss loop rebinds mtp_hidden_states "
                          "after its first layer, so only one is defined)")
    if batch != 1:
        raise ParityError(f"--mtp-loss-scale: a batch of {batch} prompts; expected 1 (the official loss shifts the "
                          "flattened batch, so a row's last position would be scored against the next row's second "
                          "token): dump one prompt at a time")
    if seq < 3:
        raise ParityError(f"--mtp-loss-scale: a prompt of {seq} token(s); expected at least 3 (the MTP layer at "
                          "position t predicts token t+2)")


def mtp_ce(mtp_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The MTP term of MTP_LOSS_DEFINITION (unscaled), computed in the official file's own form so that its value is
    the official `mtp_loss[0]` bit for bit: labels shifted left by two per row with IGNORE_INDEX filled in, flattened,
    `F.cross_entropy(..., ignore_index=-100)` (mean over the T-2 scored positions). mtp_logits [1,T,V] fp32."""
    B, T, V = mtp_logits.shape
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-2] = input_ids[:, 2:]
    return F.cross_entropy(mtp_logits.float().reshape(-1, V), labels.reshape(-1).to(mtp_logits.device),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def mtp_loss_record(scale: float, value: float, main_value: float, terms: int) -> dict:
    """`backward.mtp_loss` (contract, docs/dumping.md): the MTP term's definition, its unscaled value, the scale and
    the loss the backward differentiated."""
    return {"loss": MTP_LOSS_NAME, "definition": MTP_LOSS_DEFINITION, "scale": float(scale), "mtp_layers": 1,
            "value": float(value), "terms": int(terms), "total": float(main_value + scale * value),
            "labels": "input_ids"}


def loss_record(value: float, terms: int, grad_dtype: str, stats_only: bool, mtp: dict | None = None) -> dict:
    """The root attr `backward` (contract). `value` / `terms`: the main next-token term; `mtp`: `mtp_loss_record`
    when the MTP loss is included (else null)."""
    return {"loss": LOSS_NAME, "definition": LOSS_DEFINITION, "value": float(value), "terms": int(terms),
            "mtp_loss": mtp, "grad_dtype": grad_dtype, "weights": "stats" if stats_only else "full"}


# ---------------------------------------------------------------------------------------------- no_grad methods
# Methods a runtime's eval forward runs under a `@torch.no_grad()` decorator although they carry the layer's
# computation: the official file's `moe_infer` (the routed experts' weighted sum, its eval path; its training path,
# `self.training`, is another computation and its KDA refuses prompts <= 64 tokens in training mode). Under --grads the
# decorator is lifted for the dump (the undecorated function, `__wrapped__`, runs the same arithmetic: forward bits
# unchanged, tested), so the routed experts and the router get their gradients.
NO_GRAD_METHODS = ("moe_infer",)


@contextmanager
def lift_no_grad_methods(model: torch.nn.Module) -> Iterator[list[str]]:
    """Replace each NO_GRAD_METHODS method of the model's module classes by its undecorated function while the block
    runs (class attributes, restored after); yields the `Class.method` names lifted."""
    undo, lifted = [], []
    for cls in {type(m) for m in model.modules()}:
        for name in NO_GRAD_METHODS:
            fn = cls.__dict__.get(name)
            inner = getattr(fn, "__wrapped__", None)
            if fn is not None and inner is not None:
                setattr(cls, name, inner)
                undo.append((cls, name, fn))
                lifted.append(f"{cls.__name__}.{name}")
    try:
        yield sorted(lifted)
    finally:
        for cls, name, fn in undo:
            setattr(cls, name, fn)


# ---------------------------------------------------------------------------------------------- weight names
def _layer_kinds(model) -> dict[int, str]:
    """Layer index -> "kda" / "mla" from the built-in's config (its `layer_types`)."""
    types = list(getattr(model.config, "layer_types", None) or [])
    return {i: ("mla" if t == "full_attention" else "kda") for i, t in enumerate(types)}


def native_to_hf(name: str, tensor: torch.Tensor, kinds: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    """A parameter (or its gradient) of transformers' built-in `bailing_hybrid` under the official checkpoint's
    name(s): the inverse of the built-in's load-time conversion (transformers conversion_mapping `bailing_hybrid`):
    embed_tokens -> word_embeddings, self_attn -> attention, forget_gate.{f_proj,A_log,dt_bias} -> attention.*, the
    merged depthwise conv1d [3P,1,W] -> q/k/v_conv1d (concatenated in that order), MLA o_proj -> dense, and the expert
    stacks gate_up_proj [E,2I,D] (gate rows first) / down_proj [E,D,I] -> experts.{e}.{gate,up,down}_proj.weight."""
    if name == "model.embed_tokens.weight":
        return [("model.word_embeddings.weight", tensor)]
    if not name.startswith("model.layers."):
        return [(name, tensor)]
    parts = name.split(".")
    i = int(parts[2])
    rest = ".".join(parts[3:])
    pre = f"model.layers.{i}."
    if rest.startswith("self_attn."):
        sub = rest[len("self_attn."):]
        if sub == "conv1d.weight":
            q, k, v = tensor.chunk(3, dim=0)
            return [(pre + f"attention.{p}_conv1d.weight", t) for p, t in (("q", q), ("k", k), ("v", v))]
        if sub.startswith("forget_gate."):
            sub = sub[len("forget_gate."):]
        if sub.startswith("o_proj.") and kinds.get(i) == "mla":
            sub = "dense." + sub[len("o_proj."):]
        return [(pre + "attention." + sub, tensor)]
    if rest == "mlp.experts.gate_up_proj":
        inter = tensor.shape[1] // 2
        out = []
        for e in range(tensor.shape[0]):
            out += [(pre + f"mlp.experts.{e}.gate_proj.weight", tensor[e, :inter]),
                    (pre + f"mlp.experts.{e}.up_proj.weight", tensor[e, inter:])]
        return out
    if rest == "mlp.experts.down_proj":
        return [(pre + f"mlp.experts.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def hf_param_grads(model: torch.nn.Module, map_name: str) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(HF name, parameter, its gradient — zeros where autograd gave none, e.g. an expert no token was routed to) for
    every trainable parameter of the model (the built-in's renamed / merged ones under the official names)."""
    kinds = _layer_kinds(model) if map_name == "native" else {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if map_name == "native":
            for hf, t in native_to_hf(name, g, kinds):
                yield hf, p, t
        else:
            yield name, p, g


def grad_point(hf_name: str, n_layers: int, mtp: bool = False) -> Point | MtpPoint | None:
    """The backward point of a weight gradient. An MTP layer's parameter (model.layers.{N+j}) has one only with `mtp`
    (the MTP loss included): `MtpPoint("backward", 0, j, "grad.<name relative to the layer>")`; else None (not
    dumped: off the loss's path)."""
    if hf_name.startswith("model.layers."):
        parts = hf_name.split(".")
        i = int(parts[2])
        site = "grad." + ".".join(parts[3:])
        if i >= n_layers:
            return MtpPoint("backward", 0, i - n_layers, site) if mtp else None
        return Point("backward", 0, i, site)
    return Point("backward", 0, None, "grad." + hf_name)


# ---------------------------------------------------------------------------------------------- cotangents
class CotangentRecorder:
    """Registers, for each tensor the forward capture emits in the prefill, a hook that hands its gradient to `sink`
    as the backward point of the same site (canonical shape and top-k order, as the forward point). Install with
    `attach(capture)` before the prefill forward; `unavailable()` after the backward says which sites got none.
    `mtp`: the MTP loss is included, so the MTP layers' sites get backward points too (`MtpPoint`); else they are
    off the loss's path and ignored."""

    def __init__(self, cap: Capture, sink: Callable[[Point | MtpPoint, np.ndarray, dict], None],
                 mtp: bool = False) -> None:
        self.cap, self.sink, self.mtp = cap, sink, mtp
        self.n = cap.cfg.num_hidden_layers
        self.watched: dict[Point | MtpPoint, str] = {}  # point -> module (a hook registered)
        self.refused: dict[Point | MtpPoint, str] = {}  # point -> reason (no hook: the value does not require grad)
        self.arrived: set[Point | MtpPoint] = set()
        self.handles: list = []
        self._observing = False

    def attach(self) -> "CotangentRecorder":
        self.cap.grad_watch = self.watch
        return self

    def detach(self) -> None:
        self.cap.grad_watch = None
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._observing:
            from parity.torch_ref import fla_cpu

            fla_cpu.set_kda_observer(None)
            self._observing = False

    def observe_kernel_gate(self, model: torch.nn.Module) -> None:
        """The twin under the fla stand-ins: its `tap_gate` holds a gate it computes for observation only — the
        kernel recomputes the gate from f_proj's output (use_gate_in_kernel) and uses that copy. The cotangent of
        `attention.gate` is read from the stand-in's own gate (its KDA observer, parity/torch_ref/fla_cpu.py)."""
        from parity.torch_ref import fla_cpu

        if not fla_cpu.is_installed() or fla_cpu.get_kda_observer() is not None:
            return
        current: list[int | None] = [None]
        for i, layer in enumerate(getattr(model.model, "layers", [])[: self.n]):
            attn = getattr(layer, "attention", None)
            if attn is not None and i in self.cap.layers and self.cap.cfg.layer_kind(i) == "kda":
                def enter(_m, _a, i=i):
                    current[0] = i

                def leave(_m, _a, _o):
                    current[0] = None
                self.handles += [attn.register_forward_pre_hook(enter), attn.register_forward_hook(leave)]

        def observe(d: dict) -> None:
            i, gate = current[0], d.get("gate")
            if i is None or self.cap.phase != "prefill" or not isinstance(gate, torch.Tensor) \
                    or not gate.requires_grad:
                return
            point = Point("backward", 0, i, "attention.gate")
            if point not in self.watched or point in self.arrived:
                return  # the site is not dumped (--layers / --sites)
            module = "fla_cpu:gate (the stand-in kernel's own gate)"
            self.watched[point] = module
            self.handles.append(gate.register_hook(lambda g: self._arrive(point, g, module, "output")))

        fla_cpu.set_kda_observer(observe)
        self._observing = True

    def watch(self, layer: int | None, site: str, t: torch.Tensor, *, module: str, io: str) -> None:
        mtp_layer = layer is not None and layer >= self.n
        if mtp_layer and not self.mtp:
            return  # an MTP layer without the MTP loss: off the loss's path, no backward points (contract)
        if site == "logits" and (layer is None or mtp_layer):
            return  # dL/dlogits is taken on the loss's own fp32 logits (`watch_logits`, `watch_mtp_logits`)
        point = MtpPoint("backward", 0, layer - self.n, site) if mtp_layer else Point("backward", 0, layer, site)
        if point in self.watched or point in self.refused:
            raise ParityError(f"{self.cap.map_name} runtime: {point.key()} emitted twice in one prefill")
        if layer is not None:
            module = module.replace("{i}", str(layer))
        if site in NO_COTANGENT:
            self.refused[point] = NO_COTANGENT[site]
            return
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            why = NO_GRAD_DERIVED if "->" in module else NO_GRAD_VALUE
            self.refused[point] = why.format(module=module)
            return
        self.watched[point] = module

        def hook(g: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
            self._arrive(point, g, module, io)

        self.handles.append(t.register_hook(hook))

    def watch_logits(self, logits: torch.Tensor) -> None:
        """dL/dlogits [B,T,V] fp32 on the tensor the loss reads (`next_token_ce`'s fp32 logits)."""
        point = Point("backward", 0, None, "logits")
        self.watched[point] = "loss input (fp32 logits)"
        self.handles.append(logits.register_hook(lambda g: self._arrive(point, g, "loss input (fp32 logits)",
                                                                           "output")))

    def watch_mtp_logits(self, j: int, logits: torch.Tensor) -> None:
        """dL/d mtp_logits [B,T,V] fp32 of MTP layer j on the tensor the MTP term reads (`mtp_ce`'s fp32 logits)."""
        point = MtpPoint("backward", 0, j, "logits")
        module = "MTP loss input (fp32 MTP logits)"
        self.watched[point] = module
        self.handles.append(logits.register_hook(lambda g: self._arrive(point, g, module, "output")))

    def watch_mtp_hidden(self, model: torch.nn.Module, j: int) -> None:
        """`hnorm:in` of MTP layer j: dL/d(hnorm's input) through hnorm alone — the MTP layer's share of the
        cotangent of the hidden state it is fed (the main stack's after model.norm, one tensor that the LM head reads
        too, so a hook on that tensor gives only the sum). Read with a full backward hook on the hnorm module, whose
        `grad_input` is exactly that share (torch wraps the module's input and output in identity autograd nodes: the
        forward's values are unchanged)."""
        i = self.n + j
        point = MtpPoint("backward", 0, j, "hnorm:in")
        if not self.cap.wants(i, "hnorm:in"):
            return
        mods = dict(model.named_modules())
        hnorm = mods.get(f"model.layers.{i}.hnorm")
        if hnorm is None:
            self.refused[point] = f"the {self.cap.map_name} runtime has no module model.layers.{i}.hnorm"
            return
        module = f"model.layers.{i}.hnorm (input, through hnorm alone)"
        self.watched[point] = module

        def hook(_m, grad_input, _grad_output):  # returns None: the gradient flows on unchanged
            if grad_input and isinstance(grad_input[0], torch.Tensor):
                self._arrive(point, grad_input[0], module, "input")

        self.handles.append(hnorm.register_full_backward_hook(hook))

    def _arrive(self, point: Point | MtpPoint, g: torch.Tensor, module: str, io: str) -> None:
        if point in self.arrived:
            raise ParityError(f"{self.cap.map_name} runtime: the cotangent of {point.key()} arrived twice")
        self.arrived.add(point)
        arr, shape_names = self.cap.canonical(point, to_numpy(g), module=module)
        if point.site == "mlp.gate.topk_weight":
            fwd = (MtpPoint("prefill", 0, point.mtp, "mlp.gate.topk") if isinstance(point, MtpPoint)
                   else Point("prefill", 0, point.layer, "mlp.gate.topk"))
            order = self.cap.topk_order.get(fwd)
            if order is None:
                raise ParityError(f"{point.key()}: the forward's canonical top-k order of {fwd.key()} is unknown (its "
                                  "topk_idx was not captured)")
            arr = np.take_along_axis(arr, order, -1)
            shape_names = "B,T,K"
        self.sink(point, arr, {"module": f"d loss / d {module}", "io": io, "shape_names": shape_names})

    def unavailable(self) -> dict[str, str]:
        """`backward/L03/<site>` (`backward/MTP0/<site>`) -> reason, for the sites seen in the forward that got no
        cotangent."""
        out = {p.key(): r for p, r in self.refused.items()}
        for p, module in self.watched.items():
            if p not in self.arrived:
                out[p.key()] = OFF_PATH.format(module=module)
        return out
