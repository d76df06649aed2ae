"""Fixtures of the block-sparse tests (the cases themselves are in blocksparse_cases.py)."""
import pytest

from sparsetrain.kernels.blocksparse.testing import poison_outputs, untuned


@pytest.fixture
def poison():
    """Kernel outputs start as NaN: an element a kernel failed to write fails the comparison."""
    with poison_outputs():
        yield


@pytest.fixture
def no_tuning():
    """GPU tests use each product's first candidate (the benchmark's candidates section checks every one);
    tuning them all here would compile every variant."""
    with untuned():
        yield
