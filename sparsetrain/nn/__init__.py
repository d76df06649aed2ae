"""Sparse modules and model surgery."""
from sparsetrain.nn.formats import FORMATS, MaskedFormat, WeightFormat, get_format, register_format
from sparsetrain.nn.sparse_linear import SparseLinear

__all__ = ["FORMATS", "MaskedFormat", "WeightFormat", "get_format", "register_format", "SparseLinear"]
