"""An optimizer's step made capturable into a CUDA graph (``capturable``, ``lr`` and the step counts on the
device) and made eager again (a checkpoint of a graph run resumed without graphs)."""
from __future__ import annotations

import torch


def make_graph_safe(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Let ``optimizer.step()`` be captured: ``capturable`` on, the step counts and each group's ``lr`` on the
    device (an LR scheduler then refills the tensor in place, which a replay reads). Raises ``ValueError`` for
    an optimizer that cannot be captured."""
    groups = optimizer.param_groups
    if not groups or "capturable" not in groups[0]:
        raise ValueError(f"{type(optimizer).__name__} has no 'capturable' option, so its step cannot be replayed "
                         "from a CUDA graph; use torch.optim.AdamW or Adam (or trainer.cuda_graph=false)")
    for group in groups:
        group["capturable"] = True
        lr = group["lr"]
        group["lr"] = lr.to(device) if torch.is_tensor(lr) else torch.tensor(float(lr), device=device)
        if "initial_lr" in group and torch.is_tensor(group["initial_lr"]):
            group["initial_lr"] = group["initial_lr"].to(device)
    for state in optimizer.state.values():  # a resumed optimizer: its step counts were loaded on the host
        if torch.is_tensor(state.get("step")) and state["step"].device != device:
            state["step"] = state["step"].to(device)


def make_eager_safe(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`make_graph_safe` for an eager run (a checkpoint written by a graph run stores ``capturable``
    and a tensor ``lr`` in its param groups): ``lr`` a float again, ``capturable`` off, and each step count
    where the non-capturable update reads it (the parameter's device for a fused optimizer, else the CPU)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group.get("lr")):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
        fused = bool(group.get("fused"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if torch.is_tensor(step):
                want = p.device if fused else torch.device("cpu")
                if step.device != want:
                    state["step"] = step.to(want)
