"""training.setup: sparsification from plain arguments (targets handed to every scheduler), optimizer groups,
learning-rate schedule."""
import pytest
import torch
from torch import nn

from sparsetrain.nn import SparseLinear
from sparsetrain.sparsity import Dense, GradualMagnitude, Static
from sparsetrain.sparsity.layout import Block
from sparsetrain.training.setup import build_optimizer, lr_lambda, sparsify_model

KW = dict(targets=["*"], exclude=[], density=0.25, distribution="uniform", density_overrides=None,
          block=Block(4, 4), format="masked", init="random", seed=0)


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))


class RecordingStatic(Static):
    def set_targets(self, targets):
        self.seen = dict(targets)


def test_sparsify_model_hands_targets_to_every_scheduler_and_starts_where_it_asks():
    static = RecordingStatic()
    layers = sparsify_model(_model(), static, KW)
    assert static.seen == {"0": 0.25, "2": 0.25}
    assert all(isinstance(m, SparseLinear) and m.density == pytest.approx(0.25) for m in layers.values())
    gradual = GradualMagnitude()
    layers = sparsify_model(_model(), gradual, KW)
    assert gradual.targets == {"0": 0.25, "2": 0.25}
    assert all(m.density == 1.0 for m in layers.values())        # gradual pruning starts dense
    assert sparsify_model(_model(), Dense(), KW) == {}
    masked = sparsify_model(_model(), Static(), {**KW, "format": "block"}, format="masked")
    assert {m.format_name for m in masked.values()} == {"masked"}  # `sparsetrain flops` counts with masked


def test_build_optimizer_keeps_decay_off_biases_norms_and_named_parameters():
    model = _model()
    opt = build_optimizer(model, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}, no_decay=("2.",))
    decay, plain = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(32, 16)]
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 5


def test_lr_lambda_warmup_then_decay():
    f = lr_lambda("cosine", warmup=2, total=10, min_ratio=0.1)
    assert [f(0), f(1)] == [0.5, 1.0] and f(10) == pytest.approx(0.1)
    assert lr_lambda("linear", 0, 10, 0.0)(5) == pytest.approx(0.5)
    assert lr_lambda("constant", 0, 10, 0.0)(7) == 1.0
