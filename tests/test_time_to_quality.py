"""recipe=time_to_quality: every arm of its sweep exists, composes and validates, sets the sparsity it says, and keeps
the study's settings (the dense baseline and the sparse arms train the same model, data, optimizer and steps)."""
import pytest
from omegaconf import OmegaConf

from sparsetrain.config import build_run, compose, config_dir


def _arms() -> list[str]:
    cfg = compose(["recipe=time_to_quality"], return_hydra_config=True)
    return str(cfg.hydra.sweeper.params.ttq_arm).split(",")


def test_the_sweep_names_every_arm_file_and_only_those():
    assert sorted(_arms()) == sorted(p.stem for p in (config_dir() / "ttq_arm").glob("*.yaml"))


@pytest.mark.parametrize("arm", _arms())
def test_each_arm_composes_validates_and_shares_the_studys_settings(arm):
    cfg = compose(["recipe=time_to_quality", f"ttq_arm={arm}"])
    spec = build_run(cfg)
    assert spec.train_args.recipe == "time_to_quality"
    sizes = {"wide": "large", "dense": arm.split("_")[-1], "small": "small"}   # dense_small, dense_mini, ...
    size = sizes.get(arm.split("_")[0], "base") if "_" in arm else "base"
    assert (cfg.model.size, cfg.data.source, cfg.trainer.max_steps, cfg.optim.warmup_steps) == \
        (size, "english_large", 1000, 300)
    assert cfg.model.fused_qkv and not cfg.model.fp32_residual            # every arm runs the speed settings
    sparsity = OmegaConf.to_container(cfg.sparsity, resolve=True)
    if arm.startswith("dense"):
        assert sparsity["name"] == "dense"
        return
    assert sparsity["density"] == cfg.study.density and sparsity["format"] == "block"
    assert sparsity["block"] == (16 if "_b16" in arm else 64)
    want = {"then_dense50": 0.5, "then_dense70": 0.7}
    assert sparsity["scheduler"].get("dense_from") == next((v for k, v in want.items() if k in arm), None)


@pytest.mark.slow
def test_a_sweep_ends_with_the_time_to_quality_table_and_curves(tmp_path):
    """Through the CLI, shrunk to a CPU (BERT-tiny, Shakespeare, 6 steps): the dense arm and a sparse-then-dense
    arm run one after another, then the recipe's callback prints the table and writes the curves in the sweep
    folder; the sparse-then-dense run is not taken for a dense baseline."""
    import csv

    from test_cli import TINY, cli

    sweep = tmp_path / "sweep"
    r = cli("train", "-m", "recipe=time_to_quality", "ttq_arm=dense,static_b64_then_dense50", "seed=0",
            "model=bert_tiny", "data=shakespeare", *TINY, "data.seq_len=64", "trainer.max_steps=6",
            "trainer.compile=false", "trainer.batch_size=4", "trainer.eval_every=2", "trainer.log_every=1",
            "trainer.num_workers=0", f"hydra.sweep.dir={sweep}", env={"TRITON_INTERPRET": "0"})
    assert "GPU-seconds to reach eval loss" in r.stdout
    assert (sweep / "ttq_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = list(csv.DictReader(open(sweep / "ttq_curves.csv")))
    assert {p["run"].split()[0] for p in points} == {"dense", "static+dense@0.5"} and len(points) == 6
    table = (sweep / "ttq.md").read_text()
    assert "static+dense@0.5" in table
