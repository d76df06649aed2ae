"""Sparse modules and model surgery."""
from sparsetrain.nn.formats import FORMATS, MaskedFormat, WeightFormat, get_format, register_format
from sparsetrain.nn.sparse_linear import SparseLinear
from sparsetrain.nn.sparsify import DEFAULT_EXCLUDE, densify, select_linears, sparsify

__all__ = ["DEFAULT_EXCLUDE", "FORMATS", "MaskedFormat", "WeightFormat", "densify", "get_format",
           "register_format", "select_linears", "sparsify", "SparseLinear"]
