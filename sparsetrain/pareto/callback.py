"""A Hydra callback that ends a study sweep with its time-to-quality curves: after the last run,
``sparsetrain pareto SWEEP_DIR --curves --out SWEEP_DIR/<name>.png`` (the table printed; ``<name>.png``,
``<name>.csv``, ``<name>.md``, ``<name>_curves.png`` and ``<name>_curves.csv`` written in the sweep folder).

A recipe turns it on under ``hydra.callbacks`` (recipes/time_to_quality.yaml)::

    hydra:
      callbacks:
        curves:
          _target_: sparsetrain.pareto.callback.WriteCurves
          name: ttq
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class WriteCurves(Callback):
    """``on_multirun_end``: the study's plots and tables from every run of the sweep folder."""

    def __init__(self, name: str = "study") -> None:
        if not name or "/" in name:
            raise ValueError(f"hydra.callbacks.curves.name: a file name without '/', got {name!r}")
        self.name = name

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from sparsetrain.pareto.cli import main

        sweep = Path(str(config.hydra.sweep.dir))
        print(f"the sweep's curves: sparsetrain pareto {sweep} --curves --out {sweep / (self.name + '.png')}",
              flush=True)
        main([str(sweep), "--curves", "--out", str(sweep / f"{self.name}.png")])
