"""Runtime loader (`parity.torch_ref.loader`): guards of official_remote_code.md (ORC) recorded and enforced, the
prefix causality test, decode positions, and the twin run *through* the fla CPU stand-ins vs the twin's own
pure-PyTorch path (the twin is written independently of `fla_cpu`).

Measured (2-core CPU, `python -m pytest tests/test_loader.py -q -p no:cacheprovider`, bundled `tiny` checkpoint
loaded in fp32):
  twin via stand-ins (cpu_kernels=True) vs twin own path (LING3_TWIN_KERNELS=torch):
    whole model, logits rel-L2: T=40 (fused_recurrent_kda) 2.2e-6, T=100 (chunk_kda) 6.2e-6 — grows ~1e-6 per
    layer from 1.5e-7 after layer 0 (fp32 rounding differences amplified by the random 8-layer model);
    teacher-forced KDA blocks (same input): ≤ 2.4e-7 (T=40), ≤ 1.8e-7 (T=100).
    Tolerance 1e-5 (fp32 tier, DESIGN §5) for both; a lower bound of −4.5 instead of −5 breaks both.
  prefix test, eager fp32 (T=70-80): max|Δ| ≈ 4e-5 on |logits| ≈ 4 (≈ 1e-5 relative, tolerance 1e-4 relative);
  twin quirk non-causal sdpa (T=30): max|Δ| ≈ 2.9 at position 0 (fails, as it must).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from parity.model.config import Ling3Config
from parity.errors import CheckpointError, ParityError
from parity.torch_ref import fla_cpu
from parity.torch_ref import loader as L
from bounds import DECODE_STEPS_VS_PREFILL, LOADER_REL_L2, REPAIRED_LOGITS, ROPE_INV_FREQ_FP32

REPO = Path(__file__).resolve().parents[1]
TINY, TINY_FLASH = REPO / "dumps" / "ckpt" / "tiny", REPO / "dumps" / "ckpt" / "tiny-flash"
REL_TOL = LOADER_REL_L2

pytestmark = pytest.mark.skipif(
    not ((TINY / "config.json").exists() and (TINY_FLASH / "config.json").exists()
         and (REPO / "parity" / "torch_ref" / "twin" / "modeling_bailing_moe_v3.py").exists()),
    reason="bundled tiny checkpoints / twin remote code not in the repo yet (made by parity.torch_ref.ckpt)",
)


@contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ids(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 500, (1, T), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def twin_own():
    """The twin's own pure-PyTorch KDA path, through the loader without stand-ins."""
    with _env(LING3_TWIN_KERNELS="torch"):
        lm = L.load_model(TINY, "remote", dtype="float32", cpu_kernels=False)
    yield lm
    lm.release()


@pytest.fixture(scope="module")
def twin_stand_ins():
    """The twin with the fla stand-ins installed: its KDA layers call chunk_kda / fused_recurrent_kda /
    ShortConvolution / FusedRMSNormGated exactly as the official file does."""
    assert not fla_cpu.is_installed()
    with _env(LING3_TWIN_KERNELS=None):
        lm = L.load_model(TINY, "remote", dtype="float32")  # cpu_kernels defaults to True on cpu
    yield lm
    lm.release()
    assert not fla_cpu.is_installed()


@pytest.fixture(scope="module")
def native_flash():
    return L.load_model(TINY_FLASH, "native", dtype="float32")


# ----------------------------------------------------------------------------------------------- classes and guards
def test_remote_loads_the_twin_class_with_guards_recorded(twin_own):
    m, g = twin_own.model, twin_own.guards
    assert type(m).__name__ == "BailingMoeV3ForCausalLM"
    assert type(m).__module__.startswith("transformers_modules.")
    assert type(m).__module__.endswith(".modeling_bailing_moe_v3")
    assert twin_own.runtime == "remote" and isinstance(twin_own.config, Ling3Config)
    assert g["trust_remote_code"] is True and g["attn_implementation"] == "eager" == m.config._attn_implementation
    assert g["rope_scaling"] is None and m.config.rope_scaling is None
    assert g["layer_types"] == "absent" and getattr(m.config, "layer_types", None) is None
    assert g["inv_freq"]["checked"] and g["inv_freq"]["recomputed"]
    assert "model.rotary_emb.inv_freq" in g["inv_freq"]["buffers"]
    assert g["load_report"]["missing"] == 0 and g["param_dtypes"] == ["float32"]
    json.dumps(g)  # JSON-able, goes into the dump's attrs


def test_native_loads_the_builtin_with_ragged_layer_types(native_flash):
    m, g = native_flash.model, native_flash.guards
    assert type(m).__module__ == "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
    assert g["trust_remote_code"] is False and g["attn_implementation"] == "eager"
    # tiny-flash: 8 layers, group 6 -> MLA at 5 and the ragged tail 6, 7 (facts §2)
    assert g["layer_types"] == ["linear_attention"] * 5 + ["full_attention"] * 3 and g["ragged_tail"] is True
    assert list(m.config.layer_types) == g["layer_types"]
    assert g["load_report"]["unexpected_mtp_only"] > 0  # the MTP layer 8 is in the checkpoint, unused by the built-in
    assert all(not str(b).startswith("parity.") for b in g["native_kda_kernels"].values())
    assert g["inv_freq"]["checked"]
    json.dumps(g)


def test_bf16_load_keeps_the_explicit_dtype():
    with _env(LING3_TWIN_KERNELS="torch"):
        lm = L.load_model(TINY_FLASH, "remote", dtype=torch.bfloat16, cpu_kernels=False)
    assert lm.guards["dtype"] == "bfloat16" and "bfloat16" in lm.guards["param_dtypes"]
    attn = lm.model.model.layers[0].attention
    assert attn.A_log.dtype == torch.float32  # fp32 in the official file (ORC §6)


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ParityError, match="runtime 'twin'"):
        L.load_model(TINY, "twin")
    with pytest.raises(ParityError, match="dtype 'fp16'"):
        L.load_model(TINY, "remote", dtype="fp16")
    with pytest.raises(ParityError, match="native-runtime override"):
        L.load_model(TINY, "remote", layer_types=["linear_attention"] * 8)
    with pytest.raises(ParityError, match="set by the loader's guards"):
        L.load_model(TINY, "remote", config_overrides={"attn_implementation": "sdpa"})
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        L.load_model(tmp_path / "nope", "remote")
    d = tmp_path / "no_auto_map"
    d.mkdir()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.pop("auto_map")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="auto_map"):
        L.load_model(d, "remote")
    assert not fla_cpu.is_installed()


def test_load_report_check():
    cfg = Ling3Config.from_pretrained_dir(TINY, strict=False)
    ok = {"missing_keys": set(), "unexpected_keys": {"model.layers.8.enorm.weight"}, "mismatched_keys": set()}
    assert L._check_load_report(ok, cfg, TINY, "native") == {"missing": 0, "unexpected_mtp_only": 1}
    with pytest.raises(CheckpointError, match="would be random"):
        L._check_load_report({"missing_keys": {"model.norm.weight"}}, cfg, TINY, "remote")
    with pytest.raises(CheckpointError, match="outside the MTP layer"):
        L._check_load_report({"unexpected_keys": {"model.layers.3.foo"}}, cfg, TINY, "native")


# ----------------------------------------------------------------------------------------------- inv_freq
def _want_inv_freq(cfg: Ling3Config) -> torch.Tensor:
    """θ^{-2j/r} (facts §4.3) in float64, written out here."""
    r = cfg.qk_rope_head_dim
    return torch.tensor([cfg.rope_theta ** (-2 * j / r) for j in range(r // 2)], dtype=torch.float64)


def test_uninitialised_inv_freq_quirk_is_repaired(twin_own):
    """Twin quirk switch: inv_freq left as `empty_like` memory, like the official file on 5.x (ORC §1.4)."""
    with _env(LING3_TWIN_KERNELS="torch"):
        lm = L.load_model(TINY, "remote", cpu_kernels=False, config_overrides={"twin_quirk_uninit_inv_freq": True})
    buf = lm.model.model.rotary_emb.inv_freq
    ROPE_INV_FREQ_FP32.check(buf.double(), _want_inv_freq(lm.config))
    ids = _ids(30)
    REPAIRED_LOGITS.check(_logits(lm.model, ids), _logits(twin_own.model, ids))
    rec = lm.guards["inv_freq"]["buffers"]["model.rotary_emb.inv_freq"]
    assert set(rec) >= {"max_rel_deviation_before", "repaired"}


def test_repair_records_and_fixes_garbage(twin_own):
    m, cfg = twin_own.model, twin_own.config
    ids = _ids(30)
    good = _logits(m, ids)
    buf = m.model.rotary_emb.inv_freq
    with torch.no_grad():
        buf.copy_(torch.linspace(3.0, 0.5, buf.numel()))  # garbage RoPE
    broken = _logits(m, ids)
    assert _rel(broken, good) > 1e-3  # the logits comparison does see a wrong inv_freq
    rec = L.repair_inv_freq(m, cfg)["buffers"]["model.rotary_emb.inv_freq"]
    assert rec["repaired"] is True and rec["max_rel_deviation_before"] > 1.0
    ROPE_INV_FREQ_FP32.check(buf.double(), _want_inv_freq(cfg))
    torch.testing.assert_close(_logits(m, ids), good, rtol=0, atol=0)
    with torch.no_grad():
        buf.fill_(float("nan"))
    assert L.repair_inv_freq(m, cfg)["buffers"]["model.rotary_emb.inv_freq"]["max_rel_deviation_before"] == "non-finite"


# ----------------------------------------------------------------------------------------------- causality
# ----------------------------------------------------------------------------------------------- decode positions
def test_decode_positions_and_manual_decode(twin_stand_ins):
    p = L.decode_positions(7, 3, batch=2)
    assert p["position_ids"].tolist() == [[7, 8, 9], [7, 8, 9]] and p["cache_position"].tolist() == [7, 8, 9]
    with pytest.raises(ParityError):
        L.decode_positions(-1, 1)
    # prefill 20 + 4 single-token steps with explicit positions == one forward over 24 tokens (stand-in conv cache
    # updated in place, fused_recurrent_kda carrying the state)
    m = twin_stand_ins.model
    ids = _ids(24, seed=4)
    full = _logits(m, ids)
    with torch.no_grad():
        out = m(input_ids=ids[:, :20], use_cache=True)
        pkv, steps = out.past_key_values, [out.logits]
        for t in range(20, 24):
            out = m(input_ids=ids[:, t:t + 1], past_key_values=pkv, use_cache=True, **L.decode_positions(t, 1))
            steps.append(out.logits)
    DECODE_STEPS_VS_PREFILL.check(torch.cat(steps, 1), full)


# ----------------------------------------------------------------------------------------------- twin via stand-ins
def test_twin_really_calls_the_stand_ins(twin_stand_ins, twin_own):
    a = twin_stand_ins.model.model.layers[0].attention
    assert type(a.q_conv1d) is fla_cpu.ShortConvolution and type(a.o_norm) is fla_cpu.FusedRMSNormGated
    assert type(twin_own.model.model.layers[0].attention.q_conv1d).__module__.startswith("transformers_modules.")
    assert twin_stand_ins.guards["fla_kernels"].startswith("cpu stand-ins")
    calls = []
    fla_cpu.set_kda_observer(lambda d: calls.append(d["kernel"]))
    try:
        _logits(twin_stand_ins.model, _ids(40))
        _logits(twin_stand_ins.model, _ids(100))
    finally:
        fla_cpu.set_kda_observer(None)
    n_kda = len(twin_stand_ins.config.kda_layers)
    assert calls == ["recurrent"] * n_kda + ["chunk"] * n_kda  # ≤ 64 tokens recurrent, beyond chunked (§3.10)


@pytest.mark.parametrize("T", [40, 100], ids=["T40_recurrent", "T100_chunk"])
def test_twin_via_stand_ins_matches_twin_own_path(twin_stand_ins, twin_own, T):
    ids = _ids(T, seed=5)
    r = _rel(_logits(twin_stand_ins.model, ids), _logits(twin_own.model, ids))
    assert r <= REL_TOL, f"T={T}: logits rel-L2 {r:.3g} > {REL_TOL}"


@pytest.mark.parametrize("T", [40, 100], ids=["T40_recurrent", "T100_chunk"])
def test_twin_kda_layers_via_stand_ins_match_own_path_teacher_forced(twin_stand_ins, twin_own, T):
    """Each KDA attention block fed the same input (own path's normed hidden state): no accumulation over layers."""
    ids = _ids(T, seed=6)
    with torch.no_grad():
        hs = twin_own.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        worst = {}
        for i in twin_own.config.kda_layers:
            own_layer, si_layer = twin_own.model.model.layers[i], twin_stand_ins.model.model.layers[i]
            x = own_layer.input_layernorm(hs[i])
            worst[i] = _rel(si_layer.attention(x)[0], own_layer.attention(x)[0])
    assert max(worst.values()) <= REL_TOL, f"T={T}: KDA block rel-L2 per layer {worst}"


@pytest.mark.parametrize("T", [40, 100])
def test_stand_in_comparison_detects_a_broken_gate(twin_stand_ins, twin_own, monkeypatch, T):
    real = fla_cpu.kda_gate
    monkeypatch.setattr(fla_cpu, "kda_gate", lambda g, A, dt, lb: real(g, A, dt, None if lb is None else lb + 0.5))
    ids = _ids(T, seed=5)
    r = _rel(_logits(twin_stand_ins.model, ids), _logits(twin_own.model, ids))
    assert r > REL_TOL, f"a lower bound of -4.5 instead of -5 went unnoticed (rel-L2 {r:.3g})"
    with pytest.raises(AssertionError, match="KDA block rel-L2"):
        test_twin_kda_layers_via_stand_ins_match_own_path_teacher_forced(twin_stand_ins, twin_own, T)


# ----------------------------------------------------------------------------------------------- native independence
_NATIVE_BINDING_SCRIPT = r"""
import importlib, sys, json
from parity.errors import ParityError
from parity.torch_ref import fla_cpu, loader as L
h = fla_cpu.install()
lm = L.load_model(sys.argv[1], "native")  # first import of the built-in happens with the stand-ins hidden
ok = lm.guards["native_kda_kernels"]
# now import the built-in afresh *with* the stand-ins visible: it binds to them and must be refused
for name in [n for n in sys.modules if n.startswith("transformers.models.bailing_hybrid")]:
    del sys.modules[name]
importlib.import_module(L.BUILTIN_MODULE)
try:
    L.load_model(sys.argv[1], "native")
    refused = None
except ParityError as e:
    refused = str(e)
h.uninstall()
print(json.dumps({"ok": ok, "refused": refused}))
"""


def test_native_never_binds_to_the_stand_ins():
    """transformers binds the built-in's KDA kernels to whatever `fla` is importable at its first import; the loader
    imports it with the stand-ins hidden, and refuses a built-in that is already bound to them."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NATIVE_BINDING_SCRIPT, str(TINY_FLASH)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v == L.BUILTIN_MODULE for v in res["ok"].values()), res
    assert res["refused"] is not None and "not independent" in res["refused"], res


def test_two_checkpoints_of_one_folder_name_each_load_their_own_code(tmp_path):
    """transformers maps a remote config class to the model class an earlier load registered, and two checkpoints whose
    configuration files are identical (the twin's and the official file's; the suite puts its configuration class in
    both) share that config class: the official file's checkpoint loaded in a process that already loaded the twin's
    was handed the twin's model (measured: a regenerated official golden held the twin's code; a test replayed the
    official code as the twin). The loader builds the class its auto_map names from the checkpoint's own files, and
    verifies the module's source is the checkpoint's modeling file (else one line)."""
    import hashlib
    import inspect
    import subprocess
    import sys

    from parity.torch_ref import official

    ok, why = official.available()
    if not ok:
        pytest.skip(why)
    off = tmp_path / "tiny-flash"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "make_ckpt.py"), "--preset", "tiny-flash", "--seed", "0",
                        "--out", str(off), "--modeling", "official"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    script = (
        "import hashlib, inspect, pathlib, sys\n"
        "from parity.torch_ref.loader import load_model\n"
        "for p in sys.argv[1:]:\n"
        "    lm = load_model(p, runtime='remote', dtype='float32', trust_remote_code=True)\n"
        "    src = pathlib.Path(inspect.getsourcefile(type(lm.model)))\n"
        "    own = pathlib.Path(p) / 'modeling_bailing_moe_v3.py'\n"
        "    print('own' if src.read_bytes() == own.read_bytes() else 'other', p)\n")
    both = subprocess.run([sys.executable, "-c", script, str(REPO / "dumps" / "ckpt" / "tiny-flash"), str(off),
                           str(REPO / "dumps" / "ckpt" / "tiny-flash")],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    lines = [ln for ln in both.stdout.splitlines() if ln.startswith(("own", "other"))]
    assert len(lines) == 3 and all(ln.startswith("own ") for ln in lines), both.stdout + both.stderr[-3000:]
