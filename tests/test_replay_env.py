"""Replay-side provenance (issue 31 item 1: report.json `replay_env`, the report header, `tools/report.py show`, the CI
summary) and units that mean something (item 4: the per-layer table's error column on fp32 points that cross zero)."""

from __future__ import annotations

import types

import numpy as np

from parity.model.config import PRESETS, Ling3Config
from parity.model.points import sites_for_config
from parity.replay.environment import collect, env_line, markdown_section, replay_env
from parity.reporting.report import build_report, html_page, layer_table, markdown, summary_text

CFG = Ling3Config.from_dict(PRESETS["tiny"])


def _tpu(n):
    return [types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite") for _ in range(n)]


def test_replay_env_is_a_pure_function_of_what_it_is_given():
    env = replay_env(devices=_tpu(8), versions={"jax": "0.7.0", "jaxlib": "0.7.0", "libtpu": "0.0.21"},
                     environ={"XLA_FLAGS": "--xla_dump_to=/tmp/x", "LIBTPU_INIT_ARGS": "--xla_tpu_foo=1", "HOME": "/"},
                     default_matmul_precision=None, policy={"policy": "highest", "source": "default"},
                     reference_compiler_options={"xla_allow_excess_precision": False})
    assert env == {"platform": "tpu", "device_kind": "TPU v5 lite", "device_count": 8, "jax": "0.7.0",
                   "jaxlib": "0.7.0", "libtpu": "0.0.21",
                   "env": {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "LIBTPU_INIT_ARGS": "--xla_tpu_foo=1",
                           "LING3_REFERENCE_XLA_DEFAULTS": None},
                   "jax_default_matmul_precision": None, "matmul_precision": {"policy": "highest", "source": "default"},
                   "reference_compiler_options": {"xla_allow_excess_precision": False}}
    line = env_line(env)
    assert line.startswith("tpu x8 (TPU v5 lite) | jax 0.7.0, jaxlib 0.7.0, libtpu 0.0.21")
    assert "LIBTPU_INIT_ARGS=--xla_tpu_foo=1" in line and "matmul precision: highest" in line
    assert "xla_allow_excess_precision=False" in line
    assert "- platform: tpu, 8 device(s), TPU v5 lite" in markdown_section(env)
    # no policy applied, the reference under XLA's defaults: said, not blank
    bare = replay_env(devices=[], versions={}, environ={}, default_matmul_precision="high", policy=None,
                      reference_compiler_options={})
    assert bare["platform"] is None and bare["device_count"] == 0
    assert "none applied" in env_line(bare) and "XLA's defaults" in env_line(bare)


def test_collect_reads_this_process():
    import jax

    from parity.jax_ling3 import REFERENCE_COMPILER_OPTIONS

    env = collect({"policy": "highest", "source": "default"})
    assert env["platform"] == jax.default_backend() and env["device_count"] == jax.device_count()
    assert env["jax"] == jax.__version__ and env["jaxlib"] is not None
    assert env["reference_compiler_options"] == REFERENCE_COMPILER_OPTIONS


def test_report_header_and_ci_summary_show_the_replay_env():
    from parity.pytest_plugin.ci_summary import report_markdown

    env = replay_env(devices=_tpu(4), versions={"jax": "0.7.0"}, environ={}, default_matmul_precision=None,
                     policy={"policy": "default", "source": "--parity-matmul-precision"},
                     reference_compiler_options={})
    rep = build_report(CFG, _records({}), dump="d.h5", target="t", mode="layer", extra={"replay_env": env})
    for text in (summary_text(rep), markdown(rep), html_page(rep), "\n".join(report_markdown(rep))):
        assert "tpu x4 (TPU v5 lite)" in text or "platform: tpu, 4 device(s)" in text
        assert "matmul precision" in text


# ------------------------------------------------------------------------------------------------ units (item 4)
def _records(extra: dict) -> list[dict]:
    recs = [{"phase": "prefill", "step": 0, "layer": i, "site": s, "status": "pass", "max_ulp": 0, "rel_l2": 0.0,
             "max_diff_rms": 0.0, "dtype": "bfloat16"} for i in range(CFG.num_hidden_layers)
            for s in sites_for_config(CFG, i)]
    for r in recs:
        r.update(extra.get((r["layer"], r["site"]), {}))
    return recs


def test_error_column_is_finite_and_ordered_on_fp32_points_that_cross_zero():
    """A bf16 dump's fp32 point (KDA gate / state) whose tiny values cross zero shows ~2e9 fp32 ULP; the table's
    column (max |Δ|/RMS) must rank it below a layer with a real 1% error on a bf16 point. Verdicts from the real
    comparison (`parity.numerics.compare`) with the default rules."""
    from parity.numerics.compare import compare
    from parity.numerics.tolerances import default_rules

    rules = default_rules()
    rng = np.random.default_rng(1)
    # fp32 gate-like tensor: rows of O(1) values, a few elements near zero whose sign flips (|Δ| 6e-3 of the row
    # RMS: above the fp32 rule's floor of 32768 ULP of the RMS, ~4e-3)
    ref32 = rng.standard_normal((4, 64)).astype(np.float32)
    ref32[:, :4] = np.float32(3e-3)
    test32 = ref32.copy()
    test32[:, :4] = np.float32(-3e-3)
    v32 = compare(ref32, test32, rules.rule_for("attention.gate", "layer", "float32", "bfloat16")).to_dict()
    assert v32["max_ulp"] > 10**9  # the number that used to dominate the table
    import ml_dtypes

    ref16 = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    test16 = (ref16.astype(np.float32) * 1.05).astype(ml_dtypes.bfloat16)  # a real 5% error
    v16 = compare(ref16, test16, rules.rule_for("attention", "layer", "bfloat16", "bfloat16")).to_dict()
    recs = _records({(1, "attention.gate"): dict(v32, status="pass" if v32["passed"] else "fail"),
                     (3, "attention"): dict(v16, status="pass" if v16["passed"] else "fail")})
    rows = {r["layer"]: r for r in layer_table(build_report(CFG, recs, dump="d.h5", target="t", mode="layer"))}
    assert not v32["passed"] and np.isfinite(rows[1]["max_diff_rms"]) and rows[1]["max_diff_rms"] < 1e-2  # not-a-bound: constructed data (a sign crossing at 1e-3 of the scale)
    assert rows[3]["max_diff_rms"] > 2e-2 > rows[1]["max_diff_rms"]  # not-a-bound: constructed data (a 5% error); the real error ranks first
    assert rows[1]["max_ulp"] > 100 * rows[3]["max_ulp"]  # what the old column showed: the other way round
    text = summary_text(build_report(CFG, recs, dump="d.h5", target="t", mode="layer"))
    assert "max |Δ|/RMS" in text and str(v32["max_ulp"]) not in text.split("max |Δ|/RMS")[1]
