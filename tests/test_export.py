"""`sparsetrain export`: the export carries the run's tokenizer / image processor, so a transformers pipeline
works on it as is; its files get the umask's mode. Run dirs are built in-process (config.yaml + one
checkpoint), cheaper than a training subprocess."""
import os

import pytest
import torch
from omegaconf import OmegaConf

from sparsetrain.config import compose, data_builder, model_builder
from sparsetrain.export import main

TEXT = "\n\n".join(f"the {a} sat on the {b} and looked at the {c} ." for a, b, c in
                   [("cat", "mat", "dog"), ("dog", "rug", "cat"), ("bird", "tree", "sky"), ("cow", "grass", "sun")] * 8)


def _run_dir(tmp_path, overrides):
    """A run dir as training leaves it: the resolved config.yaml and a checkpoint's pytorch_model.bin."""
    cfg = compose(overrides)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), run / "config.yaml")
    torch.manual_seed(0)
    model = model_builder(cfg)().eval()
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    return run, ckpt, cfg, model


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(folder):
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()}


def test_text_export_has_the_runs_tokenizer_and_fill_mask_works(tmp_path, umask_022, capsys):
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer, pipeline

    from sparsetrain.inference import load_sparse

    (tmp_path / "corpus.txt").write_text(TEXT)
    run, ckpt, cfg, model = _run_dir(tmp_path, [
        "recipe=quickstart", "data=text_files", f"data.files=[{tmp_path / 'corpus.txt'}]",
        f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=100", "data.seq_len=16", "data.val_fraction=0.2"])
    run_tok = data_builder(cfg)().tokenizer  # what training encoded the text with
    hf, sparse = tmp_path / "hf", tmp_path / "sparse"
    assert main([str(run), "--checkpoint", str(ckpt), "--out", str(hf)]) == 0
    assert main([str(run), "--checkpoint", str(ckpt), "--format", "sparse", "--min-sparsity", "0",
                 "--out", str(sparse)]) == 0

    text = "the cat sat on the [MASK] and looked at the dog ."
    for folder in (hf, sparse):
        tok = AutoTokenizer.from_pretrained(folder)
        assert "[UNK]" not in tok.tokenize(text) and tok(text)["input_ids"] == run_tok(text)["input_ids"]
        # every file of the export, the weights included, gets 0644 under umask 022 (safetensors wrote 0600)
        assert set(_modes(folder).values()) == {0o644}, _modes(folder)
    assert "with its tokenizer" in capsys.readouterr().out
    # trained with the masked-positions head, exported as the BertForMaskedLM it is to everyone else
    assert type(model).__name__ == "BertForMaskedPositionsLM"
    assert AutoConfig.from_pretrained(hf).architectures == ["BertForMaskedLM"]
    assert type(AutoModelForMaskedLM.from_pretrained(hf)).__name__ == "BertForMaskedLM"
    enc = run_tok(text, return_tensors="pt")
    with torch.no_grad():
        probs = model(**enc).logits[0, enc["input_ids"][0].tolist().index(run_tok.mask_token_id)].softmax(-1)
    expected = probs.topk(3)
    best = pipeline("fill-mask", model=str(hf), top_k=3)(text)
    assert [b["token"] for b in best] == expected.indices.tolist()
    assert [b["score"] for b in best] == pytest.approx(expected.values.tolist(), abs=1e-5)
    # the sparse export, loaded as the export module's docstring says
    config = AutoConfig.from_pretrained(sparse)
    loaded = load_sparse(lambda: AutoModelForMaskedLM.from_config(config), str(sparse)).eval()
    fill = pipeline("fill-mask", model=loaded, tokenizer=AutoTokenizer.from_pretrained(sparse), top_k=3)
    assert [b["token"] for b in fill(text)] == expected.indices.tolist()


def test_export_reads_the_tokenizer_the_run_saved_without_the_data_cache(tmp_path, monkeypatch, capsys):
    """A run saves its tokenizer in its dir; export uses it even when the data cache and text are gone."""
    from transformers import AutoTokenizer

    import sparsetrain.config

    (tmp_path / "corpus.txt").write_text(TEXT)
    run, ckpt, cfg, _ = _run_dir(tmp_path, [
        "recipe=quickstart", "data=text_files", f"data.files=[{tmp_path / 'corpus.txt'}]",
        f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=100", "data.seq_len=16", "data.val_fraction=0.2"])
    run_tok = data_builder(cfg)().tokenizer
    run_tok.save_pretrained(str(run / "tokenizer"))  # what training/loop.py writes at the start of a run

    def no_data(cfg):
        raise AssertionError("export rebuilt the data instead of reading the run's tokenizer")

    monkeypatch.setattr(sparsetrain.config, "data_builder", no_data)
    (tmp_path / "corpus.txt").unlink()
    out = tmp_path / "hf"
    assert main([str(run), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    text = "the cow sat on the grass ."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == run_tok(text)["input_ids"]


def test_image_export_has_the_runs_image_processor(tmp_path, umask_022, capsys):
    from PIL import Image
    from transformers import pipeline

    run, ckpt, cfg, model = _run_dir(tmp_path, ["recipe=vit_digits", "model.num_hidden_layers=1"])
    out = tmp_path / "hf"
    assert main([str(run), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    held_out = data_builder(cfg)().eval
    classify = pipeline("image-classification", model=str(out), top_k=10)
    for i in range(3):
        digit = Image.fromarray((held_out.images[i] * 255).round().byte().numpy(), "L")  # an 8x8 8-bit image
        pixels = classify.image_processor(digit.convert("RGB"), return_tensors="pt")["pixel_values"][0]
        trained_on = held_out[i]["pixel_values"]
        assert pixels.shape == trained_on.shape
        assert (pixels - trained_on).abs().max() < 0.1, (pixels - trained_on).abs().max()  # 8-bit rounding only
        with torch.no_grad():
            expected = model(pixel_values=pixels[None]).logits[0].softmax(-1)
        got = {r["label"]: r["score"] for r in classify(digit)}
        assert [got[f"LABEL_{k}"] for k in range(10)] == pytest.approx(expected.tolist(), abs=1e-5)
    assert set(_modes(out).values()) == {0o644}, _modes(out)
    assert "with its image processor" in capsys.readouterr().out


def test_a_fused_qkv_run_exports_separate_projections(tmp_path):
    """model.fused_qkv=true trains one qkv linear per layer; the export is a plain BertForMaskedLM again, computing
    what the trained model computed, and its state dict has the separate query/key/value weights."""
    from sparsetrain.export import load_trained_model

    run, _, _, model = _run_dir(tmp_path, ["recipe=quickstart", "model.fused_qkv=true"])
    assert any(n.endswith(".qkv") for n, _ in model.named_modules())
    exported = load_trained_model(run, run / "checkpoints" / "step_00000001")
    assert type(exported).__name__ == "BertForMaskedLM"
    keys = list(exported.state_dict())
    assert not any(".qkv." in k for k in keys) and any(k.endswith("attention.self.query.weight") for k in keys)
    ids = torch.randint(5, 100, (2, 16))
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
