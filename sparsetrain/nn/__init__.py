"""Sparse modules and model surgery: SparseLinear, its storage formats, sparsify/densify, kernel planning."""
from sparsetrain.nn.dispatch import plan_dispatch
from sparsetrain.nn.formats import (
    FORMATS,
    BlockFormat,
    FormatCaps,
    MaskedFormat,
    Semi24Format,
    WeightFormat,
    get_format,
    known_formats,
    register_format,
    resolve_format,
)
from sparsetrain.nn.sparse_linear import SparseLinear
from sparsetrain.nn.sparsify import DEFAULT_EXCLUDE, densify, select_linears, sparsify

__all__ = ["DEFAULT_EXCLUDE", "FORMATS", "BlockFormat", "FormatCaps", "MaskedFormat", "Semi24Format",
           "SparseLinear", "WeightFormat", "densify", "get_format", "known_formats", "plan_dispatch",
           "register_format", "resolve_format", "select_linears", "sparsify"]
