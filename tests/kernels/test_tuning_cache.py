"""The tuner's choices kept on disk: the file layer (keys, fingerprint, configs of every backend, corrupt files,
concurrent writers) and the tuner's use of it, with a CUDA device faked on the CPU (its name, capability and
timer are patched; no kernel runs). Every test keeps the cache under tmp_path."""
from __future__ import annotations

import json
import multiprocessing
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from sparsetrain.kernels import KernelOptions, use_kernel_options
from sparsetrain.kernels._runtime import tuning_cache
from sparsetrain.kernels._runtime.tuning_cache import ChoiceFile, decode_config, encode_config, stable_key
from sparsetrain.kernels.blocksparse import Backend, plans, register_backend, tuner, unregister_backend
from sparsetrain.kernels.blocksparse._cuda import CudaDdsConfig, CudaDwConfig, CudaKsConfig
from sparsetrain.kernels.blocksparse.dense import DenseConfig
from sparsetrain.kernels.blocksparse.gather import DdsConfig, DwConfig
from sparsetrain.kernels.blocksparse.testing import forced_config, untuned, use_timer
from sparsetrain.kernels.blocksparse.tma import TmaDdsConfig, TmaDwConfig

assert plans  # registers the built-in backends


class Tile(NamedTuple):
    rows: int
    wide: bool = False


class Loose:
    """A config that is not a NamedTuple: usable by a backend, never kept on disk."""


TYPES = {Tile: "mine"}


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPARSETRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- the file layer ---------------------------------------------------------------------------------------


def test_the_cache_lives_under_the_sparsetrain_cache_folder(cache_root):
    assert tuning_cache.cache_root() == cache_root


def test_stable_key_writes_dtypes_as_strings_and_refuses_other_objects():
    assert stable_key(("fwd", 16, torch.float16, None, True, 0.85, ["cuda", "dense"])) == \
        '["fwd",16,"torch.float16",null,true,0.85,["cuda","dense"]]'
    assert stable_key(("fwd", torch.device("cpu"))) is None
    assert stable_key(("fwd", object())) is None


def test_every_registered_backends_config_type_round_trips():
    """One config of each class every built-in backend registers (non-default fields where there are any)
    comes back equal and of its own class, through the file."""
    configs = [CudaDdsConfig(8, 2, 1), CudaKsConfig(2), CudaDwConfig(16, "tiles"), TmaDdsConfig(64, 4, 3, True),
               TmaDwConfig(128, 8, 3, 2), DdsConfig(32, 2, 4, 8, 3, ".ca", True), DwConfig(8, 64, 4, 4),
               DenseConfig()]
    types = tuner._config_types()
    assert {type(c) for c in configs} == set(types)  # a new config class needs a line here
    kept = ChoiceFile(Path(tuning_cache.cache_root()) / "f.json")
    for i, cfg in enumerate(configs):
        timed = [(cfg, 0.25 + i), (DenseConfig(), 1.5)]
        kept.store(f"k{i}", cfg, timed, types)
    fresh = ChoiceFile(kept.path)
    for i, cfg in enumerate(configs):
        got, timed = fresh.lookup(f"k{i}", types)
        assert got == cfg and type(got) is type(cfg) and type(timed[1][0]) is DenseConfig
        assert timed == [(cfg, 0.25 + i), (DenseConfig(), 1.5)]


def test_unknown_or_changed_config_classes_are_ignored(tmp_path):
    kept = ChoiceFile(tmp_path / "f.json")
    kept.store("k", Tile(64), [(Tile(64), 0.5)], TYPES)
    kept.store("two", Tile(64), [(Tile(64), 0.5), (DenseConfig(), 0.9)], {**TYPES, DenseConfig: "dense"})

    class Other(NamedTuple):
        rows: int

    class TileRenamedField(NamedTuple):  # a class of the same name whose fields changed
        cols: int
        wide: bool = False

    TileRenamedField.__name__ = "Tile"
    fresh = ChoiceFile(kept.path)
    assert fresh.lookup("k", TYPES) == (Tile(64), [(Tile(64), 0.5)])
    assert fresh.lookup("k", {}) is None  # not registered
    assert fresh.lookup("k", {Tile: "theirs"}) is None  # registered under another backend
    assert fresh.lookup("k", {Other: "mine"}) is None  # another class
    assert fresh.lookup("k", {TileRenamedField: "mine"}) is None  # fields do not match
    assert fresh.lookup("two", TYPES) is None  # one of its timed configs is not registered
    assert fresh.lookup("missing", TYPES) is None
    assert decode_config({"backend": "mine", "type": "Tile", "fields": {"rows": 1, "wide": True}}, TYPES) == \
        Tile(1, True)
    assert decode_config({"backend": "mine", "type": "Tile"}, TYPES) is None
    assert decode_config("Tile(1)", TYPES) is None


def test_a_config_that_cannot_be_encoded_is_not_kept(tmp_path):
    kept = ChoiceFile(tmp_path / "f.json")
    kept.store("k", Loose(), [(Loose(), 0.5)], {Loose: "loose"})
    kept.store("k2", Tile(1), [(Tile(1), 0.5), (Loose(), 0.4)], {**TYPES, Loose: "loose"})
    kept.store("k3", Tile((1, 2)), [(Tile((1, 2)), 0.5)], TYPES)  # a field that is no plain value
    assert not kept.path.exists()
    assert encode_config(Tile(3), {}) is None


def _facts(monkeypatch, name="NVIDIA H100 80GB HBM3", capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_the_fingerprint_changes_with_the_gpu_the_software_and_the_sources(tmp_path, monkeypatch):
    import triton

    src = tmp_path / "src"
    (src / "csrc").mkdir(parents=True)
    for name in ("k.py", "csrc/a.cu", "csrc/a.cuh"):
        (src / name).write_text("v1")
    dev = torch.device("cuda", 0)

    def fp():
        tuning_cache.source_digest.cache_clear()  # read once per process: a new process sees new sources
        return tuning_cache.fingerprint(dev, [src])

    _facts(monkeypatch)
    seen = {fp()}
    assert fp() in seen  # stable
    changes = [lambda: _facts(monkeypatch, name="NVIDIA H200"),
               lambda: _facts(monkeypatch, name="NVIDIA H200", capability=(10, 0)),
               lambda: monkeypatch.setattr(torch, "__version__", "9.9.9"),
               lambda: monkeypatch.setattr(triton, "__version__", "9.9.9"),
               lambda: monkeypatch.setattr(torch.version, "cuda", "99.9"),
               lambda: (src / "k.py").write_text("v2"),
               lambda: (src / "csrc/a.cu").write_text("v2"),
               lambda: (src / "csrc/a.cuh").write_text("v2"),
               lambda: (src / "new.py").write_text(""),
               lambda: (src / "csrc/a.cu").rename(src / "csrc/b.cu")]
    for change in changes:
        change()
        now = fp()
        assert now not in seen
        seen.add(now)
    (src / "notes.txt").write_text("not a source")
    assert fp() in seen
    name = tuning_cache.choice_file("blocksparse", dev, [src]).path
    assert name.parent == tuning_cache.cache_root() / "tuning" and name.name == f"blocksparse-{fp()}.json"


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe", b'{"format": 0, "choices": {}}', b"[1, 2]",
                                     b'{"format": 1, "choices": {"k": 3}}'])
def test_a_corrupt_file_is_ignored_with_one_warning_and_replaced(tmp_path, content):
    path = tmp_path / "f.json"
    path.write_bytes(content)
    kept = ChoiceFile(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kept.lookup("k", TYPES) is None
        assert kept.lookup("other", TYPES) is None
        kept.store("k", Tile(8), [(Tile(8), 1.0)], TYPES)
        kept.store("k2", Tile(9), [(Tile(9), 1.0)], TYPES)
    bad_entry_only = content.startswith(b'{"format": 1')  # a valid file with a malformed entry: no warning
    assert len(caught) == (0 if bad_entry_only else 1)
    if caught:
        assert "ignoring the kernel tuning cache" in str(caught[0].message) and str(path) in str(caught[0].message)
    data = json.loads(path.read_text())
    assert set(data["choices"]) == {"k", "k2"}
    assert ChoiceFile(path).lookup("k", TYPES) == (Tile(8), [(Tile(8), 1.0)])


def test_an_unwritable_cache_warns_once_and_keeps_the_choices_in_memory(tmp_path):
    (tmp_path / "a_file").write_text("")
    kept = ChoiceFile(tmp_path / "a_file" / "tuning" / "f.json")  # its folder cannot be made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept.store("k", Tile(8), [(Tile(8), 1.0)], TYPES)
        kept.store("k2", Tile(9), [(Tile(9), 1.0)], TYPES)
    assert len(caught) == 1 and "could not write the kernel tuning cache" in str(caught[0].message)
    assert kept.lookup("k2", TYPES) == (Tile(9), [(Tile(9), 1.0)])


def test_two_writers_merge(tmp_path):
    path = tmp_path / "f.json"
    a, b = ChoiceFile(path), ChoiceFile(path)
    assert a.lookup("x", TYPES) is None and b.lookup("x", TYPES) is None  # both read the (missing) file
    a.store("from_a", Tile(1), [(Tile(1), 1.0)], TYPES)
    b.store("from_b", Tile(2), [(Tile(2), 1.0)], TYPES)
    assert set(json.loads(path.read_text())["choices"]) == {"from_a", "from_b"}
    # a writer whose entry another one dropped (a lost race, simulated) writes it again with its next store
    path.write_text(json.dumps({"format": tuning_cache.FORMAT, "choices": {}}))
    a.store("again", Tile(3), [(Tile(3), 1.0)], TYPES)
    assert set(json.loads(path.read_text())["choices"]) == {"from_a", "again"}
    c = ChoiceFile(path)
    assert c.lookup("from_a", TYPES)[0] == Tile(1) and c.lookup("again", TYPES)[0] == Tile(3)


def _writer(path: str, who: int, n: int) -> None:
    kept = ChoiceFile(Path(path))
    for i in range(n):
        kept.store(f"{who}-{i}", Tile(i), [(Tile(i), float(who))], TYPES)


def test_concurrent_processes_never_leave_a_torn_file(tmp_path):
    """Four processes store 25 entries each at once while this one reads the file: every read is a whole file,
    and each writer's last entry (written with all of its earlier ones) is in the file at the end, unless a
    later write of another writer raced it; at least the last writer's are all there."""
    path = tmp_path / "f.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        if path.exists():
            json.loads(path.read_text())  # never half a file
            reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    choices = json.loads(path.read_text())["choices"]
    assert any(all(f"{w}-{i}" in choices for i in range(25)) for w in range(4))
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


# --- the tuner's use of it, on a faked CUDA device ---------------------------------------------------------


CANDS = [DdsConfig(64, 1, 1, 4, 2), TmaDdsConfig(64, 4, 3), DenseConfig()]
MS = {CANDS[0]: 1.0, CANDS[1]: 0.5, CANDS[2]: 0.8}
KEY = (16, 64, 768, 3072, 4, torch.float16, torch.float16, True)
CUDA = torch.device("cuda", 0)


class FakeGpu:
    """A CUDA device on the CPU: its facts, a GPU timer that counts its calls, no graph capture, and a fresh
    process (:meth:`restart`: the tuner's in-memory choices and open files dropped)."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.timed = monkeypatch, []
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(tuner, "_do_bench", self._bench)
        monkeypatch.setattr(tuner, "_FILES", {})
        _facts(monkeypatch)
        self.restart()

    def _bench(self, cfg, launch):
        self.timed.append(cfg)
        return MS[cfg]

    def restart(self, gpu: str | None = None) -> None:
        tuner._TUNED.clear()
        tuner._TIMED.clear()
        tuner._FILES.clear()
        self.timed.clear()
        if gpu:
            _facts(self.monkeypatch, name=gpu)

    def pick(self, kind="fwd", key=KEY, cands=CANDS):
        return tuner.pick(kind, key, CUDA, cands, lambda cfg: None)

    def files(self):
        return sorted((tuning_cache.cache_root() / "tuning").glob("blocksparse-*.json"))


@pytest.fixture
def gpu(monkeypatch):
    with use_kernel_options(tuning_cache=True):  # the suite turns it off (tests/conftest.py): on here
        yield FakeGpu(monkeypatch)
    tuner._TUNED.clear()
    tuner._TIMED.clear()


def test_a_new_process_reuses_the_choices_without_timing(gpu, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.pick() == CANDS[1] and gpu.timed == CANDS  # first process: all timed, the fastest kept
        assert gpu.pick("dx") == CANDS[1] and len(gpu.timed) == 6
        report = tuner.dense_fallback_report()
        gpu.restart()
        assert gpu.pick() == CANDS[1] and gpu.pick("dx") == CANDS[1] and gpu.timed == []  # read, not timed
        assert type(gpu.pick()) is TmaDdsConfig
    assert tuner.dense_fallback_report() == report == [
        {"key": repr(("fwd", *KEY, *tuner.option_key())), "kernel_ms": 0.5, "dense_ms": 0.8, "chosen": "kernel"},
        {"key": repr(("dx", *KEY, *tuner.option_key())), "kernel_ms": 0.5, "dense_ms": 0.8, "chosen": "kernel"}]
    assert len(tuner.tuned_configs()) == 2 and len(gpu.files()) == 1
    assert capsys.readouterr() == ("", "")  # nothing printed, per pick or per load


def test_another_gpu_times_again_into_a_file_of_its_own(gpu):
    gpu.pick()
    gpu.restart(gpu="NVIDIA A100-SXM4-80GB")
    assert gpu.pick() == CANDS[1] and gpu.timed == CANDS
    assert len(gpu.files()) == 2


def test_the_key_holds_the_options_and_backend_names_but_not_the_registry_generation(gpu):
    gpu.pick()
    gpu.restart()
    with use_kernel_options(dense_margin=1.0):  # another margin: another choice
        gpu.pick()
    assert gpu.timed == CANDS
    gpu.restart()
    register_backend(Backend("reference", (Tile,), candidates=lambda p: [], make_plan=lambda c, p: None))
    try:  # another backend registered: the choice may differ
        gpu.pick()
        assert gpu.timed == CANDS
    finally:
        unregister_backend("reference")
    gpu.restart()
    assert gpu.pick() == CANDS[1] and gpu.timed == []  # the same backends again, at another generation


def test_a_kept_choice_not_offered_now_is_timed_again(gpu):
    gpu.pick()
    gpu.restart()
    # e.g. the CUDA kernels were kept but nvcc is missing here: the rest are timed (dense wins by the margin)
    assert gpu.pick(cands=[CANDS[0], CANDS[2]]) == CANDS[2] and gpu.timed == [CANDS[0], CANDS[2]]


def test_the_hooks_and_the_option_keep_the_disk_out(gpu):
    gpu.pick()
    kept = gpu.files()[0].read_text()
    gpu.restart()
    with use_timer(lambda cfg, launch: {CANDS[0]: 0.1}.get(cfg, 1.0)):  # a test's timer: disk not read
        assert gpu.pick() == CANDS[0]
        assert gpu.pick("dw") == CANDS[0]  # ... nor written
    with forced_config(fwd=CANDS[2]):
        assert gpu.pick() == CANDS[2]
    gpu.restart()
    with untuned():
        assert gpu.pick() == CANDS[0]
    with use_kernel_options(tuning_cache=False):
        assert gpu.pick() == CANDS[1] and gpu.timed == CANDS  # not read
        assert gpu.pick("dw") == CANDS[1]  # not written
    assert gpu.files()[0].read_text() == kept and len(gpu.files()) == 1
    gpu.restart()
    assert gpu.pick() == CANDS[1] and gpu.timed == []


def test_an_entry_of_a_removed_backend_is_timed_again(gpu):
    """A file of an older version may name a config class no backend registers now (the span backend's
    SpanConfig, removed): such an entry is skipped without a warning (no class is looked up by its name outside
    the registered ones), timed again and replaced."""
    gpu.pick()
    gpu.pick("dx")
    path = gpu.files()[0]
    data = json.loads(path.read_text())
    gone = {"backend": "span", "type": "SpanConfig",
            "fields": {"block_t": 64, "span": 8, "group_k": 2, "num_warps": 4, "num_stages": 4}}
    for key, entry in data["choices"].items():
        if json.loads(key)[0] == "fwd":    # the chosen config is the removed one
            entry["config"], entry["timed"] = gone, [[gone, 0.1], *entry["timed"]]
        else:                              # only among the timed ones
            entry["timed"].append([gone, 0.1])
    path.write_text(json.dumps(data))
    types = tuner._config_types()
    assert all(ChoiceFile(path).lookup(k, types) is None for k in data["choices"])
    assert decode_config({**gone, "backend": "dense", "type": "eval"}, types) is None
    gpu.restart()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.pick() == CANDS[1] and gpu.pick("dx") == CANDS[1] and gpu.timed == CANDS + CANDS
    assert "SpanConfig" not in path.read_text()
    gpu.restart()
    assert gpu.pick() == CANDS[1] and gpu.pick("dx") == CANDS[1] and gpu.timed == []


def test_a_cuda_dw_entry_from_before_its_layout_field_is_timed_again(gpu, monkeypatch):
    """A file written while CudaDwConfig held only its chunk size (fields ``{"tc": 32}``, no ``layout``) names
    configs whose fields no longer match the class: such an entry is skipped without a warning (not read as either
    layout), both layouts are timed again and the entry is replaced."""
    dw = [CudaDwConfig(32), CudaDwConfig(32, "tiles"), DenseConfig()]
    for cfg, ms in zip(dw, (0.6, 0.4, 0.9)):
        monkeypatch.setitem(MS, cfg, ms)
    assert gpu.pick("dw", cands=dw) == dw[1] and gpu.timed == dw
    path = gpu.files()[0]
    data = json.loads(path.read_text())
    types = tuner._config_types()
    before = {"backend": "cuda", "type": "CudaDwConfig", "fields": {"tc": 32}}
    (key, entry), = data["choices"].items()
    entry["config"], entry["timed"] = before, [[before, 0.1], [encode_config(DenseConfig(), types), 0.9]]
    path.write_text(json.dumps(data))
    assert ChoiceFile(path).lookup(key, types) is None
    assert decode_config(before, types) is None
    assert decode_config({**before, "fields": {"tc": 32, "layout": "tiles"}}, types) == dw[1]
    gpu.restart()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.pick("dw", cands=dw) == dw[1] and gpu.timed == dw
    assert ChoiceFile(path).lookup(key, types) == (dw[1], list(zip(dw, (0.6, 0.4, 0.9))))
    gpu.restart()
    assert gpu.pick("dw", cands=dw) == dw[1] and gpu.timed == []


def test_a_corrupt_cache_is_timed_over_and_replaced(gpu):
    gpu.pick()
    gpu.files()[0].write_text("garbage")
    gpu.restart()
    with pytest.warns(UserWarning, match="ignoring the kernel tuning cache"):
        assert gpu.pick() == CANDS[1] and gpu.timed == CANDS
    gpu.restart()
    assert gpu.pick() == CANDS[1] and gpu.timed == []


def test_tuning_cache_is_a_validated_kernel_option():
    from omegaconf import OmegaConf

    from sparsetrain.config import ConfigError, kernel_options

    assert KernelOptions().tuning_cache is True
    with pytest.raises(ValueError, match="tuning_cache"):
        KernelOptions(tuning_cache="yes")
    cfg = OmegaConf.create({"trainer": {"kernels": {"tuning_cache": False}}})
    assert kernel_options(cfg) == KernelOptions(tuning_cache=False)
    with pytest.raises(ConfigError, match="trainer.kernels.tuning_cache"):
        kernel_options(OmegaConf.create({"trainer": {"kernels": {"tuning_cache": "maybe"}}}))
