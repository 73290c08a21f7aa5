"""The real-kernel corpus' runtimes (KernelSpec.runtimes, `tools/calibrate.py corpus --only kernels --kernel-runtimes`):
the official modeling file's runs are named apart from the twin's, and a walk of some runtimes is merged into the
stored corpus by runtime (parity.calibration.corpus.merge_kernel_corpus). No dump is made here."""

from __future__ import annotations

import pytest

from parity.calibration import corpus as K


def _walk(spec: K.KernelSpec, command: str) -> tuple[K.Measurement, dict]:
    """A stand-in for a walk's measurements: one point, routing record, row and step record per run of `spec`."""
    runs = K.kernel_runs(spec)
    meas = K.Measurement(points=[{"corpus": r.corpus_id, "site": "mlp"} for r in runs],
                         routing=[{"corpus": r.corpus_id} for r in runs],
                         runs=[{"what": f"dump remote fla {r.dump_name}"} for r in runs]
                         + [{"what": f"replay free {r.corpus_id}"} for r in runs],
                         rows=[{"point": f"{r.label}:prefill/L00/mlp"} for r in runs])
    meta = {"command": command, "date": "d", "machine": "m", "corpus": dict(spec.__dict__)}
    return meas, meta


def test_official_runs_are_named_apart_from_the_twin_runs():
    spec = K.KernelSpec(presets=("tiny",), seeds=(1,), prompt_lens=(40,), runtimes=("twin", "official"))
    twin, official = K.kernel_runs(spec)
    assert (twin.runtime, official.runtime) == ("twin", "official")
    assert twin.label == "fla:tiny/s1/T40" and official.label == "fla-official:tiny/s1/T40"
    assert twin.ckpt_name != official.ckpt_name and twin.dump_name != official.dump_name
    assert len({twin.corpus_id, official.corpus_id}) == 2


def test_unknown_runtime_is_one_error():
    with pytest.raises(ValueError, match="unknown runtime"):
        K.kernel_runs(K.KernelSpec(seeds=(1,), runtimes=("twin", "native")))


def test_merge_adds_then_replaces_a_runtime_and_keeps_the_other():
    twin = _walk(K.KernelSpec(seeds=(1, 2, 3, 4)), "twin walk")
    off1 = _walk(K.KernelSpec(seeds=(1,), runtimes=("official",)), "official walk 1")
    meas, meta = K.merge_kernel_corpus(twin, *off1)
    assert meta["command"] == "twin walk" and [m["command"] for m in meta["merged"]] == ["official walk 1"]
    plan = {r.corpus_id for s in K.kernel_specs(meta) for r in K.kernel_runs(s)}
    assert plan == {p["corpus"] for p in meas.points}  # the specs recorded name exactly the stored runs
    assert len(meas.points) == 16 + 4 and len(meas.rows) == 16 + 4 and len(meas.runs) == 2 * (16 + 4)
    # walking the official runtime again replaces its runs, the twin's stay
    off2 = _walk(K.KernelSpec(seeds=(2,), runtimes=("official",)), "official walk 2")
    meas2, meta2 = K.merge_kernel_corpus((meas, meta), *off2)
    assert [m["command"] for m in meta2["merged"]] == ["official walk 2"]
    assert {p["corpus"] for p in meas2.points} == ({r.corpus_id for r in K.kernel_runs(K.KernelSpec(seeds=(1, 2, 3, 4)))}
                                                   | {p["corpus"] for p in off2[0].points})
    assert not any("/s1/" in p["corpus"] and p["corpus"].startswith("fla-official:") for p in meas2.points)
    # walking the twin runtime again makes the new walk the corpus' own; the official walk stays merged
    tw2 = _walk(K.KernelSpec(seeds=(5,)), "twin walk 2")
    meas3, meta3 = K.merge_kernel_corpus((meas2, meta2), *tw2)
    assert meta3["command"] == "twin walk 2" and [m["command"] for m in meta3["merged"]] == ["official walk 2"]
    assert {r.corpus_id for s in K.kernel_specs(meta3) for r in K.kernel_runs(s)} == {p["corpus"] for p in meas3.points}


def test_merge_refuses_to_split_a_stored_walk():
    both = _walk(K.KernelSpec(seeds=(1,), runtimes=("twin", "official")), "both")
    with pytest.raises(ValueError, match="walk those runtimes together"):
        K.merge_kernel_corpus(both, *_walk(K.KernelSpec(seeds=(2,), runtimes=("official",)), "official only"))


def test_official_runtime_without_the_file_is_skipped_in_one_line(monkeypatch, tmp_path, capsys):
    """`corpus --only kernels --kernel-runtimes official` where the official file is absent: the runtime is skipped
    saying why, and with nothing left to walk the command stops with one error line (exit 2), writing nothing."""
    import importlib.util
    from pathlib import Path

    from parity.torch_ref import official

    monkeypatch.setenv(official.ENV_VAR, str(tmp_path / "absent.py"))
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("calibrate_tool", root / "tools" / "calibrate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rc = tool.main(["corpus", "--only", "kernels", "--kernel-runtimes", "official", "--kernel-seeds", "1",
                    "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert rc == 2
    assert "official runtime skipped: official modeling file not found" in out.out
    assert out.err.strip().splitlines() == ["error: corpus --only kernels: no runtime left to walk (the official "
                                            "file is absent)"]
    assert not (tmp_path / "out").exists()
