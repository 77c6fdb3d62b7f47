"""Decoder LMs (Qwen2 / Qwen2.5 / Qwen3 / Llama) in Flax NNX, with HF parity.

Public API (other packages code against exactly this):

    from llds_jax.models import (DecoderConfig, Decoder, KVCache, init_cache,
                                 positions_from_mask, from_pretrained, save_pretrained)
    from llds_jax.models.logprobs import token_logprobs, sequence_logprobs
    from llds_jax.models.testing import tiny_config, tiny_model, TINY_FAMILIES

Config
    DecoderConfig(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                  intermediate_size, family="qwen2"|"qwen3"|"llama", rope_theta, rope_scaling,
                  rms_eps, tie_embeddings, qkv_bias, qk_norm, max_position_embeddings,
                  bos_token_id, eos_token_id, scan_layers=True, remat="none"|"full"|
                  "dots_saveable"|"nothing_saveable"|"minimal", dtype="float32", param_dtype="float32")
    DecoderConfig.from_hf_config(dict | config.json path | dir, **overrides); cfg.replace(**changes);
    cfg.to_hf_config() -> dict. Frozen and hashable (static under jit).

Model (``Decoder(config, rngs=nnx.Rngs(seed))``; ``model.config``)
    model(input_ids [B,T] int32, attention_mask [B,T] bool|int = all ones, positions=None)
        -> logits [B,T,V] fp32. Left or right padding; positions = cumsum(mask)-1 clipped at 0.
        Inference/tests only: training must use hidden_states + token_logprobs.
    model.hidden_states(input_ids, attention_mask=None, positions=None) -> [B,T,D] final-norm
        hidden states in compute dtype (no LM head).
    model.output_head() -> (table, vocab_major): the output projection in compute dtype, a tied
        model's embedding [V,D] as stored (vocab_major) or lm_head [D,V];
        logits = layers.unembed(hidden, table, vocab_major=vocab_major).
    model.forward_cached(tokens [B,T], cache, token_mask [B,T]=None, positions=None, *,
                         all_logits=False) -> (logits [B,V] in compute dtype (what the sampler
        draws from) at each row's last real token, or [B,T,V] with all_logits; new KVCache)
        Writes row b's T tokens at cache slots cache.end[b] ... and attends over valid slots
        at or before each token's slot. One call covers:
          (a) prefill of a left-padded batch: token_mask = attention_mask (pads -> invalid slots);
          (b) decode: tokens [B,1]; token_mask False for finished rows (cache not advanced);
          (c) appending a chunk (tool feedback) of up to T tokens per row, right-padded,
              token_mask marks each row's real tokens; end advances by the row's real count.
        positions default to the number of valid slots before each token, i.e. exactly the
        numbering of the uncached forward over the concatenated real tokens.
        Cached logits equal the uncached forward to <= 1e-4 (fp32, tested).
    KVCache(k, v: per-layer tuples of [B,KVH,S,Dh], valid [B,S] bool, end [B] int32) is a registered
        dataclass pytree, the dense reference of the rollout's PagedKVCache; cache.next_positions() -> [B];
        cache.layer_arrays() -> (k, v). init_cache(config, batch, max_len,
        dtype=None) -> empty cache (laid out by the rules table under jax.set_mesh).
        Writes beyond max_len are dropped: size the cache for the longest row.
    cache_logical_axes(cache): a KVCache of logical-axis tuples, one per buffer of cache; cache_shardings(config, batch,
        max_len, mesh, rules=None, dtype=None) -> KVCache of NamedShardings for jit boundaries.

Functional use inside jit (params as arguments, never closed over):
    graphdef, state = nnx.split(model)
    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state).forward_cached(tokens, cache)

Log-probs (``llds_jax.models.logprobs``)
    token_logprobs(hidden [B,T,D], unembed [D,V], targets [B,T], *, temperature=1.0,
                   chunk_size=128, with_entropy=True) -> (logp fp32 [B,T], entropy fp32 [B,T] | None)
        Sequence-chunked with remat: never builds fp32 [B,T,V]; differentiable. Logits are
        divided by temperature before the log-softmax (reference behaviour).
    sequence_logprobs(model, input_ids, attention_mask, ...) -> [B,T-1] scores of token t+1.

Weights (numpy only; HF safetensors directories and llama.cpp GGUF files)
    from_pretrained(path, dtype="float32", mesh=None, rules=None, **config_overrides) -> Decoder
        path: HF dir (config.json + *.safetensors [+ index]) or a .gguf file. With a mesh, each
        tensor is placed straight onto its sharding. Errors name the tensor / field.
    save_pretrained(model, path) -> writes config.json + model.safetensors that
        transformers.AutoModelForCausalLM loads with identical logits.

Parameter layout (dotted paths; stacked on a leading ``layers`` axis whatever scan_layers is):
    embed [V,D]; final_norm [D]; lm_head [D,V] (untied only);
    layers.{attn_norm,mlp_norm} [L,D]; layers.q_proj [L,D,H,Dh]; layers.{k,v}_proj [L,D,KVH,Dh];
    layers.o_proj [L,H,Dh,D]; layers.{q,k,v}_bias (qkv_bias); layers.{q,k}_norm [L,Dh] (qk_norm);
    layers.{gate,up}_proj [L,D,F]; layers.down_proj [L,F,D].
Every Param carries ``logical_axes`` metadata; see ``llds_jax.parallel`` for placement.
"""

from llds_jax.models.config import ConfigError, DecoderConfig
from llds_jax.models.decoder import (
    Decoder,
    KVCache,
    cache_logical_axes,
    cache_shardings,
    init_cache,
    params_in_compute_dtype,
    positions_from_mask,
)
from llds_jax.models.paged_cache import PagedKVCache, init_paged_pools, paged_pool_bytes

__all__ = [
    "cache_logical_axes",
    "params_in_compute_dtype",
    "cache_shardings",
    "ConfigError",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "PagedKVCache",
    "init_paged_pools",
    "paged_pool_bytes",
    "from_pretrained",
    "init_cache",
    "positions_from_mask",
    "save_pretrained",
]


def __getattr__(name):
    # Weight I/O pulls in gguf/safetensors readers; import them only when used.
    if name in ("from_pretrained", "save_pretrained"):
        from llds_jax.models import checkpoint_io

        return getattr(checkpoint_io, name)
    raise AttributeError(f"module 'llds_jax.models' has no attribute {name!r}")
