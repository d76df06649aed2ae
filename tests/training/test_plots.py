"""sparsetrain.training.plots: curves.png from a run's metrics."""
import pytest

from sparsetrain.training.metrics import MetricsLogger, write_summary
from sparsetrain.training.plots import plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path, min_bytes=10_000):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > min_bytes
    img = mpimg.imread(path)
    assert img.std() > 0.05, "image is (nearly) blank"
    return img


def test_plot_run_writes_png(tmp_path, write_run):
    write_run(tmp_path)
    with MetricsLogger(tmp_path) as log:
        log.log({"step": 121, "loss": float("nan"), "density": 0.1})
    write_summary(tmp_path, status="finished", method="prune_regrow/random", density=0.1)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    _check_png(out)
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path / "empty")
