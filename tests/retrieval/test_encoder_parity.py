"""The JAX BERT encoder reproduces transformers' PyTorch `BertModel` (fp32, ≤1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from llds_jax.models.encoder import BertConfig  # noqa: E402
from llds_jax.models.encoder_weights import load_bert_encoder  # noqa: E402
from llds_jax.retrieval.embedder import EmbedderOptions, TextEmbedder  # noqa: E402
from llds_jax.utils.assets import minilm_dir  # noqa: E402

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
SENTENCES = [
    "who got the first nobel prize in physics?",
    '"Nobel Prize in Physics"\nThe Nobel Prize in Physics is a yearly award given by the Royal Swedish Academy.',
    "a",
    "Padithal Mattum Podhuma () is a 1962 Indian Tamil language film directed by A. Bhimsingh. " * 6,
]


def max_masked_diff(ours: np.ndarray, reference: np.ndarray, mask: np.ndarray) -> float:
    return float(np.abs(ours - reference)[mask.astype(bool)].max())


@pytest.fixture(scope="module")
def tiny_random_bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64, type_vocab_size=2)
    model = transformers.BertModel(config).eval()
    folder = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.unit
def test_tiny_random_bert_hidden_states_match_pytorch(tiny_random_bert_dir):
    folder, reference = tiny_random_bert_dir
    ours = load_bert_encoder(folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 101, size=(3, 20))
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 3:] = 0
    types = rng.integers(0, 2, size=ids.shape)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             token_type_ids=torch.tensor(types)).last_hidden_state.numpy()
    got = np.asarray(ours(ids, mask, types))
    assert max_masked_diff(got, expected, mask) <= TOLERANCE


def torch_sentence_vectors(model_dir, texts, pooling):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.BertModel.from_pretrained(str(model_dir)).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        mask = batch["attention_mask"][..., None].float()
        vectors = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(vectors, dim=-1).numpy()


def test_real_minilm_loads_through_from_pretrained_and_matches_pytorch():
    embedder = TextEmbedder.from_pretrained(minilm_dir(), EmbedderOptions(batch_size=4))
    got = embedder.encode(SENTENCES)
    assert np.abs(got - torch_sentence_vectors(minilm_dir(), SENTENCES, "mean")).max() <= TOLERANCE


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_real_minilm_sentence_vectors_match_pytorch(make_embedder, pooling):
    embedder = make_embedder(pooling=pooling, batch_size=4)
    got = embedder.encode(SENTENCES)
    expected = torch_sentence_vectors(minilm_dir(), SENTENCES, pooling)
    assert np.abs(got - expected).max() <= TOLERANCE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_a_vector_does_not_depend_on_what_else_is_in_the_batch(minilm_embedder):
    embedder = minilm_embedder
    alone = embedder.encode([SENTENCES[0]])
    batched = embedder.encode(SENTENCES + SENTENCES[:1])
    assert np.abs(batched[0] - alone[0]).max() <= 1e-5 and np.abs(batched[-1] - alone[0]).max() <= 1e-5


def test_padding_from_tokenizer_json_is_ignored_and_shapes_stay_bucketed(make_embedder):
    embedder = make_embedder(batch_size=8, max_length=256)
    embedder.encode(["short query"])
    embedder.encode([f"query number {i}" for i in range(5)])
    assert embedder.compiled_shapes == {(1, 32), (8, 32)}  # not the 128 tokenizer.json pads to


def test_prefixes_are_prepended_to_queries_and_passages(make_embedder, minilm_embedder):
    e5_style = make_embedder(query_prefix="query: ", passage_prefix="passage: ", batch_size=8)
    assert np.allclose(e5_style.encode_queries(["x"]), minilm_embedder.encode(["query: x"]), atol=1e-6)
    assert np.allclose(e5_style.encode_passages(["x"]), minilm_embedder.encode(["passage: x"]), atol=1e-6)


@pytest.mark.unit
def test_missing_tensor_fails_naming_the_key_and_file(tiny_random_bert_dir, tmp_path):
    folder, _ = tiny_random_bert_dir
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("encoder.layer.1.attention.self.key.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(KeyError, match=r"model.safetensors: missing tensor 'encoder.layer.1.attention.self.key.weight'"):
        load_bert_encoder(tmp_path)


@pytest.mark.unit
def test_non_bert_config_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="model_type 'llama'"):
        BertConfig.from_hf_dict({"model_type": "llama", "vocab_size": 3, "hidden_size": 8, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "intermediate_size": 8}, source="x/config.json")
