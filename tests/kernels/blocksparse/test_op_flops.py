"""The block-sparse custom ops' FLOP formulas (``kernels/blocksparse/flops.py``): torch's FlopCounterMode counts a
product with the active blocks as ``2 * tokens * values.numel()``; and torch.compile's partitioner, under an
activation-memory budget below 1 (``training.setup.compile_settings``), keeps the sparse forward products'
outputs instead of running the products again in the backward."""
from __future__ import annotations

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.utils.flop_counter import FlopCounterMode

from sparsetrain.kernels._runtime.options import use_kernel_options
from sparsetrain.kernels.blocksparse.registry import op_meta_args
from sparsetrain.nn import SparseLinear
from sparsetrain.nn.formats.block import BlockFormat
from sparsetrain.training.setup import TrainArgs, compile_settings

OPS = torch.ops.sparsetrain


def _layer(n_in: int, n_out: int, seed: int, density: float = 0.5) -> SparseLinear:
    torch.manual_seed(seed)
    return SparseLinear.from_dense(torch.nn.Linear(n_in, n_out), density=density, block=16, format="block",
                                   generator=torch.Generator().manual_seed(seed))


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


@pytest.mark.parametrize("tokens", [(24,), (3, 8)])
def test_each_op_counts_two_flops_per_token_and_active_weight(tokens):
    layer = _layer(64, 96, seed=1, density=0.25)
    meta = BlockFormat.meta(layer)
    args = op_meta_args(meta)
    n_in, n_out = meta.in_features, meta.out_features
    x, dy = torch.randn(*tokens, n_in), torch.randn(*tokens, n_out)
    t, active = x.numel() // n_in, layer.values.numel()
    assert active == 0.25 * n_in * n_out
    one = 2 * t * active
    v = layer.values.detach()
    assert _flops(lambda: OPS.block_sparse_linear(x, v, None, *args)) == one
    for need_x, need_v, want in ((True, True, 2 * one), (True, False, one), (False, True, one)):
        got = _flops(lambda nx=need_x, nv=need_v: OPS.block_sparse_linear_backward(dy, x, v, *args, nx, nv, False))
        assert got == want, (need_x, need_v)
    assert _flops(lambda: OPS.block_sparse_linear_gelu(x, v, None, *args)) == one
    probe = torch.zeros(())
    assert _flops(lambda: OPS.block_sparse_linear_probed(x, v, None, probe, *args)) == one
    dense = 2 * t * n_in * n_out       # RigL's dense weight gradient
    assert _flops(lambda: OPS.block_sparse_linear_probed_backward(dy, x, v, *args, True, True, False)) == 2 * one + dense
    # the second linear of a GELU block: its input is gelu(h), h as wide as its in_features
    h = torch.randn(*tokens, n_in)
    assert _flops(lambda: OPS.block_sparse_gelu_linear(h, torch.nn.functional.gelu(h), v, None, *args)) == one
    assert _flops(lambda: OPS.block_sparse_gelu_linear_backward(dy, h, v, *args, False)) == 2 * one
    # the GELU block's ops on RigL's grow step (probed): the same products, the backward plus the dense gradient
    assert _flops(lambda: OPS.block_sparse_linear_gelu_probed(x, v, None, probe, *args)) == one
    assert _flops(lambda: OPS.block_sparse_gelu_linear_probed(h, torch.nn.functional.gelu(h), v, None, probe,
                                                              *args)) == one
    assert _flops(lambda: OPS.block_sparse_gelu_linear_probed_backward(dy, h, v, *args, True)) == 2 * one + dense


class _Partitioned(Exception):
    pass


def _backward_ops(budget: float, extra: dict | None = None) -> list[str]:
    """The ops of the backward graph that torch.compile's partitioner (inductor's min-cut) makes for a sparse tiny
    BERT's training step (2 layers, 256 tokens, fp32) at ``budget`` (under ``compile_settings``, plus ``extra``
    functorch settings), GELU kept (its four linears plain block-sparse products). Only traced, with the ops' fake
    implementations: no kernel runs."""
    from sparsetrain.models.builders import build_model
    from sparsetrain.nn import sparsify

    torch.manual_seed(0)
    model = build_model("bert", "tiny", vocab_size=300, seq_len=64, num_hidden_layers=2)
    sparsify(model, targets=["*encoder*"], density=0.5, block=16, format="block")
    model.eval()
    ids = torch.randint(5, 300, (4, 64), generator=torch.Generator().manual_seed(1))
    graphs = {}

    def partition(joint, inputs, **kwargs):
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        raise _Partitioned

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    with compile_settings(TrainArgs(activation_memory_budget=budget)), torch._functorch.config.patch(extra or {}):
        with pytest.raises(Exception) as stopped, use_kernel_options(gelu_recompute=False):
            torch.compile(model, backend=backend)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    assert "_Partitioned" in repr(stopped.value) or isinstance(stopped.value.__cause__, _Partitioned)
    return [str(n.target) for n in graphs["bw"].graph.nodes if n.op == "call_function"]


def _forward_products(ops: list[str]) -> int:
    return sum(op.startswith("sparsetrain.block_sparse_linear.") for op in ops)


def test_under_a_memory_budget_the_sparse_products_are_not_run_again_in_the_backward():
    """At budget 0.7 the partitioner recomputes cheap ops in the backward and keeps the sparse products' outputs;
    left to treat the custom ops as free (torch's default for them), it ran every forward product again there
    (the contrast shows that the check can fail)."""
    full, kept = _backward_ops(1.0), _backward_ops(0.7)
    free = _backward_ops(0.7, {"is_non_builtin_to_include": False})
    assert _forward_products(full) == 0 and _forward_products(kept) == 0
    assert _forward_products(free) >= 8   # 2 layers x 4 linears (query/key/value, output, two FFN)
    assert len(kept) > len(full)          # something cheaper is recomputed instead
