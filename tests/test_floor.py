"""The counted step floor (sparsetrain/floor.py): each category's bytes and FLOPs against a hand count on a small
model, the time at a card's rates, consistency with the FLOP count, and the ``flops --floor`` command."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparsetrain.floor import CARDS, Card, format_floor, step_floor
from sparsetrain.flops import FlopReport, LayerFlops, count_step_flops
from sparsetrain.models.builders import build_model
from sparsetrain.nn import sparsify


def test_each_category_against_a_hand_count():
    """One encoder layer (H = 4, I = 8) of 10 tokens, one sparse 4 -> 8 product at density 0.25 and a dense 8 -> 4
    one, attention FLOPs given; a card of 1 TFLOP/s and 1 TB/s so that ms = 1e-9 x FLOPs or bytes."""
    sparse = LayerFlops("up", 4, 8, 10, 0.25, 6 * 10 * 4 * 8, 6 * 10 * 4 * 8 * 0.25)
    dense = LayerFlops("down", 8, 4, 10, 1.0, 6 * 10 * 8 * 4, 6 * 10 * 8 * 4)
    report = FlopReport([sparse, dense], 1000.0, 0, 0, 0, batch_size=2, seq_tokens=5)
    config = SimpleNamespace(hidden_size=4, intermediate_size=8, num_hidden_layers=1, vocab_size=7)
    rows = {r.category: r for r in step_floor(report, config, parameters=100, card=Card("unit", 1.0, 1.0))}
    T = 10
    assert rows["block-sparse"].flops == 480 and rows["linears"].flops == 1920
    assert rows["block-sparse"].bytes == 2 * 3 * T * 12 + 14 * 32 * 0.25            # activations + weights
    assert rows["linears"].bytes == 2 * 3 * T * 12 + 14 * 32
    assert rows["attention"].flops == 1000 and rows["attention"].bytes == 2 * 12 * T * 4
    assert rows["optimizer"].bytes == 32 * (100 - 32 * 0.75)                          # inactive entries not trained
    layer = 2 * (6 * T * 4 + 2 * T * 8 + 8 * T * 4 + 3 * T * 8) + 4 * T * 4
    assert rows["elementwise"].bytes == layer + 2 * 8 * T * 4 + 2 * 3 * T * 7        # + embeddings + loss (every token)
    for r in rows.values():
        assert r.math_ms == pytest.approx(1e-9 * r.flops) and r.dram_ms == pytest.approx(1e-9 * r.bytes)
        assert r.ms == max(r.math_ms, r.dram_ms) and r.bound == ("math" if r.math_ms >= r.dram_ms else "DRAM")


def test_floor_flops_are_the_flop_count_and_sparsity_only_moves_the_block_sparse_rows():
    bert = build_model("bert", "mini", vocab_size=1000, seq_len=64)
    n = sum(p.numel() for p in bert.parameters())
    dense = step_floor(count_step_flops(bert, batch_size=4, seq_len=64, predictions_per_seq=10), bert.config, n,
                       CARDS["h200"])
    sparsify(bert, density=0.1, block=16, format="masked", seed=0)
    report = count_step_flops(bert, batch_size=4, seq_len=64, predictions_per_seq=10)
    rows = step_floor(report, bert.config, n, CARDS["h200"])
    assert sum(r.flops for r in rows) == pytest.approx(report.sparse_total)
    by = {r.category: r for r in rows}
    was = {r.category: r for r in dense}
    assert was["block-sparse"].flops == 0 and by["block-sparse"].flops == pytest.approx(0.1 * was["linears"].flops
                                                                                       - 0.1 * by["linears"].flops, rel=0.05)
    assert by["elementwise"] == was["elementwise"] and by["attention"] == was["attention"]
    assert by["optimizer"].bytes < was["optimizer"].bytes
    table = format_floor(rows, CARDS["h200"], measured={"elementwise": 2 * by["elementwise"].ms})
    line = next(x for x in table.splitlines() if x.startswith("elementwise"))
    assert "NVIDIA H200" in table and line.split()[-1] == "2.0"


def test_flops_command_prints_the_floor_and_names_a_bad_card(capsys):
    from sparsetrain.cli import main

    assert main(["flops", "recipe=quickstart", "--floor", "h100"]) == 0
    out = capsys.readouterr().out
    assert "step floor on NVIDIA H100 SXM" in out and "elementwise" in out.split("step floor")[1]
    assert main(["flops", "recipe=quickstart", "--floor=tpu"]) == 2
    assert "--floor must name a card: h100, h200; got 'tpu'" in capsys.readouterr().err
