"""HF Ling3 checkpoint -> JAX params, one layer at a time (seed 000 §3.6, DESIGN §7, facts §7).

Mapping (seed §3.6): every Linear `[out, in] -> [in, out]`; conv `[P,1,W] -> [P,W]`; `A_log [H]` kept 1-D (facts §10.5);
`attention.g_proj` read by layer kind (KDA `[P,D]` element-wise gate vs MLA `[H,D]` head gate); MLA `dense` is the
output projection; per-expert weights stacked to `[E, ...]`; router weight and `expert_bias` kept fp32, as are
`A_log` and `dt_bias` (facts §8). Everything else takes the requested dtype.

Names accepted besides the official ones (so a checkpoint written by transformers' built-in `bailing_hybrid` loads):
- the built-in's runtime names (`model.embed_tokens`, `.self_attn.`, `forget_gate.{f_proj,A_log,dt_bias}`, concatenated
  `conv1d [3P,1,W]`, MLA `o_proj`, `e_score_correction_bias`, merged `experts.gate_up_proj [E,2I,D]` /
  `experts.down_proj [E,D,I]`), and
- what its `save_pretrained` actually writes (measured, transformers 5.23): official names, except that the reverse of
  its `dense -> o_proj` rename also renames the **KDA** `o_proj` to `attention.dense`.

MTP layers (`model.layers.{N+j}`, facts §2, §7): an MLA + MoE decoder block under the same names, plus `eh_proj [D, 2D]`
(-> [2D, D]), `enorm`, `hnorm`, `final_layernorm`; converted on demand by `convert_mtp` / `CheckpointReader.mtp_params`.

The whole index is checked once at open: every key must map to a parameter of its layer (by kind) — MTP layers'
keys to the MTP layer's parameters (`Ling3Config.mtp_key_prefixes()`); anything else raises `CheckpointError` naming
the keys (seed §3.6's *unmapped checkpoint keys ⊆ MTP skip list*, now with the MTP layer mapped too: raised, not
warned). Missing main-layer parameters raise at open; missing MTP parameters when the MTP layer is converted (a
checkpoint may lack its MTP layer, and the main stack replays without it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import ml_dtypes  # noqa: F401  (must be imported before safe_open(framework="numpy") meets bf16, env_notes)
import numpy as np
from safetensors import safe_open

from parity.model.config import LING3_ARCHITECTURE, Ling3Config
from parity.errors import CheckpointError, ConfigError

BUILTIN_ARCHITECTURE = "BailingHybridForCausalLM"
FP32_KEEP = ("attention.A_log", "attention.dt_bias", "mlp.gate.weight", "mlp.gate.expert_bias")  # facts §8

GLOBAL_KEYS = {"model.word_embeddings.weight": "model.word_embeddings.weight",
               "model.embed_tokens.weight": "model.word_embeddings.weight",
               "model.norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _np_dtype(dtype: str):
    if dtype in ("bfloat16", "bf16"):
        return ml_dtypes.bfloat16
    if dtype in ("float32", "fp32"):
        return np.float32
    raise ConfigError(f"dtype {dtype!r}: expected 'bfloat16' or 'float32'")


# ----------------------------------------------------------------------------------------- names
MTP_SUFFIXES = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight")  # facts §7


def expected_suffixes(cfg: Ling3Config, i: int) -> set[str]:
    """Official per-layer key suffixes (relative to `model.layers.{i}.`) of layer i (facts §7); i ≥ num_hidden_layers:
    an MTP layer (MLA + MoE block + MTP_SUFFIXES)."""
    s = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    if i >= cfg.num_hidden_layers:
        s |= set(MTP_SUFFIXES)
    if cfg.layer_kind(i) == "kda":
        s |= {f"attention.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj",
                                                 "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "o_proj")}
        s |= {"attention.A_log", "attention.dt_bias"}
    else:
        q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.q_lora else ("q_proj",)
        s |= {f"attention.{n}.weight" for n in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
                                                 "dense")}
    if cfg.is_moe(i):
        s |= {"mlp.gate.weight", "mlp.gate.expert_bias"}
        s |= {f"mlp.experts.{e}.{n}.weight" for e in range(cfg.num_experts) for n in ("gate_proj", "up_proj",
                                                                                     "down_proj")}
        if cfg.has_shared_expert:
            s |= {f"mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    else:
        s |= {f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return s


def canonical_suffixes(cfg: Ling3Config, i: int, suffix: str) -> tuple[str, ...]:
    """Official suffixes a checkpoint key suffix of layer i provides (several for merged tensors); () if unknown."""
    kind = cfg.layer_kind(i)
    s = suffix.replace("self_attn.", "attention.", 1) if suffix.startswith("self_attn.") else suffix
    s = s.replace("attention.forget_gate.", "attention.", 1)
    s = s.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")
    if kind == "kda":
        if s == "attention.dense.weight":  # built-in save_pretrained's reverse rename hits KDA o_proj too
            s = "attention.o_proj.weight"
        if s == "attention.conv1d.weight":
            return tuple(f"attention.{n}_conv1d.weight" for n in "qkv")
    elif s == "attention.o_proj.weight":  # MLA output projection: official `dense` (facts §4.7)
        s = "attention.dense.weight"
    if cfg.is_moe(i):
        E = cfg.num_experts
        if s == "mlp.experts.gate_up_proj":
            return tuple(f"mlp.experts.{e}.{n}.weight" for e in range(E) for n in ("gate_proj", "up_proj"))
        if s == "mlp.experts.down_proj":
            return tuple(f"mlp.experts.{e}.down_proj.weight" for e in range(E))
    return (s,) if s in expected_suffixes_cached(cfg, i) else ()


_EXPECTED_CACHE: dict[tuple[int, int], tuple[Ling3Config, set[str]]] = {}


def expected_suffixes_cached(cfg: Ling3Config, i: int) -> set[str]:
    hit = _EXPECTED_CACHE.get((id(cfg), i))
    if hit is None or hit[0] is not cfg:  # the config is kept in the entry, so its id cannot be reused
        hit = _EXPECTED_CACHE[(id(cfg), i)] = (cfg, expected_suffixes(cfg, i))
    return hit[1]


def check_keys(cfg: Ling3Config, keys, source: str) -> None:
    """Raise CheckpointError unless unmapped keys ⊆ MTP skip list and no parameter is missing (seed §3.6)."""
    mtp = tuple(cfg.mtp_key_prefixes())
    covered: dict[int, set[str]] = {i: set() for i in range(cfg.num_hidden_layers)}
    unmapped, globals_seen = [], set()
    for k in keys:
        if k in GLOBAL_KEYS:
            globals_seen.add(GLOBAL_KEYS[k])
            continue
        if k.startswith(mtp):
            m = _LAYER_RE.match(k)
            if m and canonical_suffixes(cfg, int(m.group(1)), m.group(2)):
                continue  # an MTP layer parameter (checked for completeness when it is converted)
            unmapped.append(k)
            continue
        m = _LAYER_RE.match(k)
        if m and int(m.group(1)) < cfg.num_hidden_layers:
            got = canonical_suffixes(cfg, int(m.group(1)), m.group(2))
            if got:
                covered[int(m.group(1))].update(got)
                continue
        unmapped.append(k)
    if unmapped:
        unmapped.sort()
        shown = ", ".join(unmapped[:20]) + (f", … ({len(unmapped)} in total)" if len(unmapped) > 20 else "")
        raise CheckpointError(
            f"{source}: unmapped checkpoint key(s): {shown} (expected only official Ling3 / built-in bailing_hybrid "
            f"parameter names, MTP layers {list(mtp)} included, facts §7)")
    missing = sorted({"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"} - globals_seen)
    for i, have in covered.items():
        missing += sorted(f"model.layers.{i}.{s}" for s in expected_suffixes_cached(cfg, i) - have)
    if missing:
        shown = ", ".join(missing[:20]) + (f", … ({len(missing)} in total)" if len(missing) > 20 else "")
        raise CheckpointError(f"{source}: missing checkpoint key(s) for {cfg.summary()}: {shown}")


# ----------------------------------------------------------------------------------------- conversion
def _t(a: np.ndarray, dt) -> np.ndarray:
    """Linear [out, in] -> [in, out] in dtype dt (contiguous copy)."""
    return np.ascontiguousarray(np.asarray(a).T.astype(dt, copy=False))


def _c(a: np.ndarray, dt) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).astype(dt, copy=False))


class _Canon:
    """Layer-i tensors addressed by official suffix, whatever naming the source mapping uses (lazy: reads on get)."""

    def __init__(self, cfg: Ling3Config, i: int, hf: Mapping[str, np.ndarray]):
        self.cfg, self.i, self.hf = cfg, i, hf
        self.prefix = f"model.layers.{i}."
        self.by_suffix: dict[str, str] = {}
        self._last: tuple[str, np.ndarray] | None = None  # merged built-in tensors serve many suffixes: read once
        for k in hf.keys():
            if k.startswith(self.prefix):
                for s in canonical_suffixes(cfg, i, k[len(self.prefix):]):
                    self.by_suffix.setdefault(s, k)

    def raw(self, suffix: str) -> tuple[str, np.ndarray]:
        key = self.by_suffix.get(suffix)
        if key is None:
            raise CheckpointError(f"layer {self.i}: checkpoint key 'model.layers.{self.i}.{suffix}' is missing")
        if self._last is None or self._last[0] != key:
            self._last = (key, self.hf[key])
        return self._last

    def get(self, suffix: str, shape: tuple[int, ...]) -> np.ndarray:
        """One official tensor; merged built-in tensors are sliced (conv1d, gate_up_proj, down_proj)."""
        key, a = self.raw(suffix)
        short = key[len(self.prefix):]
        if short.endswith("conv1d.weight") and not short.endswith(("q_conv1d.weight", "k_conv1d.weight",
                                                                    "v_conv1d.weight")):
            P = self.cfg.kda_proj_size
            j = "qkv".index(suffix.split(".")[1][0])
            a = np.asarray(a)[j * P:(j + 1) * P]
        elif short.endswith("experts.gate_up_proj") or short.endswith("experts.down_proj"):
            e, name = _EXPERT_RE.match(suffix).groups()
            a = np.asarray(a)[int(e)]
            if name != "down_proj":
                I = self.cfg.moe_intermediate_size
                a = a[:I] if name == "gate_proj" else a[I:]
        a = np.asarray(a)
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"layer {self.i}: checkpoint key '{key}' has shape {tuple(a.shape)}, expected "
                                  f"{tuple(shape)} for '{suffix}' ({self.cfg.layer_kind(self.i)} layer, facts §7)")
        return a


class _Sink(dict):
    """A dict that passes every stored array through `put` (e.g. jnp.asarray) as soon as it is produced, so the
    numpy copy can be freed before the next tensor is converted (peak ≈ one layer + one tensor)."""

    def __init__(self, put):
        super().__init__()
        self.put = put

    def __setitem__(self, k, v):
        super().__setitem__(k, v if isinstance(v, dict) or self.put is None else self.put(v))


def convert_layer(cfg: Ling3Config, i: int, hf_tensors: Mapping[str, np.ndarray], dtype: str, put=None) -> dict:
    """Pure: HF tensors of layer i (raw checkpoint names, official or built-in) -> JAX-layout numpy params:
    {"input_layernorm", "post_attention_layernorm", "attention": {...}, "mlp": {...}} (seed §3.6).
    Tensors are read from `hf_tensors` one at a time, so a lazy mapping streams; `put` (optional) is applied to each
    converted array as it is produced (e.g. `jnp.asarray` to move it to the device at once)."""
    dt = _np_dtype(dtype)
    src = _Canon(cfg, i, hf_tensors)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    lin = lambda s, o, n: _t(src.get(s, (o, n)), dt)  # noqa: E731  ckpt [out, in] -> [in, out]
    out, att, mlp = _Sink(put), _Sink(put), _Sink(put)
    out["input_layernorm"] = _c(src.get("input_layernorm.weight", (D,)), dt)
    out["post_attention_layernorm"] = _c(src.get("post_attention_layernorm.weight", (D,)), dt)
    if cfg.layer_kind(i) == "kda":
        P, d, W = cfg.kda_proj_size, cfg.head_dim, cfg.short_conv_kernel_size
        for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):  # g_proj: element-wise [P,D] here (§3.1)
            att[n] = lin(f"attention.{n}.weight", P, D)
        att["b_proj"] = lin("attention.b_proj.weight", H, D)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            att[n] = _c(src.get(f"attention.{n}.weight", (P, 1, W))[:, 0, :], dt)  # [P,1,W] -> [P,W]
        att["A_log"] = _c(src.get("attention.A_log", (H,)), np.float32)  # 1-D [H] (facts §10.5), fp32 (§8)
        att["dt_bias"] = _c(src.get("attention.dt_bias", (P,)), np.float32)
        att["o_norm"] = _c(src.get("attention.o_norm.weight", (d,)), dt)
        att["o_proj"] = lin("attention.o_proj.weight", D, P)
    else:
        qk, c, r = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if cfg.q_lora:
            att["q_a_proj"] = lin("attention.q_a_proj.weight", cfg.q_lora_rank, D)
            att["q_a_layernorm"] = _c(src.get("attention.q_a_layernorm.weight", (cfg.q_lora_rank,)), dt)
            att["q_b_proj"] = lin("attention.q_b_proj.weight", H * qk, cfg.q_lora_rank)
        else:
            att["q_proj"] = lin("attention.q_proj.weight", H * qk, D)
        att["kv_a_proj_with_mqa"] = lin("attention.kv_a_proj_with_mqa.weight", c + r, D)
        att["kv_a_layernorm"] = _c(src.get("attention.kv_a_layernorm.weight", (c,)), dt)
        att["kv_b_proj"] = lin("attention.kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), c)
        att["g_proj"] = lin("attention.g_proj.weight", H, D)  # head-wise gate [H,D] -> [D,H] (§4.6)
        att["dense"] = lin("attention.dense.weight", D, H * cfg.v_head_dim)  # MLA output projection (§4.7)
    out["attention"] = att
    if cfg.is_moe(i):
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        mlp["router"] = _t(src.get("mlp.gate.weight", (E, D)), np.float32)  # [E,D] -> [D,E], fp32 (seed §3.5)
        mlp["expert_bias"] = _c(src.get("mlp.gate.expert_bias", (E,)), np.float32)
        for n, shape, dst in (("gate_proj", (I, D), "experts_gate"), ("up_proj", (I, D), "experts_up"),
                              ("down_proj", (D, I), "experts_down")):
            stacked = np.empty((E, shape[1], shape[0]), dt)  # stacked [E, in, out], filled expert by expert
            for e in range(E):
                stacked[e] = np.asarray(src.get(f"mlp.experts.{e}.{n}.weight", shape)).T
            mlp[dst] = stacked
        if cfg.has_shared_expert:
            Is = cfg.shared_intermediate_size
            mlp["shared_gate_proj"] = lin("mlp.shared_experts.gate_proj.weight", Is, D)
            mlp["shared_up_proj"] = lin("mlp.shared_experts.up_proj.weight", Is, D)
            mlp["shared_down_proj"] = lin("mlp.shared_experts.down_proj.weight", D, Is)
    else:
        I = cfg.intermediate_size
        mlp["gate_proj"] = lin("mlp.gate_proj.weight", I, D)
        mlp["up_proj"] = lin("mlp.up_proj.weight", I, D)
        mlp["down_proj"] = lin("mlp.down_proj.weight", D, I)
    out["mlp"] = mlp
    return {k: dict(v) if isinstance(v, dict) else v for k, v in out.items()}


def convert_mtp(cfg: Ling3Config, j: int, hf_tensors: Mapping[str, np.ndarray], dtype: str, put=None) -> dict:
    """Pure: HF tensors of MTP layer j (`model.layers.{N+j}.*`) -> {"enorm", "hnorm", "final_layernorm" [D],
    "eh_proj" [2D, D] (input = [enorm(embedding) ; hnorm(hidden)], facts §2), "block": the MLA + MoE decoder block's
    params as `convert_layer` gives them}."""
    i = cfg.num_hidden_layers + j
    dt = _np_dtype(dtype)
    D = cfg.hidden_size
    src = _Canon(cfg, i, hf_tensors)
    put_ = put or (lambda a: a)
    out = {n: put_(_c(src.get(f"{n}.weight", (D,)), dt)) for n in ("enorm", "hnorm", "final_layernorm")}
    out["eh_proj"] = put_(_t(src.get("eh_proj.weight", (D, 2 * D)), dt))
    out["block"] = convert_layer(cfg, i, hf_tensors, dtype, put)
    return out


def convert_globals(cfg: Ling3Config, hf_tensors: Mapping[str, np.ndarray], dtype: str) -> dict:
    """Embedding [V,D] (no scaling), final norm [D], lm_head [V,D] -> [D,V] (facts §6)."""
    dt = _np_dtype(dtype)
    V, D = cfg.vocab_size, cfg.hidden_size
    canon = {GLOBAL_KEYS[k]: k for k in hf_tensors.keys() if k in GLOBAL_KEYS}

    def get(name, shape):
        if name not in canon:
            raise CheckpointError(f"checkpoint key '{name}' is missing")
        a = np.asarray(hf_tensors[canon[name]])
        if tuple(a.shape) != shape:
            raise CheckpointError(f"checkpoint key '{canon[name]}' has shape {tuple(a.shape)}, expected {shape}")
        return a

    return {"embed": _c(get("model.word_embeddings.weight", (V, D)), dt),
            "final_norm": _c(get("model.norm.weight", (D,)), dt),
            "lm_head": _t(get("lm_head.weight", (V, D)), dt)}


# ----------------------------------------------------------------------------------------- reader
def config_from_dict(d: dict, source: str) -> Ling3Config:
    """Ling3Config from an official config.json, or from one written by transformers' built-in `bailing_hybrid`
    (architectures BailingHybridForCausalLM; its `head_dim` is the rope dim and the KDA head size is
    `linear_head_dim`). The built-in's `layer_types` must agree with the Ling3 layout rule (facts §2)."""
    archs = d.get("architectures") or []
    if archs and archs[0] == BUILTIN_ARCHITECTURE:
        d = dict(d)
        d["architectures"] = [LING3_ARCHITECTURE]
        if "linear_head_dim" in d:
            d["head_dim"] = d["linear_head_dim"]
        layer_types = d.get("layer_types")
        for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "model_max_length",
                  "num_local_experts" if "num_experts" in d else "", "rope_parameters"):
            d.pop(k, None)
        cfg = Ling3Config.from_dict(d, source=source, strict=False)
        if layer_types is not None:
            want = ["full_attention" if k == "mla" else "linear_attention" for k in cfg.layer_kinds]
            if list(layer_types) != want:
                raise CheckpointError(f"{source}: layer_types {layer_types} disagree with the Ling3 layout {want} "
                                      "(facts §2)")
        return cfg
    return Ling3Config.from_dict(d, source=source)


class _LazyTensors(Mapping):
    """Read-on-access view of some checkpoint keys ({key: file}); nothing is kept after a read."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def __getitem__(self, key: str) -> np.ndarray:
        path = self.files[key]
        try:
            with safe_open(str(path), framework="numpy") as f:
                return f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types on truncated files
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({e})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def read_all(self) -> dict[str, np.ndarray]:
        """Every key, each shard opened once (opening one parses its header: ~0.4 ms a tensor when done per key)."""
        by_file: dict[Path, list[str]] = {}
        for k, path in self.files.items():
            by_file.setdefault(path, []).append(k)
        out = {}
        for path, keys in by_file.items():
            try:
                f = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types on truncated files
                raise CheckpointError(f"{path}: cannot read tensor '{keys[0]}' ({e})") from None
            with f:
                for k in keys:
                    try:
                        out[k] = f.get_tensor(k)
                    except Exception as e:
                        raise CheckpointError(f"{path}: cannot read tensor '{k}' ({e})") from None
        return {k: out[k] for k in self.files}  # the index's key order, as before


class CheckpointReader:
    """Lazy reader of an HF Ling3 checkpoint directory (sharded with `model.safetensors.index.json`, or plain
    `*.safetensors`). Only headers are read at open (key check of the whole index, seed §3.6); tensors are read per
    layer on demand. `config` overrides the directory's config.json."""

    def __init__(self, ckpt_dir: str | Path, config: Ling3Config | dict | None = None):
        self.dir = Path(ckpt_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a checkpoint directory")
        if isinstance(config, Ling3Config):
            self.config = config
        else:
            if config is None:
                path = self.dir / "config.json"
                try:
                    config = json.loads(path.read_text())
                except OSError as e:
                    raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
            self.config = config_from_dict(config, str(self.dir / "config.json"))
        self.key_files = self._index()
        check_keys(self.config, self.key_files, str(self.dir))
        self._by_layer: dict[int, list[str]] = {}
        for k in self.key_files:
            m = _LAYER_RE.match(k)
            if m:
                self._by_layer.setdefault(int(m.group(1)), []).append(k)

    def _index(self) -> dict[str, Path]:
        idx = self.dir / "model.safetensors.index.json"
        if idx.exists():
            try:
                wm = json.loads(idx.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{idx}: not a safetensors index with a 'weight_map' ({e})") from None
            files = {k: self.dir / v for k, v in wm.items()}
            for p in set(files.values()):
                if not p.exists():
                    raise CheckpointError(f"{idx}: names shard '{p.name}', which does not exist in {self.dir}")
            return files
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.dir}: no model.safetensors.index.json and no *.safetensors file")
        files: dict[str, Path] = {}
        for p in shards:
            try:
                with safe_open(str(p), framework="numpy") as f:
                    for k in f.keys():
                        files[k] = p
            except Exception as e:
                raise CheckpointError(f"{p}: not a readable safetensors file ({e})") from None
        return files

    # -- raw access (HF names and shapes), for the target protocol's load_layer / load_globals
    def lazy_tensors(self, i: int) -> Mapping[str, np.ndarray]:
        if not 0 <= i < self.config.num_hidden_layers:
            raise CheckpointError(f"{self.dir}: layer {i} out of range 0..{self.config.num_hidden_layers - 1}")
        return _LazyTensors({k: self.key_files[k] for k in self._by_layer.get(i, [])})

    def mtp_lazy_tensors(self, j: int) -> Mapping[str, np.ndarray]:
        """MTP layer j's tensors (`model.layers.{N+j}.*`), raw names, read on access."""
        n = max(1, self.config.num_nextn_predict_layers)
        if not 0 <= j < n:
            raise CheckpointError(f"{self.dir}: MTP layer {j} out of range 0..{n - 1}")
        return _LazyTensors({k: self.key_files[k] for k in self._by_layer.get(self.config.num_hidden_layers + j, [])})

    def has_mtp(self, j: int = 0) -> bool:
        """Whether the checkpoint holds MTP layer j's keys."""
        return bool(self._by_layer.get(self.config.num_hidden_layers + j))

    def mtp_params(self, j: int, dtype: str, put=None) -> dict:
        """MTP layer j's params (`convert_mtp`); CheckpointError naming the first missing key."""
        return convert_mtp(self.config, j, self.mtp_lazy_tensors(j), dtype, put)

    def hf_tensors(self, i: int) -> dict[str, np.ndarray]:
        """All `model.layers.{i}.*` tensors, raw names -> numpy (bf16 as ml_dtypes.bfloat16)."""
        return self.lazy_tensors(i).read_all()

    def mtp_hf_tensors(self, j: int) -> dict[str, np.ndarray]:
        """All `model.layers.{N+j}.*` tensors of MTP layer j, raw names -> numpy."""
        return self.mtp_lazy_tensors(j).read_all()

    def hf_global_tensors(self) -> dict[str, np.ndarray]:
        return _LazyTensors({k: p for k, p in self.key_files.items() if k in GLOBAL_KEYS}).read_all()

    # -- converted params (JAX layout, numpy arrays; put on device with jnp.asarray / sharding.place)
    def layer_params(self, i: int, dtype: str, put=None) -> dict:
        """Layer i's params, streamed tensor by tensor; with `put=jnp.asarray` each array goes to the device as soon
        as it is converted (peak ≈ one layer's weights + one tensor)."""
        return convert_layer(self.config, i, self.lazy_tensors(i), dtype, put)

    def global_params(self, dtype: str) -> dict:
        return convert_globals(self.config, self.hf_global_tensors(), dtype)


# ----------------------------------------------------------------------------------------- JAX layout -> HF layout
def to_hf_layout(cfg: Ling3Config, i: int, p: Mapping, experts_hf: bool = False) -> dict[str, np.ndarray]:
    """The inverse of `convert_layer`'s layout mapping: layer-i params in the JAX layout (or anything of the same
    structure and shapes, e.g. their gradients) -> {official suffix relative to `model.layers.{i}.`: array in the HF
    shape}, dtypes kept. Used for weight gradients under HF names (issue 26): every step of the forward mapping is a
    pure re-layout (transpose, drop of a unit axis, stacking), whose VJP is the inverse re-layout, so the gradient of
    an HF tensor is the JAX-layout gradient mapped back. `convert_layer(to_hf_layout(p))` gives p back
    (tests/test_backward_replay.py). `experts_hf`: p's routed-expert stacks are in the HF layout [E, out, in]
    already (`jax_ling3.backward.experts_to_hf`), each expert's matrix is a view of them. A leaf None (a gradient
    not computed, e.g. of a weight an isolated site does not read) gives no entry."""
    out: dict[str, np.ndarray] = {}

    def put(name: str, a, how=np.asarray) -> None:
        if a is not None:
            out[name] = how(a)

    T = lambda a: np.ascontiguousarray(np.asarray(a).T)  # noqa: E731  [in, out] -> [out, in]
    put("input_layernorm.weight", p["input_layernorm"])
    put("post_attention_layernorm.weight", p["post_attention_layernorm"])
    att, mlp = p["attention"], p["mlp"]
    if cfg.layer_kind(i) == "kda":
        for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj", "o_proj"):
            put(f"attention.{n}.weight", att[n], T)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            put(f"attention.{n}.weight", att[n], lambda a: np.asarray(a)[:, None, :])  # [P,W] -> [P,1,W]
        put("attention.A_log", att["A_log"])
        put("attention.dt_bias", att["dt_bias"])
        put("attention.o_norm.weight", att["o_norm"])
    else:
        names = ("q_a_proj", "q_b_proj") if cfg.q_lora else ("q_proj",)
        for n in (*names, "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "dense"):
            put(f"attention.{n}.weight", att[n], T)
        norms = ("q_a_layernorm", "kv_a_layernorm") if cfg.q_lora else ("kv_a_layernorm",)
        for n in norms:
            put(f"attention.{n}.weight", att[n])
    if cfg.is_moe(i):
        put("mlp.gate.weight", mlp["router"], T)
        put("mlp.gate.expert_bias", mlp["expert_bias"])
        for n, src in (("gate_proj", "experts_gate"), ("up_proj", "experts_up"), ("down_proj", "experts_down")):
            if mlp[src] is None:
                continue
            stacked = np.asarray(mlp[src])  # [E, in, out]; with experts_hf [E, out, in] already
            for e in range(stacked.shape[0]):
                out[f"mlp.experts.{e}.{n}.weight"] = stacked[e] if experts_hf else np.ascontiguousarray(stacked[e].T)
        if cfg.has_shared_expert:
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(f"mlp.shared_experts.{n}.weight", mlp[f"shared_{n}"], T)
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            put(f"mlp.{n}.weight", mlp[n], T)
    return out


def globals_to_hf_layout(g: Mapping) -> dict[str, np.ndarray]:
    """The inverse of `convert_globals`' layout (full HF names): embed, final_norm, lm_head [D,V] -> [V,D]."""
    out = {}
    if "embed" in g:
        out["model.word_embeddings.weight"] = np.asarray(g["embed"])
    if "final_norm" in g:
        out["model.norm.weight"] = np.asarray(g["final_norm"])
    if "lm_head" in g:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(g["lm_head"]).T)
    return out
