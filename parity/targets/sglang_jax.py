"""`sglang_jax`: an adapter for sglang-jax's Ling3 port (`sgl_jax/srt/models/bailing_moe_v3.py`, pull request #1394,
head 35f80afd) as a target (DESIGN §7, protocol v2). Import-guarded: without `sgl_jax` installed the target is
unavailable with one line saying how to install it (README "Testing your port").

What it runs is the port's own code, on CPU: the port's loader reads a trimmed copy of the checkpoint directory, each
decoder layer (`BailingMoeV3DecoderLayer`) is called on a packed `ForwardBatch` with the port's own memory pools and
attention backends, and every canonical site is read through taps (`TAP_MAP`) — no port source is edited or copied.
The backends are the ones the port's model runner picks on CPU: `native` full attention (its `fa`/`fa_mha` fall back
to it on CPU, so MLA runs non-absorbed over an MHA KV pool), the `KDAAttnBackend` (Pallas `chunk_kda` for prefill —
in interpret mode, `PALLAS_INTERPRET=1` — and `naive_recurrent_kda` for decode), and the `epmoe` MoE backend
(megablox `gmm` v1, interpret mode off TPU). CPU workarounds live here, each commented where it is applied.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from parity.targets.base import LayerResult, Target, describe_jax
from parity.targets.serving import PackedBatch, canonical_topk, to_canonical
from parity.targets.taps import ROUTER_SCORES, Tap, TapSet, Transform

INSTALL_HINT = ("sglang-jax is not installed: in a separate venv, pip install jax==0.10.2 flax==0.12.4 "
                "transformers==5.23.0 h5py safetensors pyzmq fastapi orjson partial_json_parser, then the port's "
                "python/ package with --no-deps --ignore-requires-python (README 'Testing your port')")
PR_COMMIT = "35f80afda6312370f25667c3838ccf32d09c2592"
DECODE_ROOM = 128  # KV-pool tokens per sequence beyond the prompt (the dump's decode steps must fit)

_KDA_BACKEND = "sgl_jax.srt.layers.attention.linear.kda_backend"
_KDA_KERNEL = "sgl_jax.srt.kernels.kda.kda"
_DSV3 = "sgl_jax.srt.models.deepseek_v3"


# ------------------------------------------------------------------------------------------ transforms
def _inverse_chunk_cumsum(v, ctx):
    """The port computes the KDA gate inside `chunk_kda` (`use_gate_in_kernel=True`) and exposes only its chunk-local
    cumulative sum in log2 units (`kda_gate_chunk_cumsum(..., scale=1/ln 2)`, chunks of 64, packed [1,T_pad,H,K]).
    Differencing within each chunk and multiplying by ln 2 gives back the per-token gate."""
    c = np.asarray(v, np.float64)[0, :ctx["tokens"]]
    g = c.copy()
    pos = np.arange(c.shape[0])
    inner = pos % ctx["chunk"] != 0
    g[inner] = c[inner] - c[np.flatnonzero(inner) - 1]
    return (g * np.log(2.0)).astype(np.float32)


PREFILL_GATE = Transform(
    "inverse_chunk_cumsum",
    "KDA gate recovered from the kernel's chunk-local cumsum (log2 units, chunk 64) by differencing; the "
    "differencing adds ~1e-5 relative error on fp32 dumps", test=_inverse_chunk_cumsum)


def _ssm_rows(v, ctx):
    return np.asarray(v[0])[ctx["slots"]]  # the recurrent pool [slots,H,K,V] -> this batch's rows (slot 0 reserved)


def _conv_rows(v, ctx):
    conv = np.asarray(v[1][0])[ctx["slots"]]  # packed [B, 3P, W-1] (q,k,v stacked on the channel axis)
    B, P3, W1 = conv.shape
    return np.moveaxis(conv.reshape(B, 3, P3 // 3, W1), 1, 0)  # -> [3,B,P,W-1]


SSM_POOL = Transform("ssm_pool_rows", "KDA state read from the port's recurrent-state pool (this batch's slots)",
                     test=_ssm_rows)
CONV_POOL = Transform(
    "conv_pool_rows_last_w_minus_1",
    "conv state: the port keeps the last W-1 = 3 inputs (vLLM convention), the dump fla's last W = 4 (facts §3.11); "
    "the 3 most recent inputs are compared", test=_conv_rows, ref=lambda r: np.asarray(r)[..., 1:])


# ------------------------------------------------------------------------------------------ the tap map
def tap_map(kind: str, moe: bool, q_lora: bool) -> list[Tap]:
    """Canonical site <- path below `model.layers[i]` (BailingMoeV3DecoderLayer) or port function."""
    t = [Tap("input_layernorm", module="input_layernorm"), Tap("attention", module="self_attn", take="out[0]"),
         Tap("post_attention_layernorm", module="post_attention_layernorm"),
         Tap("mlp", module="", take="out[0]")]  # the layer returns (mlp output, residual, state, topk)
    if kind == "kda":
        t += [Tap(f"attention.{n}_proj", module=f"self_attn.{n}_proj", take="out[0]") for n in "qkv"]
        # prefill: the conv runs in `_short_conv_extend`; decode: `short_convolution` directly (q, k, v in order)
        t += [Tap(f"attention.{n}_conv1d", function=f"{_KDA_BACKEND}:KDAAttnBackend._short_conv_extend",
                  take="out[0]", call=j, phases=("prefill",)) for j, n in enumerate("qkv")]
        t += [Tap(f"attention.{n}_conv1d", function=f"{_KDA_BACKEND}:short_convolution", take="out[0]", call=j,
                  phases=("decode",)) for j, n in enumerate("qkv")]
        t += [Tap("attention.f_proj", module="self_attn.f_a_proj", take="out[0]"),
              Tap("attention.gate", function=f"{_KDA_KERNEL}:kda_gate_chunk_cumsum", transform=PREFILL_GATE,
                  phases=("prefill",)),
              Tap("attention.gate", function=f"{_KDA_BACKEND}:KDAAttnBackend._fused_kda_gate", phases=("decode",)),
              Tap("attention.b_proj", module="self_attn.b_proj", take="out[0]"),
              Tap("attention.beta", module="self_attn.attn", take="in[b]"),
              Tap("attention.core", module="self_attn.attn", take="out[0]"),
              Tap("attention.g_proj", module="self_attn.g_a_proj", take="out[0]"),
              Tap("attention.o_norm", module="self_attn.o_proj", take="in[0]"),
              Tap("attention.o_proj", module="self_attn.o_proj", take="out[0]"),
              Tap("attention.state", module="self_attn.attn", take="out[1]", transform=SSM_POOL),
              Tap("attention.conv_state", module="self_attn.attn", take="out[1]", transform=CONV_POOL)]
    else:
        if q_lora:
            t += [Tap("attention.q_a_proj", module="self_attn.q_a_proj", take="out[0]"),
                  Tap("attention.q_a_layernorm", module="self_attn.q_a_layernorm"),
                  Tap("attention.q_b_proj", module="self_attn.q_b_proj", take="out[0]")]
        else:
            t += [Tap("attention.q_proj", module="self_attn.q_proj", take="out[0]")]
        t += [Tap("attention.kv_a_proj_with_mqa", module="self_attn.kv_a_proj", take="out[0]"),
              Tap("attention.kv_a_layernorm", module="self_attn.kv_a_layernorm"),
              Tap("attention.kv_b_proj", module="self_attn.kv_b_proj", take="out[0]"),
              # non-absorbed path: per-head attention output before the head gate
              Tap("attention.core", function=f"{_DSV3}:DeepseekV3Attention._forward_mha", take="out[0]"),
              Tap("attention.g_proj", module="self_attn.g_proj", take="out[0]"),
              Tap("attention.dense:in", module="self_attn.o_proj", take="in[0]"),
              Tap("attention.dense", module="self_attn.o_proj", take="out[0]")]
    if moe:
        t += [Tap("mlp.gate.logits", module="moe_gate", transform=ROUTER_SCORES),
              Tap("mlp.gate.topk_weight", module="topk", take="out[0]"),
              Tap("mlp.gate.topk_idx", module="topk", take="out[1]"),
              Tap("mlp.routed", module="mlp"),
              Tap("mlp.shared_experts", module="shared_experts")]
    else:
        t += [Tap(f"mlp.{n}", module=f"mlp.{n}", take="out[0]") for n in ("gate_proj", "up_proj", "down_proj")]
    return t


# Sites the port computes only inline (no module, function or argument carries them), with the reason.
UNTAPPABLE = {"mla": {"attention.gate": "the port applies sigmoid(g_proj) inline in DeepseekV3Attention.__call__ "
                                        "(no module, function or argument holds the gate)"}}


# ------------------------------------------------------------------------------------------ CPU workarounds
def _install_cpu_workarounds() -> list[str]:
    """Patches the port needs to run its TPU kernels on CPU; returns what was applied (for describe())."""
    import jax
    import jax.numpy as jnp

    import sgl_jax.srt.layers.moe as moe

    done = []
    # Pallas kernels (chunk_kda) read PALLAS_INTERPRET at call time: interpret mode is the only way they run on CPU.
    if jax.default_backend() != "tpu":
        os.environ.setdefault("PALLAS_INTERPRET", "1")
        done.append("PALLAS_INTERPRET=1 (chunk_kda Pallas kernels interpreted)")
    # megablox gmm in interpret mode does not pad the row count m to its 128-row tile (the TPU path does, and the
    # v1 kernel then raises "m must be divisible by x-dimension tile size"): pad the rows with zeros into the last
    # group and slice the result back, as the backend's own TPU branch does.
    if not getattr(moe.gmm, "_parity_padded", False):
        orig = moe.gmm

        def gmm_padded(lhs, rhs, group_sizes, **kw):
            m = lhs.shape[0]
            pad = (-m) % 128
            if pad:
                lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
                group_sizes = group_sizes.at[-1].add(pad)
            return orig(lhs, rhs, group_sizes, **kw)[:m]

        gmm_padded._parity_padded = True
        moe.gmm = gmm_padded
        done.append("megablox gmm: rows padded to the 128 tile and sliced back (interpret mode does not pad)")
    return done


class _NativeSliced:
    """The MHA KV pool stores each head padded to 128 lanes (`merge_kv` aligns the head dim), so the native
    backend pads q to 128 and returns [T, H*128]; the port's `_forward_mha` expects [T, H*qk_head_dim]. Slice the
    attention output back to q's head dim (the padded lanes are zero in q, k and v, so nothing is lost)."""

    def __init__(self, backend, num_heads: int) -> None:
        self._b, self._h = backend, num_heads

    def __getattr__(self, name):
        return getattr(self._b, name)

    def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool, **kw):
        out, kv = self._b(q, k, v, layer, forward_batch, token_to_kv_pool, **kw)
        T = out.shape[0]
        return out.reshape(T, self._h, -1)[:, :, :q.shape[-1]].reshape(T, -1), kv


# ------------------------------------------------------------------------------------------ the target
class SglangJaxTarget(Target):
    name = "sglang_jax"
    capabilities = frozenset({"q_lora", "kda_chunked", "kda_recurrent", "decode"})
    needs_checkpoint_dir = True

    def __init__(self) -> None:
        self.model = None
        self.ckpt_dir = None
        self._taps: dict[tuple, TapSet] = {}
        self.workarounds: list[str] = []

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import sgl_jax.srt.models.bailing_moe_v3  # noqa: F401
        except ImportError as e:
            return False, f"{INSTALL_HINT} ({e})"
        return True, ""

    def build(self, config, dtype: str, mesh=None) -> None:
        from parity.jax_ling3.spec import dtype_name, dtype_of

        if mesh is not None:
            raise ValueError("sglang_jax target: the suite's mesh does not map onto the port's data/tensor mesh; "
                             "run without --parity-mesh")
        self.cfg, self.dtype = config, dtype_name(dtype_of(dtype))
        self.workarounds = _install_cpu_workarounds()

    def use_checkpoint_dir(self, path, layers=None) -> None:
        """The port's loader (`WeightLoader`) reads a checkpoint directory through its `ModelConfig`; it is given a
        copy without `auto_map` (transformers would try to import the official remote code, which needs fla). All
        layers are kept: the port's MoE loader raises on any layer whose experts are absent, so `layers` cannot trim
        it (the port builds every layer; fine at tiny shapes)."""
        import jax
        import jax.numpy as jnp

        from sgl_jax.srt.configs.model_config import ModelConfig
        from sgl_jax.srt.models.bailing_moe_v3 import BailingMoeV3ForCausalLM
        from sgl_jax.srt.utils.mesh_utils import create_device_mesh

        from parity.targets.ckptdir import layer_checkpoint

        self._tmp = tempfile.TemporaryDirectory(prefix="parity-sglj-")
        self.ckpt_dir = str(path)
        # fp32 dumps: the port's loader cannot cast the stacked bf16 MoE weights to an fp32 model under jax 0.10
        # (`astype` on the expert mesh inside the data/tensor mesh context raises); the copy holds the bf16
        # weights widened to fp32 (exact), so nothing needs casting.
        widen = self.dtype == "float32"
        if widen:
            self.workarounds.append("fp32: checkpoint copy with bf16 weights widened to fp32 (the port's MoE loader "
                                    "cannot cast bf16 to an fp32 model under jax 0.10 explicit meshes)")
        trimmed = layer_checkpoint(path, self._tmp.name, None, widen_bf16=widen)
        self.mesh = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1])
        self.jdtype = jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32
        mc = ModelConfig(str(trimmed), trust_remote_code=False, dtype=self.dtype, moe_backend="epmoe")
        hf = mc.hf_config
        hf.use_absorbed_mla = False  # what the port's model runner sets for its CPU `native` attention backend
        hf.moe_backend, hf.ep_size = mc.moe_backend.value, 1
        with jax.set_mesh(self.mesh):
            self.model = BailingMoeV3ForCausalLM(hf, self.mesh, dtype=self.jdtype)
            self.model.load_weights(mc)
        self.hf = hf
        self.mc = mc
        for i in range(self.cfg.num_hidden_layers):  # every function patch in place before the port's first trace
            self.taps(i)

    def describe(self) -> dict:
        import importlib.metadata as md

        def ver(p):
            try:
                return md.version(p)
            except md.PackageNotFoundError:
                return None

        return describe_jax(
            self.name, port="sgl_jax/srt/models/bailing_moe_v3.py (sgl-project/sglang-jax PR #1394)",
            port_version=ver("sglang-jax"), flax=ver("flax"), pr_head=PR_COMMIT,
            backends={"full_attention": "NativeAttention (the port's CPU fallback for fa/fa_mha); MLA non-absorbed "
                                        "(use_absorbed_mla=False) over an MHA KV pool, head dim padded to 128",
                      "linear_attention": "KDAAttnBackend: chunk_kda Pallas kernel (prefill), naive_recurrent_kda "
                                          "(decode)",
                      "moe": "epmoe (EPMoE, megablox gmm v1)"},
            interpret_mode={"PALLAS_INTERPRET": os.environ.get("PALLAS_INTERPRET", "")},
            workarounds=self.workarounds, checkpoint_dir=self.ckpt_dir)

    def taps(self, i: int) -> TapSet:
        key = (self.cfg.layer_kind(i), self.cfg.is_moe(i), self.cfg.q_lora)
        if key not in self._taps:
            self._taps[key] = TapSet(tap_map(*key)).install()
        return self._taps[key]

    def load_globals(self, hf_tensors) -> None:
        self._glob = hf_tensors

    def load_layer(self, i: int, hf_tensors) -> None:
        if self.model is None:
            raise RuntimeError("sglang_jax target: use_checkpoint_dir() was not called (the port loads from disk)")

    def embed(self, input_ids):
        import jax

        with jax.set_mesh(self.mesh):
            return np.asarray(self.model.model.embed_tokens(np.asarray(input_ids).reshape(-1))).reshape(
                *np.asarray(input_ids).shape, -1)

    def head(self, hidden):
        """Final norm and LM head of the port (the logits processor only gathers last tokens; the head matmul is
        the port's `lm_head` weight applied in the model dtype, then fp32 as the dump stores it)."""
        import jax
        import jax.numpy as jnp

        h = np.asarray(hidden)
        B, T, D = h.shape
        with jax.set_mesh(self.mesh):
            x = self.model.model.norm(jnp.asarray(h.reshape(B * T, D), self.jdtype))
            w = self.model.lm_head.embedding.value
            logits = jnp.dot(x, w.T.astype(x.dtype)).astype(jnp.float32)
        return {"final_norm": np.asarray(x).reshape(B, T, D), "logits": np.asarray(logits).reshape(B, T, -1)}

    # ------------------------------------------------------------------ one layer call
    def _pools(self, B: int, capacity: int):
        import jax

        from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sgl_jax.srt.mem_cache.recurrent_state_pool import RecurrentStatePool

        hf, cfg = self.hf, self.cfg
        kda = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"]
        with jax.set_mesh(self.mesh):
            rpool = RecurrentStatePool(linear_recurrent_layer_ids=kda, size=B, num_heads=cfg.num_attention_heads,
                                       head_dim=cfg.head_dim, conv_kernel_size=cfg.short_conv_kernel_size,
                                       mesh=self.mesh, temporal_dtype=jax.numpy.float32, conv_dtype=self.jdtype)
            # MHA pool for the non-absorbed MLA: K/V heads of qk_head_dim, stored padded to 128 (see _NativeSliced)
            qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
            kvpool = MHATokenToKVPool(size=B * capacity, page_size=1, dtype=self.jdtype,
                                      head_num=cfg.num_attention_heads, head_dim=-(-qk // 128) * 128,
                                      layer_num=cfg.num_hidden_layers, mesh=self.mesh)
        return rpool, kvpool

    def _forward_batch(self, pb: PackedBatch, backend, decode: bool):
        import jax

        from sgl_jax.srt.managers.schedule_batch import ModelWorkerBatch
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        B, N = pb.batch, pb.tokens
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        mwb = ModelWorkerBatch(
            bid=1, forward_mode=mode, input_ids=np.zeros(N, np.int32), real_input_ids_len=N,
            seq_lens=np.full(B, pb.prefix + pb.extend, np.int32), out_cache_loc=pb.out_loc,
            req_pool_indices=np.arange(B, dtype=np.int32), sampling_info=None, positions=pb.positions,
            cache_loc=pb.seq_loc.reshape(-1),
            extend_seq_lens=None if decode else np.full(B, pb.extend, np.int32),
            extend_prefix_lens=None if decode else np.full(B, pb.prefix, np.int32),
            return_logprob=False, return_output_logprob_only=False, top_logprobs_nums=None, token_ids_logprobs=None,
            extend_logprob_start_lens=None, extend_input_logprob_token_ids=None,
            logits_indices=pb.cu_seqlens[1:] - 1, real_bs=B, real_bs_per_dp=[B], dp_size=1, per_dp_bs_size=B,
            spec_info_padded=None, recurrent_indices=pb.slots, has_initial_state=np.full(B, pb.prefix > 0))
        runner = type("Runner", (), {"mesh": self.mesh, "attn_backend": backend, "model_config": type(
            "MC", (), {"is_embedding": False, "hf_config": type("HC", (), {"architectures": []})()})()})()
        with jax.set_mesh(self.mesh):
            fb = ForwardBatch.init_new(mwb, runner)
            fb.attn_backend.forward_metadata = backend.get_forward_metadata(mwb)
        return fb

    def _backend(self):
        from sgl_jax.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
        from sgl_jax.srt.layers.attention.linear.kda_backend import KDAAttnBackend
        from sgl_jax.srt.layers.attention.native_backend import NativeAttention

        H = self.cfg.num_attention_heads
        full = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.layer_kind(i) == "mla"]
        return HybridLinearAttnBackend(_NativeSliced(NativeAttention(H, H, self.mesh), H),
                                       KDAAttnBackend(mesh=self.mesh), full)

    def layer_forward(self, i: int, hidden, positions, state=None, forced_topk=None) -> LayerResult:
        import jax
        import jax.numpy as jnp

        from sgl_jax.srt.mem_cache.memory_pool import MemoryPools

        if forced_topk is not None:
            raise NotImplementedError("sglang_jax target: forced routing is not wired (capability absent)")
        hidden = np.asarray(hidden)
        B, T, D = hidden.shape
        if state is None:
            cap = T + DECODE_ROOM
            rpool, kvpool = self._pools(B, cap)
            prefix = 0
        else:
            rpool, kvpool, prefix, cap = state
        pb = PackedBatch.of(B, T, prefix=prefix, capacity=cap)
        decode = state is not None and T == 1
        fb = self._forward_batch(pb, self._backend(), decode)
        pools = MemoryPools(token_to_kv_pool=kvpool, recurrent_state_pool=rpool)
        layer = self.model.model.layers[i]
        taps = self.taps(i)
        phase = "decode" if decode else "prefill"  # a continued extend (chunked prefill) runs the prefill kernels
        with jax.set_mesh(self.mesh), taps.record(phase, {"slots": pb.slots, "tokens": pb.tokens, "chunk": 64}) as cap_:
            def run(h):
                with taps.bind(layer):
                    o, res, st, _topk = layer(fb.positions, h, fb, pools, None)
                return o, res, st

            # Under jit, as the port's model runner calls its model: the taps' callbacks are staged into the
            # computation (an eager debug callback inside the port's explicit-sharding shard_maps is unsupported).
            # The closure makes weights, batch and pools compile-time constants: one trace per call, fine at tiny
            # shapes.
            out, residual, attn_state = jax.jit(run)(jnp.asarray(pb.pack(hidden), self.jdtype))
            output = out + residual  # how the port's model forms the next layer's input (hidden += residual)
            jax.block_until_ready(output)
        # carry the port's updated pools to the next call of this layer
        if self.cfg.layer_kind(i) == "kda":
            idx = rpool.layers_mapping[i]
            rpool.recurrent_buffers[idx], rpool.conv_buffers[idx] = attn_state[0], attn_state[1]
        else:
            kvpool.kv_buffer[i] = attn_state
        pts = {}
        for site, v in cap_.points.items():
            v = np.asarray(v)
            pts[site] = pb.unpack(v) if v.ndim and v.shape[0] == pb.tokens else v
        if "mlp.gate.topk_idx" in pts:
            pts["mlp.gate.topk_idx"], pts["mlp.gate.topk_weight"] = canonical_topk(pts["mlp.gate.topk_idx"],
                                                                                     pts.get("mlp.gate.topk_weight"))
        pts["output"] = pb.unpack(np.asarray(output))
        pts["input"] = hidden
        pts = to_canonical(self.cfg, i, pts, B, T)
        missing = dict(cap_.missing)
        missing.update(UNTAPPABLE.get(self.cfg.layer_kind(i), {}))
        return LayerResult(pts["output"], pts, (rpool, kvpool, prefix + T, cap), transforms=cap_.transforms,
                           missing=missing)


__all__ = ["SglangJaxTarget", "tap_map", "INSTALL_HINT"]
