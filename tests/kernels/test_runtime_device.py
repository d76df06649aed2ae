"""Device facts the kernel launchers share (sparsetrain/kernels/_runtime/device.py)."""
import pytest
import torch


def test_raw_stream_reads_the_device_index(monkeypatch):
    from sparsetrain.kernels._runtime import device as _device

    monkeypatch.setattr(_device, "_RAW_STREAM", lambda idx: 1000 + idx)
    assert _device.raw_stream(torch.device("cuda", 3)) == 1003


@pytest.mark.gpu
def test_gpu_raw_stream_is_the_current_stream():
    from sparsetrain.kernels._runtime.device import raw_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    assert raw_stream(dev) == torch.cuda.current_stream(dev).cuda_stream
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert raw_stream(dev) == side.cuda_stream != torch.cuda.default_stream(dev).cuda_stream
        assert raw_stream(torch.device("cuda")) == side.cuda_stream
