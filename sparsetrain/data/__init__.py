"""Data builders: packed MLM text (embedded Shakespeare, local files, hub) and image classification sets."""

from sparsetrain.data.corpus import shakespeare_plays
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
    "shakespeare_plays",
]
