"""Kernel guard/switch and kernel provenance of a dump (issue 24, items 1 and 2; parity.torch_ref.kernels,
parity.provenance): which KDA implementation ran is observed at run time and recorded in the root attr `kernels`.

The expected implementations come from how each dump is set up (stand-ins installed, the twin's own path forced by
LING3_TWIN_KERNELS=torch), not from the recorder. The real-kernel path needs triton (not in the main environment):
that test skips there with one line; run it in a venv with triton (README "Dump the HF reference").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from parity.dumpfile import DumpReader, seal_dump
from parity.errors import DumpError
from parity.provenance import NOT_RECORDED, kernels_line, markdown_section
from parity.reporting.report import build_report, markdown, summary_text
from parity.torch_ref import fla_cpu
from parity.torch_ref.dump import DumpOptions, dump_checkpoint
from parity.torch_ref.kernels import choose_cpu_kernels, fp32_matmul_policy, implementation_of
from parity.torch_ref.prompts import builtin_ids

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "dumps" / "ckpt" / "tiny"
IDS_70 = builtin_ids(512, 70, seed=5)  # > 64 tokens: prefill takes chunk_kda, each decode step fused_recurrent_kda
ALL_PATHS = {"chunk_kda", "fused_recurrent_kda", "short_conv", "norm_gate"}


# ------------------------------------------------------------------------------------------ the guard / switch
@pytest.mark.parametrize("device,cuda,interp,fla_triton,stand_ins", [
    ("cpu", False, None, True, True),     # CPU machine with triton installed: stand-ins, no refusal (issue 24)
    ("cpu", True, None, True, True),      # a GPU box dumping on CPU tensors: Triton cannot run them
    ("cpu", False, "1", True, False),     # the interpreter runs the real kernels on CPU tensors
    ("cuda", True, None, True, False),    # GPU box
    ("cuda", False, None, True, True),    # "cuda" asked for, none there
    ("cuda", True, None, False, True),    # no fla / triton at all
    ("cpu", False, "1", False, True),
])
def test_default_uses_the_stand_ins_exactly_where_the_real_kernels_cannot_run(device, cuda, interp, fla_triton,
                                                                              stand_ins):
    use, why = choose_cpu_kernels(None, device, cuda_available=cuda, interpret=interp, fla_and_triton=fla_triton)
    assert use is stand_ins and why.startswith("default: ")


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("machine", [dict(cuda_available=True, interpret="1", fla_and_triton=True),
                                     dict(cuda_available=False, interpret=None, fla_and_triton=False)])
def test_an_explicit_choice_wins_on_any_machine(explicit, machine):
    use, why = choose_cpu_kernels(explicit, "cuda", **machine)
    assert use is explicit and why == ("--cpu-kernels" if explicit else "--no-cpu-kernels")


def test_implementation_names():
    def fake_fla_kernel():
        pass

    fake_fla_kernel.__module__ = "fla.ops.kda.chunk"
    assert implementation_of(fake_fla_kernel) == "fla"
    assert implementation_of(fla_cpu.chunk_kda) == "stand-in"
    assert implementation_of(fla_cpu.ShortConvolution(8, 4)) == "stand-in"  # a module: its class decides
    assert implementation_of(torch.nn.Conv1d(1, 1, 1)) == "torch:conv"


# ------------------------------------------------------------------------------------------ fp32 matmul policy
def test_fp32_on_cuda_forces_ieee_and_restores_unless_tf32_is_allowed(monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 on, as a user's process may have it
    torch.set_float32_matmul_precision("high")
    try:
        with fp32_matmul_policy(torch.float32, "cuda", allow_tf32=False) as rec:
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest" and os.environ["TRITON_F32_DEFAULT"] == "ieee"
            assert rec["triton_f32_default"] == "ieee" and rec["policy"].startswith("IEEE fp32 forced")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        assert os.environ["TRITON_F32_DEFAULT"] == "tf32"
        for dtype, device, allow, policy in [(torch.float32, "cuda", True, "TF32 allowed"),
                                             (torch.bfloat16, "cuda", False, "not an fp32 dump"),
                                             (torch.float32, "cpu", False, "moot")]:
            with fp32_matmul_policy(dtype, device, allow_tf32=allow) as rec:  # left as found, and recorded so
                assert torch.backends.cuda.matmul.allow_tf32 and rec["torch_allow_tf32"] is True
                assert rec["triton_f32_default"] == "tf32" and rec["policy"].startswith(policy)
                assert rec["allow_tf32_option"] is allow
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.set_float32_matmul_precision(before[2])


def test_bf16_gemm_reductions_forced_off_on_cuda_and_restored_unless_allowed():
    """issue 31 item 6: cuBLAS reduced-precision bf16 GEMM reductions off inside the block on CUDA (torch's flag is
    a plain setting, settable without a GPU), restored after; left as found with the option or off CUDA."""
    from parity.torch_ref.kernels import bf16_gemm_policy

    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # torch's own default
    try:
        with bf16_gemm_policy("cuda", allow_reduced=False) as rec:
            assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
            assert rec["allow_bf16_reduced_precision_reduction"] is False and rec["policy"].startswith("full fp32")
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True
        for device, allow in (("cuda", True), ("cpu", False)):
            with bf16_gemm_policy(device, allow_reduced=allow) as rec:  # left as found, and recorded so
                assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True
                assert rec["allow_bf16_reduced_precision_reduction"] is True and rec["allow_option"] is allow
                assert rec["policy"].endswith("as found")
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_dumper_option_keeps_the_bf16_reductions():
    from parity.cli.dump_hf import build_parser

    assert not build_parser().parse_args(["ckpt", "--out", "x.h5"]).allow_bf16_reduced_precision_reduction
    args = build_parser().parse_args(["ckpt", "--out", "x.h5", "--allow-bf16-reduced-precision-reduction"])
    assert args.allow_bf16_reduced_precision_reduction


# ------------------------------------------------------------------------------------------ dumps
def _cpu_machine_with_triton(monkeypatch):
    """fla and triton importable (the probe answers so: a fake `triton` module would break torch's own imports), no
    CUDA device, no interpreter. The same case with a real triton installed: test_real_triton_cpu_default_*."""
    monkeypatch.setattr(fla_cpu, "real_fla_with_triton", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _dump(out: Path, **kw) -> Path:
    dump_checkpoint(TINY, out, IDS_70, DumpOptions(progress=False, decode_steps=1, dtype="float32", **kw))
    return out


@pytest.fixture(scope="module")
def stand_in_dump(tmp_path_factory) -> Path:
    mp = pytest.MonkeyPatch()
    try:
        _cpu_machine_with_triton(mp)
        return _dump(tmp_path_factory.mktemp("k") / "stand-ins.h5")  # default choice, not forced
    finally:
        mp.undo()


def test_default_dump_on_a_cpu_machine_with_triton_runs_the_stand_ins_and_says_so(stand_in_dump):
    with DumpReader(stand_in_dump) as d:
        k, guard = d.kernels, d.meta["guards"]["fla_kernels"]
    assert k["kda_paths"] == {p: "stand-in" for p in ALL_PATHS}
    assert guard.startswith("cpu stand-ins") and guard.endswith(k["choice"])
    assert k["cpu_kernels"] is True and k["choice"].startswith("default: ") and "TRITON_INTERPRET" in k["choice"]
    assert k["fla_core_version"] is None  # no real fla kernel ran, whatever is installed
    assert k["device"] == "cpu" and k["cuda_name"] is None and k["triton_interpret"] is None
    assert k["fp32_matmul"]["policy"].startswith("moot")
    assert "chunk_kda=stand-in" in kernels_line(k)
    # issue 31: the bf16 GEMM reduction setting, recorded as found on a CPU machine
    assert k["bf16_gemm"]["policy"].startswith("moot") and k["bf16_gemm"]["allow_option"] is False
    assert k["bf16_gemm"]["allow_bf16_reduced_precision_reduction"] is \
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    assert "bf16 GEMM reduction: moot" in kernels_line(k)


def test_the_twins_own_path_is_observed_not_inferred(tmp_path, monkeypatch):
    """--no-cpu-kernels with the twin's fla branch vetoed: no stand-in and no fla kernel runs, and the record says
    so — although fla-core is installed here (what an installed-package check would have reported)."""
    monkeypatch.setenv("LING3_TWIN_KERNELS", "torch")
    with DumpReader(_dump(tmp_path / "twin.h5", cpu_kernels=False)) as d:
        k = d.kernels
    assert set(k["kda_paths"]) == ALL_PATHS
    assert all(impl == "torch:modeling_bailing_moe_v3" for impl in k["kda_paths"].values()), k["kda_paths"]
    assert k["cpu_kernels"] is False and k["choice"] == "--no-cpu-kernels" and k["fla_core_version"] is None


def test_cli_prints_which_kernels_ran_and_inspect_prints_the_provenance(stand_in_dump, tmp_path):
    from parity.cli.dump_hf import inspect_lines

    lines = inspect_lines(str(stand_in_dump))
    assert lines[1].startswith("  kernels: ") and "fused_recurrent_kda=stand-in" in lines[1]
    older = tmp_path / "older.h5"  # as written before the attr existed
    older.write_bytes(stand_in_dump.read_bytes())
    with h5py.File(older, "r+") as f:
        del f.attrs["kernels"]
    seal_dump(older)
    old = inspect_lines(str(older))
    assert lines[0].startswith(str(stand_in_dump)) and old[1] == f"  kernels: {NOT_RECORDED}"


def test_a_malformed_kernels_attr_is_one_line_naming_the_field(stand_in_dump, tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(stand_in_dump.read_bytes())
    with h5py.File(bad, "r+") as f:
        k = json.loads(f.attrs["kernels"])
        k["kda_paths"] = ["chunk_kda"]
        f.attrs["kernels"] = json.dumps(k)
    seal_dump(bad)
    with pytest.raises(DumpError, match=r"bad\.h5: root attr kernels field 'kda_paths' is \['chunk_kda'\], "
                                        r"expected object"):
        DumpReader(bad)


# ------------------------------------------------------------------------------------------ report header
def test_report_header_shows_the_provenance_and_says_when_it_is_missing(stand_in_dump):
    with DumpReader(stand_in_dump) as d:
        k, cfg = d.kernels, d.config
    rep = build_report(cfg, [], dump="x.h5", target="reference", mode="layer", extra={"dump_provenance": k})
    assert f"  dump kernels: {kernels_line(k)}" in summary_text(rep).splitlines()
    md = markdown(rep)
    assert "\n".join(markdown_section(k)) in md and "| chunk_kda | stand-in |" in md
    old = build_report(cfg, [], dump="x.h5", target="reference", mode="layer", extra={"dump_provenance": None})
    assert f"  dump kernels: {NOT_RECORDED}" in summary_text(old).splitlines()
    assert NOT_RECORDED in markdown(old)


# ------------------------------------------------------------------------------------------ with a real triton
def _cli_dump(tmp_path: Path, out: Path, *flags: str, interpret: bool) -> subprocess.CompletedProcess:
    """tools/dump_hf.py in a subprocess (40-token prompt: the recurrent KDA path, one decode step, fp32); under the
    interpreter with the shared shim of the interpreter gaps fla 0.6.0 hits as sitecustomize."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (main environment); run in a venv with triton for this case")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    if interpret:
        shim = Path(os.environ.get("LING3_TRITON_SHIM", "/work/shared/tools/triton_interpreter_shim.py"))
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(shim.read_text())
        env.update(TRITON_INTERPRET="1", PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    return subprocess.run([sys.executable, str(REPO / "tools" / "dump_hf.py"), str(TINY), "--out", str(out),
                           "--prompt-len", "40", "--decode-steps", "1", "--dtype", "fp32", "--no-progress", *flags],
                          capture_output=True, text=True, env=env, timeout=1500)


def test_real_triton_cpu_default_dump_runs_the_stand_ins(tmp_path):
    """Acceptance: on a CPU machine with triton installed, a default dump succeeds with the stand-ins (it refused)."""
    r = _cli_dump(tmp_path, tmp_path / "d.h5", interpret=False)
    assert r.returncode == 0, r.stderr[-2000:]
    with DumpReader(tmp_path / "d.h5") as d:
        k = d.kernels
    assert k["kda_paths"] == {"fused_recurrent_kda": "stand-in", "short_conv": "stand-in", "norm_gate": "stand-in"}
    assert k["cpu_kernels"] is True and k["triton_version"] and k["fla_core_version"] is None
    assert "fused_recurrent_kda=stand-in" in r.stdout


def test_no_cpu_kernels_under_the_interpreter_runs_fla(tmp_path):
    """Acceptance: `--no-cpu-kernels` under TRITON_INTERPRET=1 runs fla's real kernels and records them (slow: the
    interpreter)."""
    r = _cli_dump(tmp_path, tmp_path / "real.h5", "--no-cpu-kernels", interpret=True)
    assert r.returncode == 0, r.stderr[-2000:]
    with DumpReader(tmp_path / "real.h5") as d:
        k = d.kernels
    assert k["kda_paths"] == {"fused_recurrent_kda": "fla", "short_conv": "fla", "norm_gate": "fla"}
    assert k["triton_interpret"] == "1" and k["cpu_kernels"] is False and k["triton_version"]
    assert k["fla_core_version"] == k["fla_core_installed"] is not None
    assert "fused_recurrent_kda=fla" in r.stdout
