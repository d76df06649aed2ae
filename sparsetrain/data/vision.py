"""Image classification data: scikit-learn digits, deterministic synthetic images, or image folders.

Items are cheap to read because the training loop reads them in its own thread: digits stay 8x8 in
memory and are upsampled per item by two small matmuls (bilinear resizing is separable), about 0.05 ms
at 224 px; synthetic items index a small bank of noise images made once from the seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

SOURCES = ("digits", "synthetic", "folder", "hub")
#: ``pixel_dtype`` values: the dtype image batches are stacked in on the host and copied to the GPU in. "auto" is
#: resolved by :mod:`sparsetrain.config` before the builder is called (the run's compute dtype for a model whose
#: first product reads the pixels, else float32); the builder itself takes the other three.
PIXEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ImageData:
    """What :func:`build_image_data` returns; build the model with ``num_labels=data.num_classes``."""

    train: Dataset
    eval: Dataset
    num_classes: int
    image_size: int
    collator: Callable[[list[dict]], dict[str, torch.Tensor]]


class ImageCollator:
    """Stack items into ``{"pixel_values": [B, C, H, W] in dtype, "labels": long[B]}``. ``pin``: stack the images
    straight into pinned memory (:meth:`Batches.get` asks for it when the feed pins). A run whose model casts the
    pixels to its 16-bit compute dtype first (a ViT's patch embedding under autocast) gets the same step from
    16-bit pixels, and half the bytes to stack on the host and copy to the GPU (ViT-B/16: 77 MB a step instead of
    154). Labels stay long.

    >>> ImageCollator(torch.bfloat16)([{"pixel_values": torch.ones(3, 2, 2), "labels": 0}])["pixel_values"].dtype
    torch.bfloat16
    """

    pins = True

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def __call__(self, examples: list[dict], pin: bool = False) -> dict[str, torch.Tensor]:
        images = [ex["pixel_values"] for ex in examples]
        out = torch.empty((len(images), *images[0].shape), dtype=self.dtype, pin_memory=pin)
        return {
            "pixel_values": torch.stack(images, out=out),
            "labels": torch.tensor([int(ex["labels"]) for ex in examples], dtype=torch.long),
        }

    def __repr__(self) -> str:
        return f"ImageCollator({self.dtype})"


#: :class:`ImageCollator` in float32: what ``build_image_data(pixel_dtype="float32")`` hands out.
collate_images = ImageCollator(torch.float32)


def _resize(images: torch.Tensor, image_size: int, num_channels: int) -> torch.Tensor:
    # images: (N, C0, h, w) float; grey images are repeated to num_channels, colour ones must match.
    if images.shape[-1] != image_size or images.shape[-2] != image_size:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    if images.shape[1] == 1 and num_channels != 1:
        images = images.expand(-1, num_channels, -1, -1)
    return images


def _linear_resize_matrix(size_in: int, size_out: int) -> torch.Tensor:
    # Row i of the (size_out, size_in) result is the 1-D linear interpolation of output pixel i, so
    # M @ X @ M.T equals F.interpolate(X, mode="bilinear", align_corners=False) for a square X.
    basis = torch.eye(size_in)[None]  # (1, size_in channels, size_in)
    return F.interpolate(basis, size=size_out, mode="linear", align_corners=False)[0].T.contiguous()


class _UpsampledGrey(Dataset):
    """Small grey images (N, h, h) upsampled per item with a separable matmul, normalised, repeated to C."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, image_size: int, num_channels: int
    ) -> None:
        self.images, self.labels, self.num_channels = images, labels, num_channels
        self.resize = _linear_resize_matrix(images.shape[-1], image_size)
        self.mean, self.std = 0.0, 1.0

    def upsampled(self, index) -> torch.Tensor:
        return self.resize @ self.images[index] @ self.resize.T

    def fit_normalisation(self) -> tuple[float, float]:
        """Mean/std of this set at the target size, accumulated in chunks to bound memory."""
        total = sq = 0.0
        count = 0
        for start in range(0, len(self.images), 128):
            up = self.upsampled(slice(start, start + 128)).double()
            total, sq, count = total + up.sum().item(), sq + up.square().sum().item(), count + up.numel()
        mean = total / count
        return mean, max(sq / count - mean * mean, 1e-12) ** 0.5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        pixels = (self.upsampled(index) - self.mean) / self.std
        return {
            "pixel_values": pixels.expand(self.num_channels, -1, -1),  # a view: stacking copies it
            "labels": int(self.labels[index]),
            "index": int(index),
        }


class _SyntheticImages(Dataset):
    """Noise images with uniform random labels, a pure function of ``seed`` and the item's position.

    Images come from a bank of at most 64 Gaussian-noise images made once from ``seed`` (item ``k``
    of the whole set shows bank image ``k % len(bank)``); labels are drawn per item from a hash of
    ``(seed, k)``. Meant for throughput runs, where reading an item must cost next to nothing.
    """

    def __init__(self, bank: torch.Tensor, size: int, offset: int, num_classes: int, seed: int) -> None:
        self.bank, self.size, self.offset, self.num_classes, self.seed = bank, size, offset, num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.size:
            raise IndexError(index)
        k = self.offset + index
        key = hashlib.blake2b(f"{self.seed}:{k}".encode(), digest_size=8).digest()
        return {
            "pixel_values": self.bank[k % len(self.bank)],
            "labels": int.from_bytes(key, "little") % self.num_classes,
            "index": int(index),
        }


class _HFImages(Dataset):
    """A `datasets.Dataset` of PIL images and integer labels, converted to normalised tensors per item."""

    def __init__(
        self, dataset, image_column: str, label_column: str, image_size: int, num_channels: int
    ) -> None:
        self.dataset, self.image_column, self.label_column = dataset, image_column, label_column
        self.image_size, self.num_channels = image_size, num_channels

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[int(index)]
        image = row[self.image_column].convert("L" if self.num_channels == 1 else "RGB")
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(image.height, image.width, -1).permute(2, 0, 1).float().div(255.0)
        pixels = _resize(pixels[None], self.image_size, self.num_channels)[0]
        return {
            "pixel_values": ((pixels - 0.5) / 0.5).contiguous(),
            "labels": int(row[self.label_column]),
            "index": int(index),
        }


def _split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * val_fraction))
    return order[n_val:].sort().values, order[:n_val].sort().values


def _digits(
    image_size: int, num_channels: int, val_fraction: float, seed: int
) -> tuple[Dataset, Dataset, int]:
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    images = torch.tensor(digits.images, dtype=torch.float32).div(16.0)  # (1797, 8, 8) in [0, 1]
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = _split(len(labels), val_fraction, seed)
    train = _UpsampledGrey(images[train_idx], labels[train_idx], image_size, num_channels)
    held_out = _UpsampledGrey(images[val_idx], labels[val_idx], image_size, num_channels)
    # Normalise both splits with the training split's statistics at the target size (upsampling
    # lowers the std a little), so eval sees exactly the training transform.
    train.mean, train.std = held_out.mean, held_out.std = train.fit_normalisation()
    return train, held_out, 10


def _hf_columns(dataset) -> tuple[str, str]:
    image_column = next((c for c in ("image", "img", "pixel_values") if c in dataset.column_names), None)
    label_column = next((c for c in ("label", "labels", "fine_label") if c in dataset.column_names), None)
    if image_column is None or label_column is None:
        raise ValueError(f"cannot find image and label columns among {dataset.column_names}")
    return image_column, label_column


def _hf_splits(loaded, image_size: int, num_channels: int, val_fraction: float, seed: int):
    train = loaded["train"]
    held_out = next((loaded[s] for s in ("validation", "test") if s in loaded), None)
    if held_out is None:
        parts = train.train_test_split(test_size=val_fraction, seed=seed)
        train, held_out = parts["train"], parts["test"]
    image_column, label_column = _hf_columns(train)
    names = getattr(train.features[label_column], "names", None)
    num_classes = len(names) if names else int(max(train[label_column])) + 1
    return (
        _HFImages(train, image_column, label_column, image_size, num_channels),
        _HFImages(held_out, image_column, label_column, image_size, num_channels),
        num_classes,
    )


def check_image_args(
    source: str = "digits",
    image_size: int = 32,
    num_channels: int = 3,
    folder: str | None = None,
    hub_name: str | None = None,
    synthetic_size: int = 1024,
    num_classes: int = 10,
    val_fraction: float = 0.2,
    pixel_dtype: str = "float32",
    **_unused,
) -> None:
    """Cheap checks of :func:`build_image_data`'s arguments, before any image is read: raises ValueError
    (FileNotFoundError for a missing folder) whose message starts with the argument's name."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if num_channels not in (1, 3):
        raise ValueError(f"num_channels must be 1 or 3, got {num_channels}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source == "synthetic" and synthetic_size < 2:
        raise ValueError(f"synthetic_size must be >= 2, got {synthetic_size}")
    if source == "synthetic" and num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if source == "folder":
        if folder is None or folder == "???":
            raise ValueError("folder: source='folder' needs folder=<path to class sub-folders>")
        if not Path(str(folder)).expanduser().is_dir():
            raise FileNotFoundError(f"folder: image folder not found: {folder}")
    if source == "hub" and not hub_name:
        raise ValueError("hub_name: source='hub' needs hub_name (a dataset name)")
    if pixel_dtype not in PIXEL_DTYPES:
        raise ValueError(f"pixel_dtype must be one of {PIXEL_DTYPES}, got {pixel_dtype!r}")


def build_image_data(
    source: str = "digits",
    image_size: int = 32,
    num_channels: int = 3,
    folder: str | None = None,
    hub_name: str | None = None,
    synthetic_size: int = 1024,
    num_classes: int = 10,
    val_fraction: float = 0.2,
    seed: int = 0,
    pixel_dtype: str = "float32",
) -> ImageData:
    """Build image classification train/eval sets; items are ``{"pixel_values", "labels", "index"}``.

    ``digits``: scikit-learn's 1797 8x8 digits, upsampled (bilinear), repeated to ``num_channels``,
    normalised with the training split's mean/std, split by ``seed``. ``synthetic``: ``synthetic_size``
    noise images (drawn from a bank of at most 64) with random labels in ``range(num_classes)``, for
    throughput runs (``num_classes`` is used by this source only; the others read it from the data).
    ``folder``: an image folder (``class_name/xxx.png``) read with ``datasets``; ``hub``: a named hub
    dataset. Folder and hub use their validation/test split if present, else a seeded ``val_fraction``
    split (their pixels are scaled to [-1, 1]). ``pixel_dtype``: the dtype batches are stacked in
    (:class:`ImageCollator`; items stay float32).

    >>> data = build_image_data("digits", image_size=32)
    >>> data.train[0]["pixel_values"].shape, data.num_classes
    (torch.Size([3, 32, 32]), 10)
    """
    check_image_args(source, image_size, num_channels, folder, hub_name, synthetic_size, num_classes, val_fraction,
                     pixel_dtype)
    if pixel_dtype == "auto":
        raise ValueError("pixel_dtype: 'auto' is resolved by the run's config (sparsetrain.config); here give "
                         "float32, bfloat16 or float16")
    if source == "digits":
        train, held_out, num_classes = _digits(image_size, num_channels, val_fraction, seed)
    elif source == "synthetic":
        n_val = max(1, round(synthetic_size * val_fraction))
        n_train = synthetic_size - n_val
        shape = (min(synthetic_size, 64), num_channels, image_size, image_size)
        bank = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        train = _SyntheticImages(bank, n_train, 0, num_classes, seed)
        held_out = _SyntheticImages(bank, n_val, n_train, num_classes, seed)
    elif source == "folder":
        import datasets

        loaded = datasets.load_dataset("imagefolder", data_dir=str(Path(folder).expanduser()))
        train, held_out, num_classes = _hf_splits(loaded, image_size, num_channels, val_fraction, seed)
    else:
        import datasets

        loaded = datasets.load_dataset(hub_name)
        train, held_out, num_classes = _hf_splits(loaded, image_size, num_channels, val_fraction, seed)
    return ImageData(
        train=train, eval=held_out, num_classes=num_classes, image_size=image_size,
        collator=ImageCollator(getattr(torch, pixel_dtype)),
    )


build_image_data.check_args = check_image_args  # what sparsetrain.config calls before anything is built
