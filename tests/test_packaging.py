"""The wheel holds everything a non-editable install needs: every package, the configs and recipes, the CUDA
sources the kernels compile at run time and the benchmarks `sparsetrain bench` runs."""
import zipfile
from pathlib import Path

from sparsetrain.bench import BENCHES

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_packages_configs_recipes_csrc_and_benches(built_wheel):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "sparsetrain").rglob("__init__.py")}
    missing = sorted(f"{p}/__init__.py" for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel (add them to pyproject.toml): {missing}"
    for module in BENCHES.values():
        assert module.replace(".", "/") + ".py" in names, module
    csrc = [p for ext in ("*.cu", "*.cuh") for p in (ROOT / "sparsetrain").rglob(ext)]
    assert any(p.parent.parent.name == "_runtime" for p in csrc)
    for p in csrc:
        assert p.relative_to(ROOT).as_posix() in names, p
    for folder in ("configs", "recipes"):
        yamls = sorted((ROOT / folder).rglob("*.yaml"))
        assert yamls
        for p in yamls:
            assert f"sparsetrain/{folder}/{p.relative_to(ROOT / folder).as_posix()}" in names, p
    assert "sparsetrain/configs/trainer/kernels/default.yaml" in names
    assert "hydra_plugins/sparsetrain_gpus/gpus.py" in names            # hydra/launcher=gpus
    assert "hydra_plugins/__init__.py" not in names                    # Hydra's namespace package stays open
