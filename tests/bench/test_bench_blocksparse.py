"""``sparsetrain bench blocksparse`` without a GPU: its plot of the linear section, from saved result files."""
import json

from sparsetrain.bench import blocksparse
from sparsetrain.bench._blocksparse_plot import load_rows


def _run(speed: float) -> dict:
    row = {f"b{b}_d{d}": {"speedup": {"fwd_bwd": speed * b * (1 - d), "peer_fwd": 0.5}}
           for b in (16, 64) for d in (0.1, 0.5)}
    return {"results": {"env": {"gpu": "test", "date": "2026-11-21"},
                        "linear": {"1024x4096": {"dense": {"fwd": 1.0}, **row}, "tuned": {}}}}


def test_replot_merges_runs_and_writes_png(tmp_path):
    """Two hand-made result files: the later file's row replaces the earlier one's, and a PNG is written."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(1.0)))
    later = _run(2.0)
    del later["results"]["linear"]["1024x4096"]["b64_d0.1"]
    later["results"]["linear"]["1024x4096"]["b16_d0.5"] = {"error": "out of memory"}  # an error keeps the old row
    b.write_text(json.dumps(later))
    rows, env = load_rows([str(a), str(b)])
    assert env["gpu"] == "test"
    assert rows["1024x4096"]["b16_d0.1"]["speedup"]["fwd_bwd"] == 2.0 * 16 * 0.9  # replaced by the later file
    assert rows["1024x4096"]["b64_d0.1"]["speedup"]["fwd_bwd"] == 1.0 * 64 * 0.9  # kept from the earlier one
    assert rows["1024x4096"]["b16_d0.5"]["speedup"]["fwd_bwd"] == 1.0 * 16 * 0.5
    png = tmp_path / "p.png"
    assert blocksparse.main(["--replot", str(a), str(b), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_report_creates_its_out_directory(tmp_path):
    """--out may name a directory that does not exist yet: the report makes it before its first save (a GPU run
    lost its candidates section to a FileNotFoundError there)."""
    out = tmp_path / "new" / "dir"
    rep = blocksparse.Report(str(out), ["sparsetrain", "bench", "blocksparse"])
    rep.results["candidates"] = {"768x768": 1}
    rep.save()
    assert json.loads((out / "bench_blocksparse.json").read_text())["results"] == {"candidates": {"768x768": 1}}
