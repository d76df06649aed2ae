"""FLOP accounting: the dense count matches torch's FlopCounterMode on real models; sparse layers scale."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sparsetrain.flops import count_step_flops, step_flops
from sparsetrain.models.builders import build_model


def _measured_step_flops(model, **inputs) -> int:
    # FlopCounterMode counts mm/addmm/bmm, convolution (+ backward) and fused attention kernels;
    # like flops.py it ignores elementwise ops, embedding lookups and the loss.
    with FlopCounterMode(display=False) as counter:
        model(**inputs).loss.backward()
    return counter.get_total_flops()


def test_bert_tiny_matches_flop_counter():
    model = build_model("bert", "tiny", vocab_size=8192, seq_len=128)  # eager attention: QK^T and AV are bmm
    ids = torch.randint(5, 8192, (2, 128))
    measured = _measured_step_flops(model, input_ids=ids, labels=ids)
    report = count_step_flops(model, batch_size=2, seq_len=128)
    assert report.dense_total == pytest.approx(measured, rel=0.02)
    assert report.attention_flops == 12 * 2 * 128**2 * 128 * 2  # 12 B L^2 H per layer, 2 layers
    decoder = next(r for r in report.rows if r.name.endswith("decoder"))
    assert (decoder.in_features, decoder.out_features, decoder.tokens) == (128, 8192, 256)


def test_bert_masked_positions_head_matches_flop_counter():
    """The MLM head on P masked positions per sequence: counted on B*P rows, as FlopCounterMode sees it run."""
    from sparsetrain.data.mlm import MLMCollator

    model = build_model("bert", "tiny", vocab_size=8192, seq_len=128)
    ids = torch.randint(5, 8192, (2, 128))
    ids[:, 0], ids[:, -1] = 2, 3
    batch = MLMCollator(mask_token_id=4, vocab_size=8192, special_ids=[0, 1, 2, 3, 4])(
        [{"input_ids": ids[i], "index": i} for i in range(2)])
    p = batch["masked_positions"].shape[1]
    assert p == 20
    measured = _measured_step_flops(model, **batch)
    report = count_step_flops(model, batch_size=2, seq_len=128, predictions_per_seq=p)
    assert report.dense_total == pytest.approx(measured, rel=0.02)
    head = {r.name: r.tokens for r in report.rows if r.name.startswith("cls.")}
    assert head == {"cls.predictions.transform.dense": 2 * p, "cls.predictions.decoder": 2 * p}
    full = count_step_flops(model, batch_size=2, seq_len=128)  # batches without masked_positions
    saved = 6 * 2 * (128 - p) * (128 * 128 + 128 * 8192)       # step 11: the head on 108 fewer rows each
    assert full.dense_total - report.dense_total == pytest.approx(saved)
    assert full.dense_total == pytest.approx(_measured_step_flops(model, input_ids=ids, labels=batch["labels"]),
                                             rel=0.02)
    assert "MLM head on 20 masked positions per sequence" in report.format_table()
    # a model without the masked-positions head runs its head everywhere, whatever the data says
    from transformers import BertForMaskedLM

    plain = count_step_flops(BertForMaskedLM(model.config), batch_size=2, seq_len=128, predictions_per_seq=p)
    assert plain.dense_total == full.dense_total and plain.predictions_per_seq is None
    with pytest.raises(ValueError, match="predictions_per_seq"):
        count_step_flops(model, batch_size=2, seq_len=128, predictions_per_seq=129)


def test_vit_tiny_matches_flop_counter():
    model = build_model("vit", "tiny", image_size=32, patch_size=4, num_hidden_layers=2)
    measured = _measured_step_flops(
        model, pixel_values=torch.randn(3, 3, 32, 32), labels=torch.tensor([1, 2, 3])
    )
    report = count_step_flops(model, batch_size=3, image_size=32)
    assert report.seq_tokens == 65  # 8x8 patches + [CLS]
    assert report.dense_total == pytest.approx(measured, rel=0.02)
    classifier = next(r for r in report.rows if r.name == "classifier")
    assert classifier.tokens == 3  # reads the [CLS] token only


class FakeSparseLinear(nn.Module):
    """Duck-typed sparse layer: in/out features, a density, and a child nn.Linear not to count twice."""

    def __init__(self, n_in, n_out, density):
        super().__init__()
        self.in_features, self.out_features, self.density = n_in, n_out, density
        self.inner = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.inner(x)


def test_sparse_layers_count_at_their_density():
    model = nn.Sequential(FakeSparseLinear(64, 32, density=0.1), nn.ReLU(), nn.Linear(32, 16))
    report = count_step_flops(model, batch_size=3, seq_len=10)
    tokens = 30
    assert [r.name for r in report.rows] == ["0", "2"]
    sparse_row, dense_row = report.rows
    assert sparse_row.dense_flops == 3 * 2 * tokens * 64 * 32
    assert sparse_row.sparse_flops == pytest.approx(3 * 2 * tokens * 64 * 32 * 0.1)
    assert dense_row.sparse_flops == dense_row.dense_flops == 3 * 2 * tokens * 32 * 16
    assert report.attention_flops == 0
    assert report.dense_total == 6 * tokens * (64 * 32 + 32 * 16)
    assert report.sparse_total == pytest.approx(6 * tokens * (64 * 32 * 0.1 + 32 * 16))
    assert report.rigl_update_extra == pytest.approx(2 * tokens * 64 * 32 * 0.9)
    assert step_flops(report, is_update_step=False, dense_grad=True) == report.sparse_total
    assert step_flops(report, is_update_step=True, dense_grad=False) == report.sparse_total
    assert step_flops(report, is_update_step=True, dense_grad=True) == pytest.approx(
        report.sparse_total + 2 * tokens * 64 * 32 * 0.9
    )


def test_sparsified_bert_saves_exactly_the_inactive_share():
    model = build_model("bert", "tiny", vocab_size=1000, seq_len=64)
    dense = count_step_flops(model, batch_size=4, seq_len=64)
    for layer in model.bert.encoder.layer:
        old = layer.intermediate.dense
        layer.intermediate.dense = FakeSparseLinear(old.in_features, old.out_features, density=0.25)
    sparse = count_step_flops(model, batch_size=4, seq_len=64)
    ffn = 2 * 6 * (4 * 64) * 128 * 512  # two layers' intermediate.dense, dense step cost
    assert sparse.dense_total == dense.dense_total
    assert sparse.sparse_total == pytest.approx(dense.dense_total - 0.75 * ffn)
    assert sparse.sparse_ratio < 1.0
    table = sparse.format_table()
    assert "bert.encoder.layer.1.intermediate.dense" in table and "attention" in table
    assert f"sparse / dense = {sparse.sparse_ratio:.4f}" in table


def test_bad_input():
    with pytest.raises(ValueError, match="density"):
        count_step_flops(nn.Sequential(FakeSparseLinear(4, 4, density=0.0)), batch_size=1, seq_len=1)
    with pytest.raises(ValueError, match="seq_len"):
        count_step_flops(nn.Linear(4, 4), batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        count_step_flops(nn.Linear(4, 4), batch_size=0, seq_len=4)
    with pytest.raises(ValueError, match="conv"):
        count_step_flops(nn.Conv2d(3, 8, 3), batch_size=1, seq_len=4)


def test_straight_through_layers_count_dense_weight_gradient():
    """2:4 sparse-then-dense: Y and dX use the sparse weight, dW is dense (the master weight is trained)."""
    from sparsetrain.nn import SparseLinear

    class One(nn.Module):
        def __init__(self, fmt):
            super().__init__()
            self.lin = SparseLinear.from_dense(nn.Linear(64, 32), density=0.5, format=fmt)

    t, i, o = 10, 64, 32
    hard = count_step_flops(One("masked"), batch_size=t, seq_len=1).sparse_total
    st = count_step_flops(One("masked_st"), batch_size=t, seq_len=1).sparse_total
    assert hard == pytest.approx(3 * 2 * t * i * o * 0.5)
    assert st == pytest.approx(2 * t * i * o * (2 * 0.5 + 1))


def test_flops_command_counts_the_head_on_the_masked_positions(capsys):
    from sparsetrain.cli import main

    assert main(["flops", "recipe=quickstart"]) == 0  # batch 32 x 64 tokens, P = ceil(0.15 * 64) = 10
    out = capsys.readouterr().out
    assert "MLM head on 10 masked positions per sequence" in out
    decoder = next(line.split() for line in out.splitlines() if line.startswith("cls.predictions.decoder"))
    assert decoder[3] == str(32 * 10)
