"""``--mode=eval`` and ``--mode=train`` see the same documents for the same config.

The doc-cut view (``retrieval.max_doc_tokens``) is applied inside ``build_retriever``, so the
trainer's and the evaluator's retrievers are built by the same factory from the same section.
Before, training wrapped its retriever in the cut and eval did not: eval scored a policy on
whole passages it had never been trained on.
"""

from __future__ import annotations

import pytest

from llds_jax.app.run import load_policy_and_retriever as training_inputs
from llds_jax.config import base_config
from llds_jax.eval.run import load_policy_and_retriever as eval_inputs
from llds_jax.parallel.mesh import make_mesh
from llds_jax.retrieval.factory import build_retriever

pytestmark = pytest.mark.unit

QUERIES = ["who wrote the declaration of independence", "capital of australia", "largest planet"]
TOPK = 3


@pytest.fixture
def config(shared_dir):
    c = base_config()
    c.model.source = "tiny:qwen2"
    c.model.tokenizer = str(shared_dir / "assets" / "qwen2_tokenizer")
    c.retrieval.max_doc_tokens = 16
    return c


def test_eval_and_training_retrievers_return_the_same_cut_documents(config):
    _, tokenizer, train_retriever = training_inputs(config, make_mesh((1, 1, 1)))
    _, _, eval_retriever = eval_inputs(config)
    trained_on = train_retriever.search(QUERIES, TOPK)
    evaluated_on = eval_retriever.search(QUERIES, TOPK)
    assert evaluated_on == trained_on, "eval's documents differ from training's for the same config"

    lengths = [len(tokenizer.encode(hit.text, add_special_tokens=False)) for row in evaluated_on for hit in row]
    # decode/encode can merge or split a token at the cut's edge, hence + 1
    assert max(lengths) <= config.retrieval.max_doc_tokens + 1, f"passage token counts {lengths}"
    config.retrieval.max_doc_tokens = 0
    whole = build_retriever(config.retrieval).search(QUERIES, TOPK)
    assert [[h.id for h in row] for row in whole] == [[h.id for h in row] for row in evaluated_on], \
        "the cut must not change the ranking"
    assert sum(w.contents != c.contents for wr, cr in zip(whole, evaluated_on) for w, c in zip(wr, cr)) > 0, \
        "no passage was longer than the cut: the test shows nothing"


def test_a_cut_without_the_policy_tokenizer_is_refused_naming_the_field(config):
    from llds_jax.errors import InputError

    with pytest.raises(InputError, match="retrieval.max_doc_tokens=16 .* needs the policy's tokenizer"):
        build_retriever(config.retrieval)
