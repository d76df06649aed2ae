"""Every YAML composes and instantiates; validation names the offending key before any work."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sparsetrain.config import (
    ConfigError,
    build_run,
    build_scheduler,
    compose,
    config_dir,
    list_recipes,
    recipes_dir,
    validate,
)
from sparsetrain.kernels import KernelOptions
from sparsetrain.sparsity.schedulers import SparsityScheduler

GROUPS = ["model", "data", "sparsity", "optim", "trainer", "logger", "speed"]
NEEDS_USER_VALUE = {"model/hf", "data/text_files", "data/hub_text", "data/image_folder"}


def _options(group):
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def _data_for(model_option):
    return "digits" if model_option.startswith("vit") else "shakespeare"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "model":
        overrides.append(f"data={_data_for(option)}")
    if group == "data" and option in ("digits", "synthetic_images", "image_folder"):
        overrides.append("model=vit_tiny")
    if group == "speed" and option.startswith("vit"):   # a ViT's settings (patch_matmul) are refused for BERT
        overrides += [f"model={option}", "data=digits"]
    cfg = compose(overrides)
    if f"{group}/{option}" in NEEDS_USER_VALUE:
        missing = [k for k in ("name_or_path", "files", "hub_name", "folder") if OmegaConf.is_missing(cfg[group], k)]
        assert missing, "configs that need a user value mark it ??? so Hydra names the key"
        return
    spec = build_run(cfg)
    assert isinstance(spec.scheduler, SparsityScheduler)
    if group == "model":  # instantiate for real, shrunk to one layer so big sizes stay cheap
        model = spec.build_model(num_hidden_layers=1)
        assert model.config.num_hidden_layers == 1
        assert model.config.hidden_size == {"tiny": 128 if option.startswith("bert") else 192, "mini": 256,
                                            "small": 512 if option.startswith("bert") else 384, "medium": 512,
                                            "base": 768, "large": 1024}[option.split("_")[1]]
    if group == "data" and option in ("digits", "synthetic_images"):
        data = spec.build_data()
        assert len(data.train) > 0 and len(data.eval) > 0


@pytest.mark.parametrize("recipe", sorted(list_recipes()))
def test_every_recipe_composes_and_instantiates(recipe):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.recipe_info.name == recipe and cfg.recipe_info.description
    spec = build_run(cfg)
    assert spec.train_args.recipe == recipe
    model = spec.build_model(num_hidden_layers=1)
    assert model is not None
    assert build_scheduler(cfg).name == spec.scheduler.name


def test_recipe_settings_match_their_promise():
    g = compose(["recipe=bert_phase1_dynamic"])
    assert (g.sparsity.density, g.sparsity.block, g.sparsity.scheduler.num_updates) == (0.1, 16, 160)
    assert (g.sparsity.scheduler.drop_fraction, g.sparsity.scheduler.drop_schedule) == (0.5, "cosine")
    assert g.sparsity.scheduler.policy._target_.endswith("SET") and g.model.size == "base"
    r = compose(["recipe=bert_rigl"])
    assert r.sparsity.scheduler.policy._target_.endswith("RigL")
    v = compose(["recipe=vit_24_sparse_then_dense"])
    assert v.sparsity.scheduler.sparse_fraction == 0.7 and v.model.size == "large"
    q = compose(["recipe=quickstart"])
    assert q.sparsity.density == 0.1 and q.sparsity.scheduler.drop_schedule == "cosine" and q.model.size == "tiny"


def test_cuda_graph_compile_needs_a_static_topology(tmp_path):
    from sparsetrain.config import build_run

    cfg = compose(["recipe=quickstart", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"])
    with pytest.raises(ConfigError) as e:  # quickstart updates masks (prune_regrow); found by validate itself
        validate(cfg)
    assert e.value.key == "trainer.compile_mode"
    static = compose(["recipe=quickstart", "sparsity=static", "trainer.compile=true",
                      "trainer.compile_mode=reduce-overhead"])
    validate(static)
    build_run(static)  # fine: the masks never change


def test_cuda_graph_true_where_it_cannot_work_is_refused_naming_the_key(monkeypatch):
    """auto turns whole-step graphs on only where they work; true anywhere else is an error before any work."""
    import torch

    validate(compose(["recipe=quickstart", "trainer.cuda_graph=auto"]))          # auto on a CPU: eager, fine
    validate(compose(["recipe=quickstart", "trainer.cuda_graph=false"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", "trainer.cuda_graph=true"]))
    assert e.value.key == "trainer.cuda_graph" and "not on a CUDA device" in str(e.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for overrides, why in ((["optim=sgd"], "capturable"), (["trainer.mixed_precision=fp16"], "fp16"),
                           (["trainer.compile=true", "trainer.compile_mode=reduce-overhead", "sparsity=static"],
                            "compile_mode")):
        with pytest.raises(ConfigError) as e:
            validate(compose(["recipe=quickstart", "trainer.cuda_graph=true", "trainer.device=auto", *overrides]))
        assert e.value.key == "trainer.cuda_graph" and why in str(e.value), str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "2")     # several processes: each replays its own graph (DDP-style)
    validate(compose(["recipe=quickstart", "trainer.cuda_graph=true", "trainer.device=auto"]))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", "trainer.cuda_graph=true", "trainer.device=auto"]))
    assert e.value.key == "trainer.cuda_graph" and "FSDP" in str(e.value), str(e.value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # several CPU processes (gloo): refused
    with pytest.raises(ConfigError, match="not on a CUDA device"):
        validate(compose(["recipe=quickstart", "trainer.cuda_graph=true"]))


@pytest.mark.parametrize("override,key", [
    ("sparsity.density=1.5", "sparsity.density"),
    ("sparsity.density=0", "sparsity.density"),
    ("sparsity.block=16by16", "sparsity.block"),
    ("sparsity.distribution=gauss", "sparsity.distribution"),
    ("sparsity.format=csr", "sparsity.format"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.batch_size=-1", "trainer.batch_size"),
    ("trainer.mixed_precision=fp8", "trainer.mixed_precision"),
    ("trainer.compile=maybe", "trainer.compile"),
    ("trainer.compile_mode=turbo", "trainer.compile_mode"),
    ("trainer.activation_memory_budget=0", "trainer.activation_memory_budget"),
    ("trainer.activation_memory_budget=1.5", "trainer.activation_memory_budget"),
    ("trainer.activation_memory_budget=half", "trainer.activation_memory_budget"),
    ("trainer.cuda_graph=sometimes", "trainer.cuda_graph"),
    ("optim.lr_schedule=step", "optim.lr_schedule"),
    ("optim.optimizer.lr=-1", "optim.optimizer.lr"),
    ("trainer.resume=/nonexistent/ckpt", "trainer.resume"),
    ("sparsity.scheduler.drop_fraction=2", "sparsity.scheduler"),
    ("sparsity.scheduler.policy._target_=sparsetrain.sparsity.Nope", "sparsity.scheduler.policy._target_"),
    ("sparsity.scheduler._target_=torch.nn.Linear", "sparsity.scheduler._target_"),
    ("model._target_=os.system", "model._target_"),
])
def test_invalid_values_name_the_key(override, key):
    cfg = compose(["recipe=quickstart", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(key), str(e.value)


def test_phase_fraction_validated():
    cfg = compose(["recipe=vit_24_sparse_then_dense", "sparsity.scheduler.sparse_fraction=1.2"])
    with pytest.raises(ConfigError, match="sparse_fraction"):
        validate(cfg)


def test_bad_override_key_is_hydras_error():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="trainer.maxsteps"):
        compose(["recipe=quickstart", "trainer.maxsteps=3"])


def test_config_dirs_exist():
    assert (config_dir() / "train.yaml").is_file()
    assert Path(recipes_dir(), "quickstart.yaml").is_file()


def test_non_editable_install_finds_configs_and_recipes(tmp_path, built_wheel):
    """`pip install .` (not editable) ships configs/ and recipes/ inside the package."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(built_wheel)], check=True, capture_output=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "recipes"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert str(site / "sparsetrain" / "recipes") in out and "quickstart" in out
    out = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "flops", "recipe=quickstart"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, check=True).stdout
    assert "sparse / dense" in out
    r = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "bench", "nope"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "blocksparse|semi24|inference" in r.stderr


def test_switching_method_under_a_recipe_ignores_its_other_scheduler_keys(caplog):
    """`sparsetrain train -m recipe=quickstart sparsity=static,dense` must work for method sweeps, saying so in
    one clean log line (no UserWarning with a source line, issue 19 item 17)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with caplog.at_level("INFO", logger="sparsetrain.config"):
            spec = build_run(compose(["recipe=quickstart", "sparsity=static"]))
    lines = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert lines == ["sparsity.scheduler: Static does not use ['drop_fraction', 'num_updates']; ignoring them"]
    assert spec.scheduler.name == "static" and spec.sparsify_kwargs["density"] == 0.1
    with pytest.raises(ConfigError, match="sparsity.scheduler"):
        build_run(compose(["recipe=quickstart", "sparsity.scheduler.drop_fraction=-1"]))


def test_kernel_options_come_from_the_config():
    spec = build_run(compose(["recipe=quickstart"]))
    assert spec.train_args.kernels == KernelOptions()  # the defaults, for every trainer group option
    for trainer in _options("trainer"):
        assert compose([f"trainer={trainer}"]).trainer.kernels.dense_margin == KernelOptions().dense_margin
    spec = build_run(compose(["recipe=quickstart", "trainer.kernels.dense_fallback=false",
                              "trainer.kernels.dense_margin=1.0", "trainer.kernels.spmm_backend=triton"]))
    assert spec.train_args.kernels == KernelOptions(dense_fallback=False, dense_margin=1.0, spmm_backend="triton")


@pytest.mark.parametrize("override,key", [
    ("trainer.kernels.dense_margin=0", "trainer.kernels.dense_margin"),
    ("trainer.kernels.dense_margin=1.5", "trainer.kernels.dense_margin"),
    ("trainer.kernels.spmm_backend=cuda", "trainer.kernels.spmm_backend"),
    ("trainer.kernels.fast_launch=maybe", "trainer.kernels.fast_launch"),
    ("+trainer.kernels.tma=true", "trainer.kernels.tma"),
])
def test_bad_kernel_option_names_its_key(override, key):
    cfg = compose(["recipe=quickstart", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key, str(e.value)


def test_format_is_a_registered_name_or_a_dotted_path():
    cfg = compose(["recipe=quickstart", "sparsity.format=sparsetrain.nn.formats.MaskedFormat"])
    validate(cfg)
    assert build_run(cfg).sparsify_kwargs["format"] == "sparsetrain.nn.formats.MaskedFormat"
    for bad in ("nope", "sparsetrain.nn.formats.Nope", "torch.nn.Linear"):
        with pytest.raises(ConfigError) as e:
            validate(compose(["recipe=quickstart", f"sparsity.format={bad}"]))
        assert e.value.key == "sparsity.format"


def test_block_is_parsed_once_and_keeps_its_spelling():
    from sparsetrain.sparsity.layout import Block

    spec = build_run(compose(["recipe=quickstart", "sparsity.block=16"]))
    assert spec.sparsify_kwargs["block"] == Block(16, 16) and spec.block_label == "16"
    spec = build_run(compose(["recipe=quickstart", "sparsity.block=[16,32]"]))
    assert spec.sparsify_kwargs["block"] == Block(16, 32)


#: Model settings that change speed and memory, not what is learned: every recipe of one model runs them alike
SPEED_KEYS = ("fused_qkv", "fp32_residual", "attn_implementation", "max_position_embeddings", "patch_matmul")


def test_every_recipe_of_one_model_shares_its_speed_settings():
    """bert_rigl once lacked BERT-base's fused_qkv / fp32_residual and ran at 1.09x dense where its siblings ran
    at 1.26x: the speed settings of a model live in one place (configs/speed/) and no recipe may differ."""
    by_model = {}
    for recipe in sorted(list_recipes()):
        model = compose([f"recipe={recipe}"]).model
        key = (model.get("arch"), model.get("size"))
        by_model.setdefault(key, {})[recipe] = {k: model.get(k) for k in SPEED_KEYS}
    for key, recipes in by_model.items():
        assert len({str(v) for v in recipes.values()}) == 1, f"{key}: recipes differ in speed settings: {recipes}"
    base = by_model[("bert", "base")]
    assert len(base) >= 5 and all(v["fused_qkv"] is True and v["fp32_residual"] is False for v in base.values())
    # the settings come from the model's file in configs/speed/, so that a measured change is made in one place
    recipes_dir = Path(__file__).resolve().parents[1] / "recipes"
    for (arch, size), recipes in by_model.items():
        if size in ("base", "large"):
            for recipe in recipes:
                text = (recipes_dir / f"{recipe}.yaml").read_text()
                assert f"override /speed: {arch}_{size}" in text, f"{recipe}: no speed={arch}_{size} in its defaults"
