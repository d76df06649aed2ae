"""A block-sparse RigL checkpoint resumed on one GPU, as the multi-GPU check resumes BERT-base (bf16, 16x16 blocks
of the block format, RigL updates on both sides of the checkpoint, batches pinned by worker threads), in each step
mode: the resumed run finishes and continues the uninterrupted one. Its first step builds every launch plan
for topologies loaded from the checkpoint (in graph mode on the capture side stream), which no other test does.
``pytest -m gpu`` on the device machine."""
import pytest
import torch

from sparsetrain.sparsity.policies import RigL
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.setup import TrainArgs
from tests.training.test_loop import _spec


def _run(run_dir, cuda_graph, dropout: bool, resume=None) -> tuple[dict, dict[int, float]]:
    args = TrainArgs(max_steps=12, batch_size=8, grad_accum=2, mixed_precision="bf16", eval_every=0, log_every=1,
                     checkpoint_every=6, keep_checkpoints=4, resume=resume, device="cuda", num_workers=2,
                     cuda_graph=cuda_graph, progress=False, plot=False, recipe="resume_gpu")
    spec = _spec(PruneRegrow(RigL(), drop_fraction=0.3, num_updates=4, seed=1), args)   # updates at 2, 4, 6, 8
    spec.sparsify_kwargs["format"] = "block"
    build = spec.build_model

    def build_model():
        model = build()
        if not dropout:   # without dropout the resumed run must follow the uninterrupted one closely
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
            model.config.attention_probs_dropout_prob = 0.0
        return model

    spec.build_model = build_model
    summary = train(spec, run_dir)
    return summary, {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("cuda_graph", ["auto", False])
def test_gpu_block_rigl_checkpoint_resumes_on_one_gpu(tmp_path, cuda_graph, dropout):
    whole, whole_losses = _run(tmp_path / "whole", cuda_graph, dropout)
    middle = tmp_path / "whole" / "checkpoints" / "step_00000006"
    resumed, losses = _run(tmp_path / "resumed", cuda_graph, dropout, resume=str(middle))
    assert resumed["steps"] == 12 and resumed["step_mode"] == whole["step_mode"]
    assert list(losses) == list(range(7, 13)) and all(torch.isfinite(torch.tensor(list(losses.values()))))
    if not dropout:   # bf16 and the kernels' atomic sums: close, not bit-equal (masks may differ by a tie)
        want = torch.tensor([whole_losses[s] for s in losses])
        torch.testing.assert_close(torch.tensor(list(losses.values())), want, rtol=2e-2, atol=2e-2)
