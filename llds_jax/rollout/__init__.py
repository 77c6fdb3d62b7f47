"""Search-R1 rollouts: the protocol, the batched multi-turn loop, the trajectory record, the reward.

Public API (the trainer and evaluation call exactly this)::

    from llds_jax.rollout import default_config, run_rollouts, RolloutBatch
    from llds_jax.rollout.reward import em_reward, exact_match, extract_answer, f1_reward, substring_em_reward

    cfg = default_config()            # ConfigDict: max_turns, max_action_tokens, max_obs_tokens,
                                      # max_prompt_tokens, max_context, topk, n_samples, temperature,
                                      # top_p, top_k, stop_token_ids, pad_to_multiple,
                                      # max_concurrent_rows, memory_fraction, cpu_memory_bytes,
                                      # prefill_chunk (the memory plan: rollout/kv_plan.py),
                                      # engine ("waves" | "continuous": rollout/engine.py), segment_tokens,
                                      # sampler_devices, kv_block_tokens, kv_blocks, slot_tokens, prefill_rows
    batch = run_rollouts(model_or_graphdef_params_or_policy, tokenizer, questions, retriever, cfg,
                         key=jax.random.key(0), group_ids=uids)

``batch`` (:class:`RolloutBatch`, numpy) has ``N = len(questions) * cfg.n_samples`` rows,
question-major (row ``i*n + j`` is sample ``j`` of question ``i``, ``group_ids[row]`` its
group), each laid out as prompt from column 0, response, right padding:

    input_ids, attention_mask           [N, L]  L a multiple of cfg.pad_to_multiple
    prompt_mask, action_mask, feedback_mask   disjoint; their union is attention_mask
    action_index                        [N, L]  0 on the first action, 1 on the second…, -1 elsewhere
    answer_mask                         [N, L]  last <answer>…</answer> the model wrote, tags incl.
    sampler_logprobs                    [N, L]  log-prob of the token at t under the sampling
                                                distribution (0 off actions)
    prompt_lengths, lengths, group_ids, turns, searches, search_actions_written, valid_actions,
    finished, truncated                 [N]     searches: executed; search_actions_written: parsed
                                                as a search, incl. the unexecuted last-turn one
    response_texts, action_texts, answers      host lists (answers: last model answer or None)
    action_feedback                     host list per row: the kind of feedback after action k
                                        ("search", "invalid", or None), recorded when appended
    timings                              seconds per phase; batch.stats() → logging means

Reward: ``exact_match(batch.answers[i], golds)`` if the answer is not None else 0 — the same
as ``em_reward`` on the model's own text; ``em_rewards(batch.answers, golds_per_row)`` does it
for the batch (``golds_per_row[r] = golds[r // cfg.n_samples]``).

Masks come from where ids were produced (sampler vs. tokenizer of feedback), never from
re-tokenising text; sampled ids are kept exactly (stop strings are detected during
decoding, ``llds_jax.sampling.stop_strings``).
"""

from llds_jax.rollout.config import default_config, terminator_ids
from llds_jax.rollout.multi_turn import Policy, make_policy, run_rollouts
from llds_jax.rollout.reward import em_reward, em_rewards, exact_match, extract_answer
from llds_jax.rollout.trajectory import RolloutBatch, Trajectory, collate

__all__ = [
    "Policy",
    "RolloutBatch",
    "Trajectory",
    "collate",
    "default_config",
    "em_reward",
    "em_rewards",
    "exact_match",
    "extract_answer",
    "make_policy",
    "run_rollouts",
    "terminator_ids",
]
