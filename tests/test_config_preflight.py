"""Issue 19 (hardening), bad input: everything that can be checked is checked by validate() before any model,
data or file is touched, with one line naming the key; _target_ paths are checked before anything is imported."""
import json
import shlex
import sys

import pytest
import torch

from sparsetrain import cli
from sparsetrain.config import ConfigError, build_run, compose, validate


def _key_of(overrides):
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", *overrides]))
    assert "\n" not in str(e.value)
    return e.value.key


def _damaged_model_dir(tmp_path, weights: bytes, config: str = '{"model_type": "bert"}'):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config)
    (d / "model.safetensors").write_bytes(weights)
    return d


# ---- item 8: values that used to fail after config.yaml was written --------------------------------------
def test_data_and_model_values_are_checked_up_front(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert _key_of(["data.seq_len=2"]) == "data.seq_len"
    assert _key_of(["data.vocab_size=3"]) == "data.vocab_size"
    assert _key_of(["data=text_files", f"data.files=[{empty}]"]) == "data.files"
    assert _key_of(["data=text_files"]) == "data.files"  # ??? is named, not handed to the builder
    assert _key_of(["model=hf"]) == "model.name_or_path"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    for weights in (b"garbage", len(header).to_bytes(8, "little") + header + b"\0" * 3):  # bad header, truncated
        d = _damaged_model_dir(tmp_path, weights)
        assert _key_of(["model=hf", f"model.name_or_path={d}"]) == "model.name_or_path"
        d.rename(tmp_path / f"old{len(weights)}")
    d = _damaged_model_dir(tmp_path, b"", config="{not json")
    assert _key_of(["model=hf", f"model.name_or_path={d}"]) == "model.name_or_path"


def test_loading_failures_become_one_line_naming_the_key(tmp_path):
    """What the cheap checks cannot see is turned into a ConfigError at the builder boundary."""
    from sparsetrain.config import model_builder

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
                                               "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "intermediate_size": 16}))
    (d / "pytorch_model.bin").write_bytes(b"not a torch file")
    build = model_builder(compose(["recipe=quickstart", "model=hf", f"model.name_or_path={d}"]))
    with pytest.raises(ConfigError) as e:
        build()
    assert e.value.key == "model.name_or_path" and "\n" not in str(e.value)


def test_unreadable_text_files_name_the_key(tmp_path):
    from sparsetrain.data.documents import file_documents

    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"^files: cannot read"):
        file_documents([str(bad)], "text", 0.5, tmp_path / "cache")


# ---- item 8: no run dir, no overwritten config ------------------------------------------------------------
@pytest.mark.parametrize("override", ["data.seq_len=2", "model=hf", "trainer.device=cuda"])
def test_a_rejected_config_creates_no_dir_and_keeps_an_existing_run(tmp_path, capsys, monkeypatch, override):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    new = tmp_path / "runs" / "new"
    assert cli.main(["train", "recipe=quickstart", override, f"hydra.run.dir={new}"]) == 2
    assert not (tmp_path / "runs").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text("seed: 7\n")
    assert cli.main(["train", "recipe=quickstart", override, f"hydra.run.dir={old}"]) == 2
    assert (old / "config.yaml").read_text() == "seed: 7\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err


def test_a_run_failing_after_hydra_made_its_dir_leaves_no_empty_dir(tmp_path, monkeypatch, capsys):
    """Failures only the run can find (inside train) remove the directory Hydra created for it, if empty."""
    import sparsetrain.training.loop as loop

    def fail(spec, run_dir):
        raise ValueError("data.files: found only while reading")

    monkeypatch.setattr(loop, "train", fail)
    new = tmp_path / "a" / "b"
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "recipe=quickstart", f"hydra.run.dir={new}"])
    assert e.value.code == 2 and not (tmp_path / "a").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        cli.main(["train", "recipe=quickstart", f"hydra.run.dir={kept}"])
    assert (kept / "notes.txt").read_text() == "mine"
    assert "error: data.files: found only while reading" in capsys.readouterr().err


def test_a_sweep_is_validated_job_by_job_before_anything_runs(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    rc = cli.main(["train", "-m", "recipe=quickstart", "data.seq_len=64,2", f"hydra.sweep.dir={sweep}"])
    assert rc == 2 and not sweep.exists()
    assert capsys.readouterr().err.startswith("error: data.seq_len:")


# ---- item 9: format vs scheduler, block / targets / overrides name key and layer -----------------------------
def test_two_four_format_needs_a_scheduler_that_keeps_two_four_masks():
    assert _key_of(["sparsity.format=2:4", "sparsity.block=1"]) == "sparsity.format"  # prune_regrow
    validate(compose(["recipe=quickstart", "sparsity=static", "sparsity.format=2:4", "sparsity.block=1"]))
    validate(compose(["recipe=vit_24_sparse_then_dense"]))


def test_gradual_pruning_with_a_format_that_cannot_shrink_is_refused_up_front(monkeypatch):
    # the block format rebuilds its values at the new count; a straight-through format cannot shrink at all,
    # nor can the block format while FSDP shards its values (refused before any work, naming the key)
    validate(compose(["recipe=quickstart", "sparsity=gradual", "sparsity.format=block", "sparsity.block=16"]))
    assert _key_of(["sparsity=gradual", "sparsity.format=masked_st"]) == "sparsity.format"
    validate(compose(["recipe=quickstart", "sparsity=gradual", "sparsity.format=masked"]))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert _key_of(["sparsity=gradual", "sparsity.format=block", "sparsity.block=16"]) == "sparsity.format"
    validate(compose(["recipe=quickstart", "sparsity=gradual", "sparsity.format=masked"]))


def test_layout_errors_name_the_key_and_the_layer():
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", "sparsity.block=3"]))
    assert str(e.value) == "sparsity.block: 3x3 does not divide layer bert.encoder.layer.0.attention.self.query " \
                           "(128, 128)"
    from sparsetrain.models import build_model
    from sparsetrain.nn import sparsify

    with pytest.raises(ValueError, match=r"^block 3x3 does not divide layer bert\.encoder\.layer\.0\.attention\."
                                         r"self\.query \(128, 128\)$"):  # the library says which layer too
        sparsify(build_model("bert", "tiny", vocab_size=100, seq_len=16), density=0.5, block=3)
    assert _key_of(["sparsity.targets=[*nothing*]"]) == "sparsity.targets"
    assert _key_of(["sparsity.density_overrides={*nothing*: 0.3}"]) == "sparsity.density_overrides"


# ---- item 10: the machine ------------------------------------------------------------------------------
def test_cuda_and_fp16_without_a_gpu_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _key_of(["trainer.device=cuda"]) == "trainer.device"
    assert _key_of(["trainer.mixed_precision=fp16"]) == "trainer.mixed_precision"
    validate(compose(["recipe=quickstart", "trainer.mixed_precision=bf16"]))  # bf16 trains on the CPU


# ---- item 11: check first, import after -----------------------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("sparsity.scheduler.policy._target_=this.Foo", "sparsity.scheduler.policy._target_"),
    ("sparsity.scheduler._target_=this.Foo", "sparsity.scheduler._target_"),
    ("optim.optimizer._target_=this.Foo", "optim.optimizer._target_"),
    ("model._target_=this.Foo", "model._target_"),
    ("sparsity.format=this.Foo", "sparsity.format"),
])
def test_a_refused_target_is_never_imported(override, key, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    assert _key_of([override]) == key
    assert "this" not in sys.modules
    assert "Beautiful is better than ugly" not in capsys.readouterr().out


# ---- item 15: the documented density_overrides form -------------------------------------------------------
README_DENSITY_OVERRIDES = "sparsetrain train recipe=quickstart 'sparsity.density_overrides={*.attention.*: 0.3}'"


def test_the_documented_density_overrides_form_parses():
    argv = shlex.split(README_DENSITY_OVERRIDES)[2:]  # what the shell hands to sparsetrain
    spec = build_run(compose(argv))
    assert spec.sparsify_kwargs["density_overrides"] == {"*.attention.*": 0.3}
    assert build_run(compose(["recipe=quickstart", "+sparsity.density_overrides={*attention*:0.3}"]))


# ---- flops: the dense-gradient cost is said only for a policy that needs it ---------------------------------
def test_flops_names_the_update_cost_only_for_a_dense_gradient_policy(capsys):
    assert cli.main(["flops", "recipe=quickstart"]) == 0  # SET
    total = [line for line in capsys.readouterr().out.splitlines() if line.startswith("training total")]
    assert len(total) == 1 and "dense gradient" not in total[0] and "RigL" not in total[0]
    assert cli.main(["flops", "recipe=quickstart", "sparsity=rigl"]) == 0
    out = capsys.readouterr().out
    assert "RigL's dense gradient adds" in out and "RigL adds" not in out


def test_a_recipe_s_own_sweep_grid_is_validated_too(tmp_path, capsys):
    # pareto_bert_small keeps its grid in hydra.sweeper.params; forcing a straight-through format makes its
    # gradual points invalid (that format cannot shrink), which must stop the sweep before any run starts
    sweep = tmp_path / "multirun"
    rc = cli.main(["train", "-m", "recipe=pareto_bert_small", "sparsity.format=masked_st",
                   f"hydra.sweep.dir={sweep}"])
    assert rc == 2 and not sweep.exists()
    assert capsys.readouterr().err.startswith("error: sparsity.")
    # the command line wins per key: the same grid restricted to valid points passes
    problem, _ = cli._prevalidate(["-m", "recipe=pareto_bert_small", "sparsity=static", "sparsity.block=16,64",
                                   "sparsity.density=0.1", f"hydra.sweep.dir={sweep}"])
    assert problem is None


# ---- issue 38 item 1: each _target_ slot takes only what belongs in it ------------------------------------
EXPLOIT = ["recipe=vit_digits", "logger=quiet", "trainer.max_steps=2",
           "model._target_=sparsetrain.bench._child.run_child", "~model.arch", "~model.size", "~model.image_size",
           "~model.patch_size", "~model.num_labels", "~model.attn_implementation", "~model.fused_qkv",
           "~model.fp32_residual", "~model.num_hidden_layers", "+model.cmd=[touch,PWNED]", "+model.stdout=null"]


def test_a_package_callable_in_the_model_slot_cannot_run_a_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *EXPLOIT, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: model._target_: 'sparsetrain.bench._child.run_child' is "
                                               "not a model builder"), err
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "run").exists()


HELPER = "sparsetrain.bench._child.run_child"


@pytest.mark.parametrize("override,key,why", [
    (f"data._target_={HELPER}", "data._target_", "is not a data builder"),
    (f"optim.optimizer._target_={HELPER}", "optim.optimizer._target_", "is not a torch.optim.optimizer.Optimizer"),
    (f"sparsity.scheduler._target_={HELPER}", "sparsity.scheduler._target_", "SparsityScheduler subclass"),
    (f"sparsity.scheduler.policy._target_={HELPER}", "sparsity.scheduler.policy._target_", "Policy subclass"),
    (f"sparsity.format={HELPER}", "sparsity.format", "not a WeightFormat subclass"),
    ("model._target_=torch.optim.SGD", "model._target_", "is not a model builder"),
    ("allowed_targets=[sparsetrain.bench.]", "allowed_targets", "is not a module of your own"),
])
def test_every_target_slot_refuses_what_does_not_belong_in_it(override, key, why):
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", override]))
    assert e.value.key == key and why in str(e.value) and "\n" not in str(e.value)


def test_a_users_own_model_builder_is_accepted_through_allowed_targets(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "from sparsetrain.models import build_model\n\n"
        "def tiny_bert(**kw):\n    return build_model(**{**kw, 'num_hidden_layers': 1})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["recipe=quickstart", "model._target_=my_models.tiny_bert"]
    with pytest.raises(ConfigError, match="is not a model builder"):   # not without allowed_targets
        validate(compose(overrides))
    cfg = compose([*overrides, "allowed_targets=[my_models.]"])
    validate(cfg)
    model = build_run(cfg).build_model()
    assert model.config.num_hidden_layers == 1


def test_hydra_callbacks_and_a_string_allowed_targets_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "recipe=quickstart", "logger=quiet", "trainer.max_steps=1",
            f"+hydra.callbacks.x._target_={HELPER}", "+hydra.callbacks.x.cmd=[touch,PWNED2]",
            "+hydra.callbacks.x.stdout=null", f"hydra.run.dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: hydra.callbacks:")
    assert not (tmp_path / "PWNED2").exists() and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError) as e:   # a string would be split into one-letter prefixes
        validate(compose(["recipe=quickstart", "allowed_targets=my_models."]))
    assert e.value.key == "allowed_targets"
