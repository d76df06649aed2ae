"""Held-out evaluation during training: mean loss (and accuracy for image classification) over a few batches."""
from __future__ import annotations

import torch

from sparsetrain.training.batches import Batches, to_device


def evaluate(model: torch.nn.Module, accelerator, batches: Batches, max_batches: int) -> dict[str, float]:
    """``{"eval_loss": ...}`` (and ``eval_accuracy`` when the batches hold ``pixel_values``) over the first
    ``max_batches`` held-out batches, averaged over processes; the model is in eval mode meanwhile."""
    model.eval()
    total, correct, count, n = torch.zeros((), device=accelerator.device), 0, 0, 0
    with torch.no_grad():
        for b in range(min(max_batches, batches.per_epoch)):
            batch = to_device(batches.get(b), accelerator.device)
            with accelerator.autocast():
                out = model(**batch)
            total += out.loss.float()
            n += 1
            if "pixel_values" in batch:
                correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
                count += len(batch["labels"])
    model.train()
    loss = accelerator.reduce(total / max(n, 1), reduction="mean").item()
    row = {"eval_loss": loss}
    if count:
        row["eval_accuracy"] = accelerator.reduce(torch.tensor(correct / count, device=accelerator.device),
                                                  "mean").item()
    return row
