"""The lab tokenizer: loads through AutoTokenizer, round-trips any text, keeps the protocol short."""

import pytest
from transformers import AutoTokenizer

from llds_jax.lab.tokenizer import EOS, train_tokenizer
from llds_jax.lab.world import generate_world
from llds_jax.rollout import protocol

pytestmark = pytest.mark.unit

SMALL = dict(seed=1, countries=3, cities=6, companies=5, people=30, train_questions=60, dev_questions=10)


def test_saved_tokenizer_loads_round_trips_and_compresses_the_prompt(tmp_path):
    world = generate_world(SMALL)
    train_tokenizer(world, 600, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) <= 600
    assert tokenizer.eos_token == EOS and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert not getattr(tokenizer, "chat_template", None)  # the rollout then uses the plain prompt
    for text in (protocol.user_prompt(world.train[0].question), "<search> Zzq ünïcode 42 </search>",
                 f"\n\n<information>Doc 1(Title: {world.passages[0][0]}) x</information>\n\n"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    prompt = tokenizer.encode(protocol.user_prompt(world.train[0].question), add_special_tokens=False)
    characters = len(protocol.user_prompt(world.train[0].question))
    assert len(prompt) < characters / 3, f"{len(prompt)} tokens for {characters} characters: merges not learned"
