"""Retrieval service / index config: ``python -m llds_jax.main --mode=serve --config=configs/retriever.py``.

Every field is overridable, e.g. ``--config.retrieval.port=8001``; see
``llds_jax/retrieval/config.py`` for what each field means.
"""

from ml_collections import ConfigDict

from llds_jax.retrieval.config import default_retrieval_config


def get_config() -> ConfigDict:
    config = ConfigDict()
    config.retrieval = default_retrieval_config()
    return config
