"""``python -m llds_jax.main --mode=index`` writes the index that serving and `build_retriever` load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llds_jax.retrieval import BM25Retriever, build_retriever, default_retrieval_config

from .service_process import REPO

pytestmark = pytest.mark.integration


def test_index_mode_writes_a_bm25_index_that_build_retriever_loads_instead_of_rebuilding(small_corpus_path,
                                                                                       small_bm25, tmp_path):
    index_dir = tmp_path / "bm25"
    command = [sys.executable, "-m", "llds_jax.main", "--mode=index", f"--config={REPO / 'configs' / 'retriever.py'}",
               f"--config.retrieval.corpus_path={small_corpus_path}", f"--config.retrieval.index_path={index_dir}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"written to {index_dir}" in done.stdout
    stamp = (index_dir / "llds_bm25.json").stat().st_mtime_ns

    r = default_retrieval_config()
    r.corpus_path, r.index_path = str(small_corpus_path), str(index_dir)
    retriever = build_retriever(r)
    assert isinstance(retriever, BM25Retriever)
    assert (index_dir / "llds_bm25.json").stat().st_mtime_ns == stamp
    assert retriever.search(["tamil film director"], 3) == small_bm25.search(["tamil film director"], 3)


def test_an_unknown_method_fails_the_command_with_the_name(small_corpus_path, tmp_path):
    command = [sys.executable, "-m", "llds_jax.main", "--mode=index", f"--config={REPO / 'configs' / 'retriever.py'}",
               "--config.retrieval.method=splade", f"--config.retrieval.index_path={tmp_path / 'x'}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "splade" in done.stderr
