"""The tests whose result can differ between XLA:CPU code generators: numeric kernels, reductions,
sampler arithmetic, objective values and gradients. ``launch/test.sh`` runs them under two: this host's
default (the one a user's CPU run gets) and a second one (AVX2, 128-bit vectors, one Eigen thread,
XLA's element-wise fusion emitters, LLVM optimisation level 0), where reduction order and rounding
differ, so their tolerances must come from the quantities and not from one CPU's rounding.

Every other test runs once, under the second code generator, which compiles about 4× faster (but
:data:`DEFAULT_CODEGEN_ONLY`, which reads XLA:CPU's cost analysis as a target's model): its
outcome cannot depend on how XLA:CPU turns a program into machine code — config and error messages,
exit codes, checkpoints, compile counts and traced-program sizes, HLO layout or loop structure,
sharding specs, compile-only TPU/GPU programs (the same HLO and memory figures under either code
generator: ``tests/scale/test_second_codegen.py``), integer index bookkeeping, the stop-string byte
automaton, and results compared with another run under the same code generator.

``tests/conftest.py`` marks each test named here ``codegen_sensitive`` (a module maps to ``ALL`` or
to test function names) and refuses a name its module no longer defines, so the list cannot rot.
"""

import os

ALL = "all"

# launch/test.sh's numeric step runs the modules holding slow tests first, then these in this order (long ones early).
CODEGEN_SENSITIVE: dict[str, str | tuple[str, ...]] = {
    "tests/sampling/test_session.py": (
        "test_cutting_an_action_continues_as_if_decoding_had_stopped_at_the_cut",
        "test_session_continuation_equals_one_forward_over_the_whole_conversation",
    ),
    "tests/models/test_reductions.py": ALL,
    "tests/models/test_hf_parity.py": ALL,
    "tests/models/test_kv_cache.py": ALL,
    "tests/models/test_attention_decoder.py": ALL,
    "tests/models/test_attention.py": (
        "test_a_key_block_cache_skips_blocks_past_the_furthest_query_and_equals_naive",
        "test_a_query_block_never_reads_keys_past_its_own_last_query",
        "test_blockwise_matches_naive_on_left_and_right_padding",
        "test_blockwise_matches_naive_over_a_cache_with_holes",
        "test_causal_by_index_and_segment_ids_equal_our_mask_on_real_tokens",
        "test_cudnn_packed_layout_matches_naive_on_packed_rows",
        "test_cudnn_path_falls_back_to_blockwise_when_a_row_has_a_hole",
        "test_cudnn_rotation_to_right_padding_matches_naive",
        "test_decode_never_reads_key_blocks_past_the_furthest_query",
        "test_float32_queries_under_cudnn_run_the_blockwise_kernel",
        "test_query_blocked_self_attention_matches_naive_on_left_and_right_padding",
        "test_query_with_no_visible_key_is_finite",
        "test_splash_kernel_keeps_packed_trajectories_apart_in_the_pallas_interpreter",
        "test_splash_kernel_matches_naive_in_the_pallas_interpreter",
    ),
    "tests/models/test_compute_dtype_params.py": (
        "test_bf16_compute_with_precast_weights_is_bit_identical",
        "test_the_gradient_through_weights_cast_once_is_the_masters_gradient",
    ),
    "tests/models/test_decode_tpu.py": (  # the Pallas kernel in the interpreter on this CPU
        "test_a_slot_past_the_cache_is_dropped_like_the_scatter_drops_it",
        "test_attend_cached_on_the_blockwise_path_equals_the_kernel",
        "test_each_row_reads_only_its_own_live_blocks",
        "test_kernel_matches_the_oracle_and_writes_what_the_scatter_writes",
        "test_the_decoder_through_the_kernel_decodes_what_it_decodes_through_blockwise",
    ),
    "tests/models/test_decoder.py": ("test_remat_and_scan_leave_gradients_unchanged",),
    "tests/models/test_gguf_import.py": (
        "test_gguf_written_like_llama_cpp_loads_to_the_same_logits",
        "test_unpermuting_is_needed_for_llama",
    ),
    "tests/models/test_logprobs.py": (
        "test_chunked_gradients_equal_naive_softmax",
        "test_chunked_values_equal_naive_softmax",
        "test_sequence_logprobs_scores_the_next_token_of_a_decoder",
    ),
    "tests/parallel/test_sharding.py": ("test_forward_on_mesh_equals_single_device",),
    "tests/rl/test_objective_matches_torch_reference.py": ALL,
    "tests/rl/test_accumulation.py": ALL,
    "tests/rl/test_llds_properties.py": ALL,
    "tests/rl/test_policy_losses.py": ALL,
    "tests/rl/test_advantages.py": (
        "test_constant_reward_group_gets_exactly_zero_even_for_inexact_floats",
        "test_estimators_match_loop_over_groups_reference",
        "test_group_of_one_has_mean_zero_and_std_one",
        "test_grpo_advantages_sum_to_zero_per_group_and_follow_row_permutations",
        "test_grpo_uses_unbiased_std_by_default",
        "test_padding_rows_get_zero_and_do_not_shift_their_group",
        "test_two_prompts_with_different_ids_are_never_merged",
    ),
    "tests/rl/test_action_runs.py": (
        "test_run_sums_match_a_loop_over_runs",
        "test_sum_over_runs_gives_each_action_token_its_run_total_and_zero_elsewhere",
    ),
    "tests/rl/test_objective_compilation.py": (
        "test_lambda_passed_through_batch_constants_changes_without_recompiling",
        "test_metrics_are_finite_on_an_all_padding_batch",
    ),
    "tests/rl/test_reinforce_pp.py": (
        "test_advantages_carry_no_gradient_into_the_log_probs",
        "test_an_all_equal_group_keeps_its_signal_unlike_grpo",
        "test_the_objective_reads_token_advantages_as_given",
        "test_token_advantages_match_the_paper",
    ),
    "tests/rl/test_rollout_correction.py": (
        "test_batch_constants_drop_masked_tokens_from_the_denominator",
        "test_host_metrics_report_what_token_tis_would_cap_when_off",
        "test_masked_tokens_leave_every_term_and_its_denominator",
        "test_none_ignores_the_log_ratio_and_is_the_default",
        "test_pg_loss_and_gradient_are_the_weighted_surrogate",
        "test_weights_match_verl_formulas",
    ),
    "tests/sampling/test_filtering.py": (
        "test_cut_offs_match_the_definition_with_ties_and_masked_tokens",
        "test_greedy_takes_argmax_and_reports_the_model_logprob",
        "test_kept_sets_match_transformers_warpers",
        "test_sampling_frequencies_follow_the_filtered_distribution",
        "test_sampling_with_a_fixed_key_is_reproducible",
        "test_temperature_scales_logits_before_filtering",
        "test_top_k_applies_before_top_p",
        "test_top_k_keeps_the_k_most_likely_tokens",
        "test_top_p_keeps_the_smallest_prefix_reaching_p",
        "test_top_p_one_keeps_every_token_after_top_k",
    ),
    "tests/sampling/test_generate.py": (
        "test_greedy_matches_transformers_generate_on_left_padded_batch",
        "test_logprobs_are_the_models_logprobs_at_temperature_one",
        "test_sampled_decoding_with_a_fixed_key_is_reproducible",
    ),
    "tests/train/test_update_step.py": (
        "test_adaptive_ma_reads_searches_over_the_scope_the_config_names",
        "test_first_step_reads_pi_old_as_pi_ref_and_later_steps_run_the_reference_pass",
        "test_llds_is_zero_in_first_mini_batch_and_nonzero_later",
        "test_non_finite_loss_skips_the_update_and_counts_it",
        "test_one_step_on_mesh_equals_single_device",
        "test_raised_llds_lambda_applies_without_recompiling_and_survives_a_checkpoint",
    ),
    "tests/train/test_scored_positions.py": (
        "test_a_compacted_sft_step_equals_the_full_one",
        "test_compacted_step_equals_the_full_step",
    ),
    "tests/train/test_apply_update.py": (
        "test_a_finite_step_is_clipped_adamw",
        "test_a_non_finite_step_leaves_params_and_moments_bit_identical",
    ),
}

# Tests that read XLA:CPU's cost analysis as the model of a real target (the roofline tool's XLA:CPU rows): the
# second code generator charges an in-place cache write differently, so they run under the default one only.
DEFAULT_CODEGEN_ONLY: dict[str, str | tuple[str, ...]] = {
    "tests/tools/roofline/test_roofline.py": (
        "test_xla_charges_a_lookup_the_whole_table_and_an_in_place_cache_write_the_whole_cache",
        "test_report_runs_for_a_tiny_model_on_xla_cpu",
        "test_scored_programs_drop_at_least_the_head_work_the_ideal_drops",
    ),
}

# launch/test.sh's second code generator (with 8 simulated devices): another ISA and vector width, one Eigen
# thread, XLA:CPU's element-wise fusion emitters instead of its MLIR ones, and no LLVM optimisation — the
# last two cut compile time (≈ 70 % of the suite under the default alone) about 4× (a tiny update step: 6.4 → 1.6 s).
SECOND_CODEGEN = ("--xla_cpu_max_isa=AVX2 --xla_cpu_prefer_vector_width=128 --xla_cpu_multi_thread_eigen=false "
                  "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0")


def child_xla_flags(devices: int | None = None, *, min_llvm_level: int | None = None) -> str:
    """XLA_FLAGS for a child process: this process's code generator, with ``devices`` simulated CPU devices
    (None: XLA's default of one, as a user's run has); ``min_llvm_level`` raises an explicit lower LLVM
    optimisation level (the second code generator's 0) to it.

    Children compile as the test process does: in paired runs under the second code generator, level 0 was
    faster for the CLI-mode and fault-recovery children (``--mode=plan`` of the default job most of all) and
    within run-to-run noise for the two-process training ones; only the device check's dry run, which runs
    each part of the GPU check over Qwen's 151,936-token vocabulary, came out clearly faster at level 1.
    """
    prefix = "--xla_backend_optimization_level="
    flags = []
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_force_host_platform_device_count="):
            continue
        if min_llvm_level is not None and flag.startswith(prefix) and int(flag[len(prefix):]) < min_llvm_level:
            flag = f"{prefix}{min_llvm_level}"
        flags.append(flag)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
