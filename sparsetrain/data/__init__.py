"""Data builders: packed MLM text (embedded Shakespeare, the larger English corpus, local files, hub) and image
classification sets."""

from sparsetrain.data.corpus import shakespeare_plays
from sparsetrain.data.english_large import english_large_documents
from sparsetrain.data.text import MLMCollator, MLMData, PackedSequences, build_mlm_data
from sparsetrain.data.vision import ImageData, build_image_data, collate_images

__all__ = [
    "ImageData",
    "MLMCollator",
    "MLMData",
    "PackedSequences",
    "build_image_data",
    "build_mlm_data",
    "collate_images",
    "english_large_documents",
    "shakespeare_plays",
]
