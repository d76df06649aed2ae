"""Compare finished runs: final eval loss against training FLOPs and against GPU-seconds.

`sparsetrain pareto RUN_DIR... [--out FILE.png]` collects run directories (or folders holding them up
to three levels down, such as Hydra's multirun/DATE/TIME/0, 1, ...) and the FILE.csv tables of earlier calls
(a study run in parts, on several machines or days), prints one aligned table row per run, and writes FILE.png (two panels: loss vs FLOPs, loss vs GPU-seconds; each method's Pareto frontier
drawn, every point labelled: steps for dense runs, density and block for sparse ones) with FILE.csv and
FILE.md beside it. `--dense-steps` prints instead the `trainer.max_steps` values of the dense runs that
match the sparse runs' FLOPs and GPU-seconds (the Pareto study's second stage, docs/pareto.md).

Where each number comes from, per run:
- finished runs (`summary.json` present): method, density, block, steps, total train FLOPs, wall
  seconds and `train_s` from the summary; the final eval loss from the summary, else from the last eval row;
- GPU-seconds: `train_s` (the training steps, window by window: start-up windows at the next window's step
  time, evaluation and checkpoints left out; `sparsetrain.training.metrics.train_seconds`) times the run's processes; runs written before
  the summary had it get it from their rows;
- unfinished runs (no summary): the point is the last eval row of `metrics.jsonl` (its `eval_loss`,
  `train_flops` and `elapsed_s`), so loss and cost are measured at the same step; the method and
  density fall back to the run's `config.yaml` (or `.hydra/config.yaml` of older runs) and to the last
  logged density. An unfinished run with no eval row is listed in the table but not plotted.
- labels: the summary's `method`, e.g. `prune_regrow/random` (SET), `prune_regrow/gradient` (RigL),
  `prune_regrow/GradEMA` (a user's policy class). Summaries written before policies were labelled by
  class gave a RigL/SET subclass its parent's label; for those the config's policy class is used.
  The seed comes from the run's config.

Example:
    >>> runs = collect_runs(["multirun/2026-11-21/10-00-00", "runs/dense"])
    >>> print(format_table(runs))
    >>> plot_pareto(runs, "pareto.png")      # and pareto.csv, pareto.md beside it

The package, one module per concern (data flows one way, down this list): ``cli`` (the command) ->
``figures``, ``curves`` (``--curves``: time to quality), ``matching`` (``--dense-steps``) -> ``tables`` (labels, frontiers, the text table, FILE.csv/.md) ->
``runs`` (reading run directories and tables).
"""
from sparsetrain.pareto.cli import main
from sparsetrain.pareto.curves import Curve, dense_target, reach_rows, read_curve, read_curves
from sparsetrain.pareto.figures import pareto_figure, plot_pareto
from sparsetrain.pareto.matching import dense_steps
from sparsetrain.pareto.runs import CSV_COLUMNS, RunResult, collect_runs, read_run, read_table
from sparsetrain.pareto.tables import format_table, frontier, point_label, write_tables

__all__ = ["CSV_COLUMNS", "Curve", "RunResult", "collect_runs", "dense_steps", "dense_target", "format_table",
           "frontier", "main", "pareto_figure", "plot_pareto", "point_label", "reach_rows", "read_curve",
           "read_curves", "read_run", "read_table", "write_tables"]
