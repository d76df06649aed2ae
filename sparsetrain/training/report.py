"""Where a run's rows go: metrics.jsonl (main process), the tracker (wandb) and the progress bar while it
trains; summary.json, the plot and the printed summary when it ends (the row contract: metrics.py)."""
from __future__ import annotations

from pathlib import Path

from sparsetrain.training import metrics
from sparsetrain.training.plots import plot_run
from sparsetrain.training.tracking import end_tracking, init_tracking, log_tracking


class RunReport:
    """Opened once the run's position is known (``step``; ``wandb_id``: the tracker run a resumed run continues);
    ``close()`` ends them (twice is harmless)."""

    def __init__(self, run_dir: Path, accelerator, main: bool, args, config: dict, step: int,
                 wandb_id: str | None) -> None:
        self.run_dir, self.accelerator, self.main, self.args = run_dir, accelerator, main, args
        self.logger = metrics.MetricsLogger(run_dir, is_main_process=main)
        self.wandb_id, self.tracking = wandb_id, args.wandb
        if args.wandb:
            self.wandb_id = init_tracking(accelerator, args.wandb_project, str(run_dir), config, mode=args.wandb_mode,
                                          name=args.wandb_name, enabled=True, run_id=wandb_id)
        self.progress = metrics.Progress(args.max_steps, initial=step, disable=not (args.progress and main))

    def log(self, row: dict) -> None:
        """One row to metrics.jsonl (main process) and the tracker."""
        self.logger.log(row)
        if self.tracking:
            log_tracking(self.accelerator, row, row["step"])

    def stop_writing(self) -> None:
        """The last row is written: the progress bar ends, metrics.jsonl is closed (and can be read whole)."""
        self.progress.close()
        self.logger.close()

    def write_summary(self, summary: dict) -> None:
        """Main process: summary.json, the plot (``logger.plot``), the summary printed."""
        if not self.main:
            return
        metrics.write_summary(self.run_dir, **summary)
        if self.args.plot:
            plot_run(self.run_dir)
        print(metrics.format_summary(summary), flush=True)
        print(f"run directory: {self.run_dir}", flush=True)

    def close(self) -> None:
        self.stop_writing()
        if self.tracking:
            end_tracking(self.accelerator)
            self.tracking = False
