"""Storage formats of a SparseLinear weight: the registry and typed capabilities (:mod:`.base`), and the
built-in formats ``masked``/``masked_st`` (:mod:`.masked`), ``block`` (:mod:`.block`) and ``2:4``
(:mod:`.semi24`). A user format registers with :func:`register_format` or is named by its dotted path."""
from sparsetrain.nn.formats.base import (
    FORMATS,
    FormatCaps,
    WeightFormat,
    get_format,
    known_formats,
    register_format,
    resolve_format,
)
from sparsetrain.nn.formats.block import BlockFormat
from sparsetrain.nn.formats.masked import MaskedFormat, MaskedStraightThrough
from sparsetrain.nn.formats.semi24 import Semi24Format

__all__ = ["FORMATS", "BlockFormat", "FormatCaps", "MaskedFormat", "MaskedStraightThrough", "Semi24Format",
           "WeightFormat", "get_format", "known_formats", "register_format", "resolve_format"]
