"""scripts/plot_e2e_summary.py: several bench e2e JSON files into one CSV and one PNG."""
import csv
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_e2e_summary.py"


def _load():
    spec = importlib.util.spec_from_file_location("plot_e2e_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_json(path: Path, rows: list[tuple]) -> str:
    table = [{"variant": v, "mode": "compiled", "rate": r, "x_dense": x, "peak_gb": g, "x_dense_mem": m,
              "clock_mhz": c, "power_w": 600.0} for v, r, x, g, m, c in rows]
    path.write_text(json.dumps({"table": table}))
    return str(path)


def test_runs_become_one_csv_and_one_png(tmp_path):
    script = _load()
    bert = _bench_json(tmp_path / "b.json", [("dense", 100.0, 1.0, 10.0, 1.0, 1800.0),
                                             ("static_b16", 120.0, 1.2, 7.5, 0.75, 1980.0)])
    vit = _bench_json(tmp_path / "v.json", [("dense", 10.0, 1.0, 20.0, 1.0, 1750.0),
                                            ("semi24", 9.6, 0.96, 20.1, 1.005, 1690.0)])
    out = str(tmp_path / "summary")
    assert script.main(["--out", out, f"BERT={bert}", f"ViT={vit}"]) == 0
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["variant"], float(r["x_dense"])) for r in rows] == [
        ("BERT", "dense", 1.0), ("BERT", "static_b16", 1.2), ("ViT", "dense", 1.0), ("ViT", "semi24", 0.96)]
    assert Path(out + ".png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        script.main(["--out", out, "no-label.json"])
