"""The representative slice of the long sweeps (issue 35: README command two stays quick on 2 cores).

Each pattern below (fnmatch on the test's node id) names a case *beyond* the default slice: tests/conftest.py marks
it `full_sweep` and skips it, saying so, unless `LING3_FULL_SWEEP=1` (then everything runs, as before). What stays
in the default run covers every mechanism each sweep tests — one case per bug family, per code path, per dtype —
and the reason beside each pattern says which kept case covers what the skipped one adds.
"""

from __future__ import annotations

BEYOND_SLICE: dict[str, str] = {
    # porting-bug catalogue: one mutant per family and path stays (KDA: all nine, cheap; MLA: gate missing, decode
    # RoPE position; MoE: top-k renorm, shared-expert scale)
    "tests/test_mutations.py::test_mutation_detected_and_localised[swiglu_clamp_missing]":
        "clamp: tests/test_jax_model.py::test_tiny_flash_clamp_matters",
    "tests/test_mutations.py::test_mutation_detected_and_localised[rope_not_interleaved]":
        "RoPE: mla_decode_rope_position_zero",
    "tests/test_mutations.py::test_mutation_detected_and_localised[moe_no_group_limit]": "MoE router: moe_no_topk_renorm",
    "tests/test_mutations.py::test_mutation_detected_and_localised[moe_routed_scaling_twice]":
        "MoE combine: moe_shared_expert_scaled",
    "tests/test_mutations.py::test_mutation_detected_and_localised[moe_expert_bias_in_weights]":
        "MoE router: moe_no_topk_renorm",
    "tests/test_mutations.py::test_mutation_detected_and_localised[mla_gate_no_sigmoid]": "MLA gate: mla_gate_missing",
    "tests/test_mutations.py::test_mutation_detected_and_localised[mla_gate_after_dense]": "MLA gate: mla_gate_missing",
    "tests/test_mutations.py::test_mutation_detected_and_localised[mtp_as_last_layer]":
        "MTP: tests/test_mtp_semantics_replay.py::test_a_broken_mtp_layer_is_caught_at_eh_proj",
    # fine (precision) mutants: the bf16 runs and the isolated fp32 run stay; fp32 layer mode of a bf16 precision loss
    # is the reference's own maths (expected to pass) — the isolated fp32 case checks the same
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[*-float32-layer]": "fp32: the -float32-isolated case",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[mla_lora_norm_eps-bfloat16-*]":
        "mla_lora_norm_eps: its float32-isolated case pins it",
    # backward mutants: tests/test_backward_mutations.py checks on the goldens (tiny-fp32, tiny-flash-bf16: the same
    # checkpoints, T=100, both dtypes) everything the end-to-end cases check on fresh dumps — forward bit-identical,
    # the correct reference clean, pinned at the expected site — plus the margin; the goldens' compiled layers are
    # shared with `pytest parity`
    "tests/test_backward_e2e.py::test_backward_mutant_forward_identical_and_pinned[*]":
        "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden (every mutant, both dtypes)",
    "tests/test_backward_e2e.py::test_grads_dump_replays_clean[bfloat16]":
        "bf16 backward replay: the bundled tiny-flash-bf16 golden's backward points (pytest parity)",
    # twin vs the built-in's gradients (each built-in run is computed on first use): fp64 keeps each preset once and
    # each KDA path once (tiny chunked, tiny-flash recurrent); fp32 keeps tiny-flash chunked, whose runs the
    # backward-only-bug detection cases share
    "tests/test_backward_dump.py::test_twin_gradients_match_builtin_fp64[tiny-T40_recurrent]":
        "fp64: tiny-T100_chunked (tiny) and tiny-flash-T40_recurrent (the recurrent path)",
    "tests/test_backward_dump.py::test_twin_gradients_match_builtin_fp64[tiny-flash-T100_chunked]":
        "fp64: tiny-T100_chunked (the chunked path) and tiny-flash-T40_recurrent (tiny-flash)",
    "tests/test_backward_dump.py::test_twin_fp32_gradients_as_accurate_as_builtin[tiny-T*]":
        "fp32: tiny-flash-T100_chunked",
    "tests/test_backward_dump.py::test_twin_fp32_gradients_as_accurate_as_builtin[tiny-flash-T40_recurrent]":
        "fp32: tiny-flash-T100_chunked",
    "tests/test_official_backward.py::test_official_grads_dump_replays_clean[tiny-flash-40-bfloat16]":
        "the official file's fp32 --grads dump stays",
    # the layer VJP against the twin's autograd: T=100 of both checkpoints (the chunked KDA backward; tiny's shapes
    # are the golden's, so its compiled layers are shared); the recurrent path's backward is replayed clean by
    # tests/test_no_false_alarms.py's backward seed 11 (T=40)
    "tests/test_backward_replay.py::test_layer_vjp_matches_twin_autograd[tiny-T40]":
        "tiny-T100 and tiny-flash-T100; the recurrent backward: tests/test_no_false_alarms.py seed 11 (T=40)",
    # -0.0 probes leave the forward bits: bf16 stays (its roundings are where an added +0.0/-0.0 could show)
    "tests/test_backward_replay.py::test_zero_probes_leave_the_forward_bit_identical[float32]": "the bfloat16 case",
    # --grads leaves the forward bits: bf16 stays (the dtype whose kernels change most with autograd on)
    "tests/test_backward_dump.py::test_forward_points_bit_identical_with_and_without_grads[float32]":
        "the bfloat16 case",
    # the official file's --grads dump: tiny-flash stays (its MTP layer, the clamp lists, the no_grad MoE path)
    "tests/test_backward_dump.py::test_official_grads_dump[tiny]":
        "the tiny-flash case; tiny (q-LoRA) official --grads: tests/test_official_backward.py tiny-100-float32",
    # golden regeneration (structure, and the tensors' bits on the MANIFEST's CPU kind): the twin fp32 --grads, the
    # twin bf16 --grads and the official-runtime goldens stay; the two left are the same dumper paths without --grads
    "tests/test_golden_dumps.py::test_regeneration_*[tiny-bf16.h5]": "tiny-fp32.h5 (tiny) and tiny-flash-bf16.h5 (bf16)",
    "tests/test_golden_dumps.py::test_regeneration_*[tiny-flash-fp32.h5]":
        "tiny-flash-bf16.h5 (tiny-flash) and tiny-fp32.h5 (fp32)",
    # the official file vs the twin: each preset, each KDA path (T=40 recurrent, T=100 chunked), each dtype once
    "tests/test_official.py::test_official_dump_is_complete_and_equals_the_twin[tiny-40-float32]":
        "tiny-flash-40-float32 (recurrent) and tiny-100-bfloat16 (tiny)",
    "tests/test_official.py::test_official_dump_is_complete_and_equals_the_twin[tiny-100-float32]":
        "tiny-100-bfloat16 (tiny, chunked) and tiny-flash-40-float32 (fp32)",
    "tests/test_official.py::test_official_dump_is_complete_and_equals_the_twin[tiny-flash-100-*]":
        "tiny-100-bfloat16 (chunked, bf16) and tiny-flash-40-float32 (tiny-flash)",
    # planted MTP-backward bugs (issue 33 item 3): every bug in bf16 stays; fp32 catches them at the same points (the
    # same replay code; their fp32 ULP numbers are in the 2026-11-28 CHANGELOG entry)
    "tests/test_mtp_backward.py::test_planted_mtp_backward_bug_is_caught[*-float32]": "the same bug's bfloat16 case",
    # the JAX MTP layer vs the twin: each checkpoint and each dtype once
    "tests/test_jax_mtp.py::test_jax_mtp_matches_the_twin[tiny-flash-float32]":
        "tiny-flash-bfloat16 (tiny-flash) and tiny-mtp-float32 (fp32)",
    "tests/test_jax_mtp.py::test_jax_mtp_matches_the_twin[tiny-mtp-bfloat16]":
        "tiny-mtp-float32 (tiny-mtp) and tiny-flash-bfloat16 (bf16)",
    # a port through taps: the bf16 golden stays (its rounding is the harder case); one broken variant stays
    "tests/test_taps.py::test_portlike_replays_bundled_dumps_through_taps[tiny-fp32.h5]": "the bf16 golden case",
    "tests/test_taps.py::test_portlike_broken_variant_fails_at_its_site[unbiased_routing-*]": "softplus_gate case",
    "tests/test_portlike_backward.py::test_planted_backward_bug_in_portlike_is_pinned[bfloat16]": "the float32 case",
    # the bundled goldens with the correct reference: layer mode is `pytest parity` itself (parity/test_points.py, in
    # the same run), isolated mode is tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode
    "tests/test_no_false_alarms.py::test_correct_target_passes_bundled_dump[*]":
        "parity/test_points.py (layer) and test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode",
    # no false alarms: one fresh seed forward, one backward case; LING3_FULL_SWEEP=1 runs seeds 11-20 and all 20
    # backward cases (that file's own switch)
    "tests/test_no_false_alarms.py::test_correct_target_passes_random_seed[12]": "seed 11",
    "tests/test_no_false_alarms.py::test_correct_target_passes_random_seed[13]": "seed 11",
    "tests/test_no_false_alarms.py::test_correct_target_passes_backward_points[14-bfloat16]":
        "bf16 backward: the bundled bf16 goldens' backward points (pytest parity)",
    # prefill split into pieces: each layer kind with one split and the decode split, both targets
    "tests/test_pieces.py::test_pieces_match_one_prefill[1-96+decode-portlike]": "1-96+decode-reference",
    "tests/test_pieces.py::test_pieces_match_one_prefill[3-64+36-reference]": "3-64+36-portlike",
    "tests/test_pieces.py::test_pieces_match_one_prefill[3-97+decode-portlike]": "3-97+decode-reference",
}


def beyond_slice(nodeid: str) -> str | None:
    """The reason a test case is beyond the default slice (None: it is in it)."""
    from fnmatch import fnmatchcase

    for pattern, why in BEYOND_SLICE.items():
        if fnmatchcase(nodeid, pattern.replace("[", "[[]")):
            return why
    return None
