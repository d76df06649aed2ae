"""Extending sparsity from outside the package (a policy, a scheduler, each in a user's module), the layer
protocol, the capability hooks the training code calls, and the floor rule: sparsity imports neither nn nor
kernels."""
import ast
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import sparsetrain
from sparsetrain.nn import sparsify
from sparsetrain.sparsity import (
    PruneRegrow,
    SparseLayer,
    SparseThenDense,
    Static,
    sparse_layers,
)
from sparsetrain.sparsity.layout import block_reduce, to_element_mask
from sparsetrain.sparsity.nm import is_transposable_nm


def _user_module(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def _train_step(model, optim):
    loss = nn.functional.mse_loss(model(torch.randn(8, 32)), torch.randn(8, 16))
    optim.zero_grad()
    loss.backward()
    optim.step()


def test_policy_from_a_user_module_drives_prune_regrow(tmp_path, monkeypatch):
    user = _user_module(tmp_path, monkeypatch, "tmp_user_policies", """
        import torch
        from sparsetrain.sparsity import SET

        class GrowFirstFree(SET):
            '''SET, but regrow the inactive blocks that come first in row-major order (a per-block score).'''

            def grow_scores(self, weight, grad, mask):
                return -torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape)
    """)
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=0.25, block=4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = PruneRegrow(policy=user.GrowFirstFree(), drop_fraction=0.5, num_updates=1, start=0.0, end=1.0)
    sched.attach(model, optim, total_steps=4)
    update_step = next(s for s in range(1, 5) if sched.schedule.is_update_step(s))
    for step in range(1, update_step):
        _train_step(model, optim)
        assert sched.step(step) is None
    _train_step(model, optim)
    before = {n: (layer.mask.clone(), layer.dense_weight()) for n, layer in layers.items()}
    record = sched.step(update_step)
    assert record["event"] == "mask_update" and record["pruned"] == record["regrown"] > 0
    for name, layer in layers.items():
        old, w = before[name]
        n = round(record["drop_fraction"] * int(old.sum()))
        # dropped: the n active blocks of smallest L1 norm; grown: the first n blocks inactive before
        norms = block_reduce(w.abs(), layer.block).masked_fill(~old, float("inf")).flatten()
        dropped = torch.zeros(old.numel(), dtype=torch.bool)
        dropped[torch.argsort(norms, stable=True)[:n]] = True
        grown = torch.zeros(old.numel(), dtype=torch.bool)
        grown[(~old).flatten().nonzero().flatten()[:n]] = True
        assert n > 0 and layer.mask.equal((old.flatten() & ~dropped | grown).reshape(old.shape)), name
        regrown = to_element_mask(layer.mask & ~old, layer.block)
        assert torch.all(layer.dense_weight()[regrown] == 0)  # regrown weights start at zero


_USER_SCHEDULER = """
from sparsetrain.sparsity import SparsityScheduler


class PruneOneEveryOtherStep(SparsityScheduler):
    '''Every second step, switch off the first active block of every layer.'''

    name = "prune_one"

    def _update(self, step):
        if step % 2:
            return None
        for layer in self.layers.values():
            mask = layer.mask.clone()
            first = mask.flatten().nonzero()[0]
            mask.view(-1)[first] = False
            layer.set_mask(mask, self.optimizer)
        return {"event": "mask_update", "pruned": len(self.layers), "regrown": 0}
"""


def test_scheduler_from_a_user_module_through_attach_and_step(tmp_path, monkeypatch):
    user = _user_module(tmp_path, monkeypatch, "tmp_user_schedulers", _USER_SCHEDULER)
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=0.5, block=4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = user.PruneOneEveryOtherStep()
    sched.set_targets({n: 0.1 for n in layers})  # the base class hooks exist and do nothing here
    sched.prepare_flop_count(layers)
    sched.attach(model, optim, total_steps=6)
    start = {n: layer.n_active for n, layer in layers.items()}
    for step in range(1, 7):
        _train_step(model, optim)
        record = sched.step(step)
        assert (record is None) == (step % 2 == 1)
        for name, layer in layers.items():
            assert layer.n_active == start[name] - step // 2
            assert torch.all(layer.weight.detach()[~layer.element_mask()] == 0)
    assert record["step"] == 6 and sched.state_dict() == {"name": "prune_one", "step": 6, "seed": 0}
    total = sum(layer.in_features * layer.out_features for layer in layers.values())
    assert sched.density == pytest.approx(sum(layer.n_active * 16 for layer in layers.values()) / total)


def test_sparse_layers_by_protocol():
    model = _mlp()
    layers = sparsify(model, targets=["0"], exclude=[], density=0.5, block=4)
    found = sparse_layers(model)
    assert list(found) == ["0"] and found["0"] is layers["0"]
    assert isinstance(layers["0"], SparseLayer) and not isinstance(model[2], SparseLayer)


def test_sparse_then_dense_prepares_its_2_4_phase_for_the_flop_count():
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=1.0, block=1, format="masked")
    SparseThenDense().prepare_flop_count(layers)
    for layer in layers.values():
        assert layer.caps.straight_through and is_transposable_nm(layer.mask)
        assert layer.density == pytest.approx(0.5)
    Static().prepare_flop_count(layers)  # the default: nothing to do


def test_sparse_then_dense_swaps_in_dense_phase_modules():
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=1.0, block=1, format="2:4")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = SparseThenDense(sparse_fraction=0.5).attach(model, optim, total_steps=4)
    params = {n: layer.weight_parameter() for n, layer in layers.items()}
    for step in range(1, 5):
        _train_step(model, optim)
        sched.step(step)
    for name, p in params.items():
        assert type(model.get_submodule(name)) is nn.Linear and model.get_submodule(name).weight is p
    assert sparse_layers(model) == {} and sched.density == 1.0


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                pkg = ".".join(["sparsetrain", *path.relative_to(Path(sparsetrain.__file__).parent).parts[:-1]])
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_sparsity_imports_neither_nn_nor_kernels():
    """Including lazy imports inside functions: every import statement of the package is checked."""
    root = Path(sparsetrain.__file__).parent / "sparsity"
    for path in sorted(root.rglob("*.py")):
        bad = [m for m in _imported_modules(path)
               if m.startswith(("sparsetrain.nn", "sparsetrain.kernels", "sparsetrain.training"))]
        assert not bad, f"{path.name} imports {bad}"
