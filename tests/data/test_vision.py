"""Image classification data: digits, synthetic and image-folder sets."""
import numpy as np
import pytest
import torch

from sparsetrain.data.vision import build_image_data


def test_digits_shapes_labels_split_and_normalisation():
    data = build_image_data("digits", image_size=32, seed=0)
    assert (len(data.train), len(data.eval), data.num_classes, data.image_size) == (1438, 359, 10, 32)
    item = data.train[3]
    assert item["pixel_values"].shape == (3, 32, 32) and item["index"] == 3 and 0 <= item["labels"] < 10
    assert torch.equal(item["pixel_values"][0], item["pixel_values"][2])  # grey repeated to 3 channels
    # The separable-matmul upsampling equals torch's bilinear interpolation of the 8x8 digit.
    reference = torch.nn.functional.interpolate(
        data.train.images[3][None, None], size=(32, 32), mode="bilinear", align_corners=False
    )[0, 0]
    expected = (reference - data.train.mean) / data.train.std
    torch.testing.assert_close(item["pixel_values"][1], expected, atol=1e-5, rtol=1e-5)
    batch = data.collator([data.train[i] for i in range(len(data.train))])
    assert batch["pixel_values"].shape == (1438, 3, 32, 32) and batch["labels"].dtype == torch.long
    assert (
        abs(batch["pixel_values"].mean().item()) < 0.01 and abs(batch["pixel_values"].std().item() - 1) < 0.01
    )
    assert set(batch["labels"].tolist()) == set(range(10))
    train_imgs = {data.train.images[i].numpy().tobytes() for i in range(len(data.train))}
    # Split determinism: same seed, same split; another seed, another split; train and eval disjoint
    # (load_digits holds a few exact duplicates, hence the tolerance).
    again, other = (
        build_image_data("digits", image_size=32, seed=0),
        build_image_data("digits", image_size=32, seed=1),
    )
    assert torch.equal(again.train.images, data.train.images) and torch.equal(
        again.eval.labels, data.eval.labels
    )
    assert not torch.equal(other.train.images, data.train.images)
    overlap = sum(data.eval.images[i].numpy().tobytes() in train_imgs for i in range(len(data.eval)))
    assert overlap <= 5
    assert build_image_data("digits", image_size=20, num_channels=1).eval[0]["pixel_values"].shape == (
        1,
        20,
        20,
    )


def test_synthetic_is_deterministic_in_the_seed():
    a = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=3)
    b = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=3)
    c = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=4)
    assert (len(a.train), len(a.eval), a.num_classes) == (16, 4, 4)
    assert (
        torch.equal(a.train[5]["pixel_values"], b.train[5]["pixel_values"])
        and a.train[5]["labels"] == b.train[5]["labels"]
    )
    assert not torch.equal(a.train[5]["pixel_values"], c.train[5]["pixel_values"])
    assert not torch.equal(a.train[0]["pixel_values"], a.eval[0]["pixel_values"])
    labels = [a.train[i]["labels"] for i in range(16)]
    assert set(labels) <= set(range(4)) and len(set(labels)) > 1
    assert a.train[0]["pixel_values"].shape == (3, 16, 16)


def test_image_folder_and_missing_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(
                tmp_path / "imgs" / cls / f"{i}.png"
            )
    data = build_image_data("folder", folder=str(tmp_path / "imgs"), image_size=8, val_fraction=0.2)
    assert (len(data.train), len(data.eval), data.num_classes) == (8, 2, 2)
    item = data.train[0]
    assert item["pixel_values"].shape == (3, 8, 8) and item["labels"] in (0, 1)
    assert -1.0 <= item["pixel_values"].min() and item["pixel_values"].max() <= 1.0
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        build_image_data("folder", folder=str(tmp_path / "no_such_folder"))
    with pytest.raises(ValueError, match="source"):
        build_image_data("mnist")


@pytest.mark.parametrize("patch_matmul", [False, True])
def test_a_vit_under_bf16_autocast_takes_the_same_step_from_bf16_pixels(patch_matmul):
    """``data.pixel_dtype=auto`` hands a ViT built here its pixels in the compute dtype: its patch embedding is the
    first product on them and autocast casts its input to bf16 anyway, so the loss and every gradient are the same,
    bit for bit, with the convolution and with ``model.patch_matmul``."""
    from sparsetrain.data.vision import ImageCollator
    from sparsetrain.models import build_model

    data = build_image_data("synthetic", image_size=32, synthetic_size=16, num_classes=4, seed=5)
    items = [data.train[i] for i in range(6)]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        batch = ImageCollator(dtype)(items)
        assert batch["pixel_values"].dtype == dtype and batch["labels"].dtype == torch.long
        torch.manual_seed(0)
        model = build_model("vit", "tiny", image_size=32, patch_size=8, num_labels=4, task="image-classification",
                            patch_matmul=patch_matmul)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss32, grads32), (loss16, grads16) = results
    assert torch.equal(loss32, loss16)
    assert grads32.keys() == grads16.keys() and all(torch.equal(grads32[n], grads16[n]) for n in grads32)
    # and the bf16 batch is the float32 one rounded once, as autocast rounds it
    batch32, batch16 = ImageCollator()(items), ImageCollator(torch.bfloat16)(items)
    assert torch.equal(batch16["pixel_values"], batch32["pixel_values"].to(torch.bfloat16))
    assert not torch.equal(batch16["pixel_values"].float(), batch32["pixel_values"])   # it did round


def test_the_pixel_dtype_is_the_compute_dtype_only_where_it_changes_nothing():
    """``auto``: bf16 pixels for a ViT built here under bf16 mixed precision, float32 otherwise; asking for a 16-bit
    dtype the step would not cast to anyway is refused before anything runs, naming the key."""
    from sparsetrain.config import ConfigError, compose, data_builder, validate

    def dtype(overrides):
        return data_builder(compose(overrides)).keywords["pixel_dtype"]

    assert dtype(["recipe=vit_base_dense"]) == "bfloat16"
    assert dtype(["recipe=vit_base_dense", "trainer.mixed_precision=no"]) == "float32"
    assert dtype(["recipe=vit_base_dense", "data.pixel_dtype=float32"]) == "float32"
    assert dtype(["recipe=quickstart", "model=vit_tiny", "data=digits", "trainer.mixed_precision=fp16"]) == "float16"
    assert build_image_data("digits", image_size=8).collator.dtype == torch.float32   # the builder's own default
    for bad in (["trainer.mixed_precision=no", "data.pixel_dtype=bfloat16"], ["data.pixel_dtype=float16"],
                ["data.pixel_dtype=int8"]):
        with pytest.raises(ConfigError) as e:
            validate(compose(["recipe=vit_base_dense", *bad]))
        assert e.value.key == "data.pixel_dtype", str(e.value)
    with pytest.raises(ValueError, match="pixel_dtype"):
        build_image_data("digits", image_size=8, pixel_dtype="auto")   # resolved by the config, not here
