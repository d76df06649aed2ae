"""``sparsetrain bench attention``: its rows and table, on the CPU's SDPA kernels (the GPU run times CUDA's)."""
import pytest
import torch

from sparsetrain.bench import attention


def test_each_backend_is_timed_compared_or_named_as_unable():
    calls = []

    def timer(fn, grads):   # runs what would be timed once, so the forward and backward really run
        fn()
        calls.append(all(g.requires_grad for g in grads))
        return 0.5

    rows = attention.time_backends((2, 3, 5, 8), backends=("MATH", "FLASH_ATTENTION", "CUDNN_ATTENTION"),
                                   layers=4, device="cpu", dtype=torch.float32, timer=timer)
    math, flash, cudnn = rows
    assert math["max_err"] == 0.0 and math["fwd_ms"] == 2.0 and math["fwd_bwd_ms"] == 2.0
    assert 0.0 <= flash["max_err"] < 1e-5          # the CPU flash kernel against the math one
    assert "error" in cudnn and "fwd_ms" not in cudnn   # no cuDNN attention on the CPU
    assert calls == [True] * 4
    text = attention.table(rows, layers=4)
    assert "cannot run" in text and "MATH" in text and "(ms for 4 layers)" in text
    dropped = attention.time_backends((2, 3, 5, 8), backends=("MATH",), dropout=0.1, device="cpu",
                                      dtype=torch.float32, timer=timer)
    assert "max_err" not in dropped[0]              # outputs with dropout are not compared


def test_bad_arguments_are_refused_and_no_gpu_is_said(capsys):
    with pytest.raises(SystemExit):
        attention.main(["--shapes", "vit_b,resnet"])
    assert "--shapes: unknown ['resnet']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attention.main(["--dropout", "1.5"])
    if not torch.cuda.is_available():
        assert attention.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().out
