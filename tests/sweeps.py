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
        "MoE: moe_no_topk_renorm",
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
        "bf16 backward replay: the bundled tiny-flash-bf16 golden's backward points (pytest parity) and "
        "tests/test_mtp_backward.py::test_mtp_backward_replays_clean[bfloat16]",
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
    "tests/test_portlike_backward.py::test_planted_backward_bug_in_portlike_is_pinned[bfloat16]": "the float32 case",
    # the bundled goldens with the correct reference: layer mode is `pytest parity` itself (README command one, its
    # own step in .ci/run), isolated mode is tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode
    "tests/test_no_false_alarms.py::test_correct_target_passes_bundled_dump[*]":
        "`pytest parity` (layer; README command one, a step of .ci/run) and "
        "test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode",
    # no false alarms: one fresh seed forward, one backward case; LING3_FULL_SWEEP=1 runs seeds 11-20 and all 20
    # backward cases (that file's own switch)
    "tests/test_no_false_alarms.py::test_correct_target_passes_random_seed[12]": "seed 11",
    "tests/test_no_false_alarms.py::test_correct_target_passes_random_seed[13]": "seed 11",
    "tests/test_no_false_alarms.py::test_correct_target_passes_backward_points[14-bfloat16]":
        "bf16 backward: the bundled bf16 goldens' backward points (pytest parity) and tests/test_backward_mutations.py's "
        "clean baselines",
    # prefill split into pieces: each layer kind with one split and the decode split, both targets
    "tests/test_pieces.py::test_pieces_match_one_prefill[1-96+decode-portlike]": "1-96+decode-reference",
    "tests/test_pieces.py::test_pieces_match_one_prefill[3-64+36-reference]": "3-64+36-portlike",
    "tests/test_pieces.py::test_pieces_match_one_prefill[3-97+decode-portlike]": "3-97+decode-reference",
    # ---- the second round of issue 35 (README command two <= 15 min alone on 2 cores, cold JAX cache) ----
    # `LING3_FULL_SWEEP=1 python3 -m pytest -q -n 2 -m full_sweep` runs every case below (docs/performance.md "Test
    # suite time": not yet in .ci/run, see there why); seconds are this VM's cold-run worker seconds.
    # backward mutants: all eight stay in bf16, where their margins are thinnest (docs/numerics.md's table); fp32 ~94 s
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[*-float32]":
        "the same mutant's -bfloat16 case (the thinner margins)",
    # fine mutants in layer mode on bf16: kda_gate_bf16 stays as the layer-mode representative; each other one is
    # pinned by its own -bfloat16-isolated case (the two MoE ones are xfails in layer mode: isolated mode pins them)
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[kda_beta_bf16-bfloat16-layer]":
        "its -bfloat16-isolated case; layer mode: kda_gate_bf16-bfloat16-layer",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[moe_router_bf16-bfloat16-layer]":
        "its -bfloat16-isolated case (layer mode is an xfail)",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[moe_combine_bf16-bfloat16-layer]":
        "its -bfloat16-isolated case (layer mode is an xfail)",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[kda_l2norm_before_upcast-bfloat16-layer]":
        "its -bfloat16-isolated case; layer mode: kda_gate_bf16-bfloat16-layer",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[kda_o_norm_weight_bf16-bfloat16-layer]":
        "its -bfloat16-isolated case; layer mode: kda_gate_bf16-bfloat16-layer",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[norm_stats_bf16-bfloat16-layer]":
        "its -bfloat16-isolated case; layer mode: kda_gate_bf16-bfloat16-layer",
    # coarse KDA mutants: the gate (a_log_not_exp, softplus in decode), the conv (cache dropped), the norms
    # (l2norm_missing), the projections (q_proj_not_transposed) and the scale stay
    "tests/test_mutations.py::test_mutation_detected_and_localised[kda_conv_without_silu]": "conv: kda_conv_cache_dropped",
    "tests/test_mutations.py::test_mutation_detected_and_localised[kda_beta_not_sigmoided]": "gates: kda_a_log_not_exp",
    "tests/test_mutations.py::test_mutation_detected_and_localised[kda_o_norm_eps]":
        "norms: kda_l2norm_missing; the output norm: kda_o_norm_weight_bf16-bfloat16-isolated",
    # isolated mode on the bundled goldens: tiny-bf16 (the tiny preset, forward) stays (round four, below)
    "tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode[tiny-fp32]":
        "tiny-bf16 (the tiny preset, every layer kind in isolated mode)",
    # (round four: the bw_router_weight_detached case of test_isolated_backward is back in the slice — a MoE layer's
    # isolated backward points, the rest of them passing — since test_parity_modes' isolated tiny-flash-bf16 left it)
    # head / loss / embedding VJPs: T=100 of both checkpoints stay (no KDA path in them: T=40 adds a length only)
    "tests/test_backward_replay.py::test_head_loss_embed_vjp_match_twin[tiny-T40]": "tiny-T100 and tiny-flash-T100",
    # a wrong port on the chunk-kernel dump: one KDA bug stays
    "tests/test_kda_chunk_precision.py::test_wrong_port_still_fails_on_the_kernel_dump[kda_scale_missing]":
        "kda_a_log_not_exp",
    # the softplus gate form replayed clean: bf16 stays (its roundings are the harder case)
    "tests/test_gate_forms.py::test_the_reference_replays_a_softplus_gate_dump_clean[fp32]": "the bf16 case",
    # the routed experts' VJP vs plain AD of the dense path: the largest (N300k8E64) and the edge (N3k4E16-few) shapes
    # stay in both dtypes
    "tests/test_jax_moe_vjp.py::test_vjp_*[*N70k4E16-skewed]": "N300k8E64-random and N3k4E16-few",
    "tests/test_jax_moe_vjp.py::test_vjp_*[*N40k4E16-random]": "N300k8E64-random and N3k4E16-few",
    # the JAX MTP layer vs the official file: each checkpoint and each dtype once
    "tests/test_jax_mtp.py::test_jax_mtp_matches_the_official_file[tiny-mtp-bfloat16]":
        "tiny-mtp-float32 (tiny-mtp) and tiny-flash-bfloat16 (bf16)",
    "tests/test_pieces.py::test_pieces_match_one_prefill[1-40+60-portlike]": "1-40+60-reference and 3-64+36-portlike",
    # blocked routed experts bit-identical to the dense path: one golden per preset and dtype pair that differs
    "tests/test_jax_moe_fast.py::test_fast_path_bit_identical_to_dense_on_bundled_dumps[tiny-bf16.h5]":
        "tiny-fp32.h5 (tiny) and tiny-flash-bf16.h5 (bf16)",
    "tests/test_jax_moe_fast.py::test_fast_path_bit_identical_to_dense_on_bundled_dumps[tiny-flash-fp32.h5]":
        "tiny-flash-bf16.h5 (tiny-flash) and tiny-fp32.h5 (fp32)",
    "tests/test_jax_moe_fast.py::test_fast_path_bit_identical_to_dense_on_bundled_dumps[tiny-flash-official-bf16.h5]":
        "tiny-flash-bf16.h5 (same shapes)",
    # grouped KDA heads bit-identical: each group count once, the recurrent path (T=64) once
    "tests/test_jax_kda_memory.py::test_grouped_heads_bit_identical[1-200-True]": "1-100-True",
    "tests/test_jax_kda_memory.py::test_grouped_heads_bit_identical[2-64-False]": "2-100-True and 1-64-False",
    "tests/test_jax_kda_memory.py::test_grouped_heads_bit_identical[2-200-True]": "2-100-True",
    "tests/test_jax_kda_memory.py::test_grouped_heads_bit_identical[4-64-False]": "4-100-True and 1-64-False",
    "tests/test_jax_kda.py::test_chunked_recurrent_split_agree[200]": "63, 64, 65 (the chunk boundary) and 1",
    "tests/test_repro.py::test_a_decode_point_is_fed_its_earlier_state[decode/S002/L03/attention.core-isolated]":
        "L00 isolated (isolated mode) and L03 layer (the MLA cache)",
    "tests/test_repro.py::test_bundle_reproduces_the_failure_standalone[isolated]": "the layer case",
    # end-to-end runs of a capability whose parts keep their own tests in the slice
    "tests/test_triage.py::test_one_run_of_an_fp32_and_a_bf16_dump_triages_a_port":
        "tests/test_triage.py's classification and pairing tests (the verdicts the run prints)",
    "tests/test_mtp_semantics_replay.py::test_a_real_bug_on_a_clamped_layer_stays_a_failure_under_intended_semantics":
        "tests/test_mtp_semantics_replay.py::test_a_backward_bug_on_a_clamped_layer_stays_a_failure_under_intended_"
        "semantics (the same rule on the same clamped layer)",
    "tests/test_watchdog.py::test_a_call_blocked_in_xla_fails_with_its_stacks_and_later_calls_fail_at_once":
        "tests/test_watchdog.py::test_pytest_parity_fails_the_stalled_layer_and_finishes (a stall end to end)",
    "tests/test_gpu_check.py::test_cpu_only_run_end_to_end": "tests/test_gpu_check.py's stage and budget tests",
    "tests/test_portlike_backward.py::test_golden_replays_clean_through_the_plugin_with_portlike":
        "tests/test_portlike_backward.py::test_planted_backward_bug_in_portlike_is_pinned[float32] (the correct port's "
        "forward and backward points of a KDA layer replay clean first)",
    "tests/test_sharded_replay.py::test_sharded_replay_gives_the_same_verdicts":
        "tests/test_jax_mesh.py (layers on an 8-device mesh give the single-device bits)",
    "tests/test_bench.py::test_bench_children_pinned_and_table": "tests/test_bench.py::test_bench_dump_child_times_the_writer",
    # the no-false-alarm sweeps' own checks that they can fail: they run with the sweeps (LING3_FULL_SWEEP=1)
    "tests/test_no_false_alarms.py::test_*sweep_detects_a_broken_subject":
        "tests/test_no_false_alarms.py (the kept seeds); these check the full sweep itself",
    # ---- round two: what the estimate from the cold profile still needed ----
    # (the bundled goldens' backward points were beyond the slice here; since round four no golden point is in README
    # command two's collection: `pytest parity`, README command one, replays every one of them as a step of .ci/run)
    # backward mutants in bf16: one per part of the backward stays (the KDA gate, the thinnest margin; the MLA head
    # gate; the router weights; the embedding gradient)
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[bw_shared_expert_grad_twice-bfloat16]":
        "the MoE backward: tests/test_jax_moe_vjp.py (shown to fail for a broken VJP)",
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[bw_kda_beta_detached-bfloat16]":
        "bw_kda_gate_detached-bfloat16 (the KDA backward, the thinnest margin)",
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[bw_kda_chunk_vjp_dg_sign-bfloat16]":
        "bw_kda_gate_detached-bfloat16 (the KDA backward, the thinnest margin)",
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[bw_attn_residual_detached-bfloat16]":
        "bw_mla_gate_detached-bfloat16 and bw_kda_gate_detached-bfloat16 (a detached path in the attention block)",
    "tests/test_mutations.py::test_mutation_detected_and_localised[kda_q_proj_not_transposed]":
        "KDA coarse bugs: kda_a_log_not_exp, kda_l2norm_missing",
    "tests/test_mutations.py::test_mutation_detected_and_localised[kda_scale_missing]":
        "KDA core: kda_l2norm_missing",
    "tests/test_variants.py::test_planted_single_rounding_passes_as_variant_and_fails_strict":
        "tests/test_variants.py::test_variant_shadow_explains_only_what_the_variant_gives (the variant rule)",
    "tests/test_taps.py::test_portlike_broken_variant_fails_at_its_site[*]":
        "tests/test_gate_forms.py::test_a_reference_told_the_wrong_gate_form_fails_at_the_gate (the same softplus "
        "gate bug at its site)",
    "tests/test_precision_shadow.py::test_mutants_compiled_under_xla_defaults_still_fail_at_their_site[*]":
        "tests/test_precision_shadow.py::test_reference_under_xla_defaults_is_more_precise_not_failed (the reference "
        "compiled under XLA's defaults); detection: tests/test_mutations.py",
    "tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode[tiny-flash-fp32]":
        "tiny-bf16 (every layer kind in isolated mode)",
    "tests/test_isolated_backward.py::test_isolated_mode_replays_every_backward_point_of_a_layer":
        "tests/test_isolated_backward.py::test_a_backward_bug_fails_exactly_the_points_its_vjp_computes: its "
        "bw_kda_gate_detached (layer 0, KDA + dense) and bw_router_weight_detached (layer 2, KDA + MoE) cases (every "
        "backward point of the layer other than the bug's passes)",
    "tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode[tiny-flash-official-bf16]":
        "tiny-bf16 (every layer kind in isolated mode); the official runtime's dump in isolated mode: "
        "tests/test_isolated_backward.py::test_points_isolated_mode_cannot_replay_are_skipped_saying_why",
    "tests/test_no_false_alarms.py::test_correct_target_passes_backward_points[11-float32]":
        "tests/test_backward_mutations.py's clean baselines (the correct reference replays each mutant's unit of the "
        "goldens clean first); every golden backward point: README command one",
    # fine mutants in fp32 isolated: these bugs are bf16 precision losses (each -bfloat16-isolated case pins it);
    # mla_lora_norm_eps, a bug in fp32 too, keeps its fp32 isolated case
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[kda_gate_bf16-float32-isolated]":
        "kda_gate_bf16-bfloat16-isolated; fp32: mla_lora_norm_eps-float32-isolated",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[kda_beta_bf16-float32-isolated]":
        "kda_beta_bf16-bfloat16-isolated; fp32: mla_lora_norm_eps-float32-isolated",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[moe_combine_bf16-float32-isolated]":
        "moe_combine_bf16-bfloat16-isolated; fp32: mla_lora_norm_eps-float32-isolated",
    "tests/test_mutations.py::test_fine_mutation_detected_and_pinned[moe_router_bf16-float32-isolated]":
        "moe_router_bf16-bfloat16-isolated; fp32: mla_lora_norm_eps-float32-isolated",
    # ---- round three ----
    "tests/test_mtp_backward.py::test_planted_mtp_backward_bug_is_caught[reference+mtp-scale-ignored-bfloat16]":
        "the mtp-hidden-detached and mtp-share-ignored bf16 cases",
    "tests/test_mtp_backward.py::test_mtp_backward_replays_clean[float32]": "the bfloat16 case",
    "tests/test_mtp_semantics_replay.py::test_a_target_without_mtp_skips_the_mtp_points_saying_so":
        "tests/test_mtp_backward.py::test_a_target_without_the_mtp_backward_skips_its_points_saying_so (MTP points "
        "skipped naming the missing method)",
    "tests/test_backward_mutations.py::test_backward_mutant_pinned_on_golden[bw_router_weight_detached-bfloat16]":
        "tests/test_jax_moe_vjp.py (the routed experts' VJP vs plain AD, shown to fail for a broken VJP)",
    "tests/test_backward_e2e.py::test_grads_dump_replays_clean[float32]":
        "tests/test_backward_mutations.py's clean baselines (the correct reference replays the goldens' units clean) "
        "and tests/test_mtp_backward.py (a fresh --grads dump replayed clean)",
    "tests/test_mutations.py::test_mutation_detected_and_localised[moe_shared_expert_scaled]":
        "MoE: moe_no_topk_renorm",
    # ---- round four (README command two <= 15 min: the golden points moved to their own .ci/run step, above) ----
    # isolated mode on the goldens: tiny-bf16 (every layer kind, forward) stays; isolated backward points: the two
    # cases of test_isolated_backward (the tiny-flash-bf16 golden in isolated mode, layers 0 and 2: the bug's VJP points
    # fail and every other backward point of the layer passes)
    "tests/test_parity_modes.py::test_bundled_dump_passes_in_isolated_mode[tiny-flash-bf16]":
        "tiny-bf16 (isolated forward); isolated backward: tests/test_isolated_backward.py::test_a_backward_bug_fails_"
        "exactly_the_points_its_vjp_computes (KDA + dense and KDA + MoE layers of this golden)",
    # the layer VJP against the twin's autograd: tiny-flash-T100 stays (KDA+MoE and MLA+MoE); the tiny preset's layer
    # VJPs (q-LoRA, the SwiGLU clamp) are replayed clean against the official file's autograd by
    # tests/test_official_backward.py's tiny-100-float32 case
    "tests/test_backward_replay.py::test_layer_vjp_matches_twin_autograd[tiny-T100]":
        "tiny-flash-T100; the tiny preset: tests/test_official_backward.py::test_official_grads_dump_replays_clean"
        "[tiny-100-float32]",
    # the triage of a precision loss: tests/test_triage.py's classification tests and the kda_l2norm_before_upcast
    # fine mutant's bf16 isolated case (pinned) with its fp32 xfail (no bug in fp32)
    "tests/test_precision_shadow.py::test_l2norm_before_upcast_triages_as_precision":
        "tests/test_triage.py (precision vs bug classification) and tests/test_mutations.py's kda_l2norm_before_upcast "
        "cases",
    # an edited site is the first divergence: the bf16 golden stays (its rounding is the harder case)
    "tests/test_replay_acceptance.py::test_edited_site_is_the_first_divergence_and_its_source[tiny-fp32.h5-*]":
        "the tiny-bf16.h5 case",
    # the JAX MTP layer vs the twin in bf16: tests/test_mtp_backward.py's bf16 replay of a fresh tiny-flash --grads dump
    # (the MTP layer's forward points vs the twin's) stays; fp32 vs the twin: tiny-mtp-float32
    "tests/test_jax_mtp.py::test_jax_mtp_matches_the_twin[tiny-flash-bfloat16]":
        "tiny-mtp-float32; bf16: tests/test_mtp_backward.py::test_mtp_backward_replays_clean[bfloat16]",
    # golden regeneration: the twin's fp32 --grads (tiny-fp32.h5) and the official runtime's bf16 (tiny-flash-official-
    # bf16.h5, the tiny-flash preset) stay; the twin's bf16 --grads path is the same dumper code as both
    "tests/test_golden_dumps.py::test_regeneration_*[tiny-flash-bf16.h5]":
        "tiny-fp32.h5 (the twin, --grads) and tiny-flash-official-bf16.h5 (bf16, tiny-flash)",
    # an explicit xdist grouping option: the default grouping (one worker per layer) stays, and .ci/run's
    # `pytest parity -n 2` step runs it on every golden
    "tests/test_plugin_xdist.py::test_an_explicit_loadgroup_groups_too":
        "tests/test_plugin_xdist.py::test_a_layers_points_run_on_one_worker (the same grouping, by default)",
}


def beyond_slice(nodeid: str) -> str | None:
    """The reason a test case is beyond the default slice (None: it is in it)."""
    from fnmatch import fnmatchcase

    for pattern, why in BEYOND_SLICE.items():
        if fnmatchcase(nodeid, pattern.replace("[", "[[]")):
            return why
    return None
