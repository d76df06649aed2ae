"""BertForMaskedPositionsLM: the MLM head on the masked positions only gives the full head's loss and gradients,
keeps BertForMaskedLM's state dict and exports as one; an all-ones attention mask changes nothing."""
import pytest
import torch
from transformers import BertForMaskedLM

from sparsetrain.data.mlm import MLMCollator
from sparsetrain.models.builders import build_model, takes_masked_positions
from sparsetrain.models.mlm import BertForMaskedPositionsLM, to_masked_lm

VOCAB, SEQ = 300, 32
SPECIALS = [0, 1, 2, 3, 4]  # [PAD] [UNK] [CLS] [SEP] [MASK]


def _batch(seed: int, batch: int = 4, seq: int = SEQ, **collator) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, seq), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    make = MLMCollator(mask_token_id=4, vocab_size=VOCAB, special_ids=SPECIALS, seed=seed, **collator)
    return make([{"input_ids": ids[i], "index": i} for i in range(batch)])


def _model(seed: int, attn: str = "eager") -> BertForMaskedPositionsLM:
    torch.manual_seed(seed)
    return build_model("bert", "tiny", vocab_size=VOCAB, seq_len=SEQ, attn_implementation=attn).float().eval()


def _grads(model) -> dict[str, torch.Tensor]:
    names = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.attention.self.query.weight",
             "bert.encoder.layer.1.output.dense.weight", "cls.predictions.transform.dense.weight",
             "cls.predictions.bias"]
    params = dict(model.named_parameters())
    return {n: params[n].grad.clone() for n in names}


def test_builder_makes_the_masked_positions_model_with_bert_s_state_dict():
    model = _model(0)
    assert type(model) is BertForMaskedPositionsLM and isinstance(model, BertForMaskedLM)
    plain = BertForMaskedLM(model.config)
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict())  # a checkpoint of either loads into the other
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight  # still tied
    assert takes_masked_positions("bert") and not takes_masked_positions("hf") and not takes_masked_positions("vit")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_loss_and_gradients_equal_the_full_head(seed):
    model = _model(seed)
    batch = _batch(seed)
    assert batch["masked_positions"].shape == (4, 5)  # ceil(0.15 * 32)
    reference = BertForMaskedLM(model.config).float().eval()  # transformers' own class, same weights
    reference.load_state_dict(model.state_dict())

    full = reference(input_ids=batch["input_ids"], labels=batch["labels"])
    full.loss.backward()
    expected = _grads(reference)
    out = model(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, full.loss, rtol=1e-5, atol=1e-6)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # the logits are the full head's, read at the masked positions
    index = batch["masked_positions"].unsqueeze(-1).expand(-1, -1, VOCAB)
    torch.testing.assert_close(out.logits, full.logits.gather(1, index), rtol=1e-5, atol=1e-5)
    assert out.loss.dtype == torch.float32


def test_without_masked_positions_it_is_bert_for_masked_lm():
    model = _model(0)
    batch = _batch(0)
    reference = BertForMaskedLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    ids, labels = batch["input_ids"], batch["labels"]
    out, full = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert torch.equal(out.loss, full.loss) and torch.equal(out.logits, full.logits)
    loss, logits = model(ids, labels=labels, masked_positions=batch["masked_positions"], return_dict=False)
    assert logits.shape == (4, 5, VOCAB) and torch.isclose(loss, full.loss)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_an_all_ones_attention_mask_changes_nothing(attn):
    """Packed batches carry no attention_mask: the loss is the one with an all-ones mask."""
    model = _model(0, attn)
    batch = _batch(5)
    assert "attention_mask" not in batch
    with_mask = model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
    torch.testing.assert_close(model(**batch).loss, with_mask.loss, rtol=0, atol=1e-6)


def test_a_padded_batch_keeps_its_mask_and_the_loss_ignores_the_padding():
    model = _model(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (2, SEQ), generator=g)
    ids[:, 0], ids[:, 20], ids[:, 21:] = 2, 3, 0
    collate = MLMCollator(mask_token_id=4, vocab_size=VOCAB, special_ids=SPECIALS, pad_token_id=0)
    batch = collate([{"input_ids": ids[i], "index": i} for i in range(2)])
    assert batch["attention_mask"][:, 21:].eq(0).all()
    reference = BertForMaskedLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    full = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(model(**batch).loss, full.loss, rtol=1e-5, atol=1e-6)


def test_export_loads_as_bert_for_masked_lm(tmp_path):
    from transformers import AutoConfig, AutoModelForMaskedLM

    model = _model(0)
    batch = _batch(0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    to_masked_lm(model).save_pretrained(tmp_path)
    assert type(model) is BertForMaskedLM
    assert AutoConfig.from_pretrained(tmp_path).architectures == ["BertForMaskedLM"]
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is BertForMaskedLM
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch["input_ids"]).logits, logits)
    assert to_masked_lm(loaded) is loaded


@pytest.mark.gpu
def test_forward_and_backward_never_sync_and_replay_from_a_cuda_graph():
    """SDPA without a mask, the gather, the head and the loss: no host sync, so a CUDA graph captures the step."""
    torch.manual_seed(0)
    model = build_model("bert", "tiny", vocab_size=VOCAB, seq_len=128, attn_implementation="sdpa",
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).cuda()
    batches = [{k: v.cuda() for k, v in _batch(seed, batch=8, seq=128).items()} for seed in range(3)]
    static = {k: v.clone() for k, v in batches[0].items()}

    def step():
        for p in model.parameters():
            p.grad = None
        loss = model(**static).loss
        loss.backward()
        return loss.detach()  # keeps no autograd graph alive across steps

    torch.cuda.set_sync_debug_mode("error")  # any op that waits for the device raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    weight = model.cls.predictions.transform.dense.weight
    graph_grad = weight.grad  # allocated by the capture; replays write it, eager steps make new ones
    for batch in batches[1:]:
        for k in static:
            static[k].copy_(batch[k])
        graph.replay()
        replayed, grad = loss.clone(), graph_grad.clone()
        eager = step()
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, weight.grad, rtol=1e-4, atol=1e-6)


def test_an_unpadded_batch_reaches_attention_without_a_mask_and_without_bertmodel_building_one(monkeypatch):
    # BertModel builds the attention mask itself; while a CUDA graph is captured or dynamo traces, transformers
    # (5.17, measured on the GPU image) cannot read its values and hands SDPA an all-True mask, which rules out
    # the flash kernel. Without padding the model must skip BertModel.forward and pass no mask at all.
    import torch.nn.functional as F

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    def no_bertmodel(*args, **kwargs):
        raise AssertionError("BertModel.forward ran (it would build a mask under capture)")

    model, batch = _model(3, attn="sdpa"), _batch(3)
    assert "attention_mask" not in batch
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(model.bert, "forward", no_bertmodel)
    out = model(**batch)
    assert len(seen) == model.config.num_hidden_layers and all(m is None for m in seen)
    monkeypatch.undo()
    reference = BertForMaskedLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    full = reference(input_ids=batch["input_ids"], labels=batch["labels"])
    torch.testing.assert_close(out.loss, full.loss, rtol=1e-5, atol=1e-5)
