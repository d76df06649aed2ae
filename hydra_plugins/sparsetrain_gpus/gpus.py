"""``hydra/launcher=gpus``: a sweep's runs spread over the GPUs of one machine, one run per GPU at a time.

    sparsetrain train -m recipe=pareto_bert_small hydra/launcher=gpus               # every visible GPU
    sparsetrain train -m recipe=pareto_bert_small hydra/launcher=gpus hydra.launcher.gpus=[0,1]

Each run is a process of its own (``python -m sparsetrain.cli train <its overrides> hydra.run.dir=<its sweep
subdir>``) with ``CUDA_VISIBLE_DEVICES`` naming its GPU, so it measures the GPU-seconds of a GPU it has alone; its
output goes to ``<sweep dir>/logs/<job>.log``. Four GPUs finish a sweep about four times sooner; with one GPU, or
none, the runs go one after another. A run that fails lets the running ones finish and starts no more; the sweep
then ends with exit 1 and one line per failed run naming its log (the finished runs' directories are complete,
and the same command with ``trainer.resume=auto`` goes on).
"""
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict


@dataclass
class Job:
    """One run of the sweep: its command, where its output goes, and (once ended) its exit code."""

    number: int
    command: list[str]
    run_dir: Path
    log: Path
    returncode: int | None = None


def run_pool(jobs: Sequence[Job], devices: Sequence[str | None], say: Callable[[str], None] = print,
             poll_s: float = 0.2) -> list[Job]:
    """Run ``jobs`` at most one per device at a time, each with ``CUDA_VISIBLE_DEVICES`` set to its device (left
    alone for ``None``: a machine without a GPU). After a failure no new job starts. Returns the jobs that ran,
    each with its ``returncode``."""
    pending, running, done = list(jobs), {}, []
    free = list(devices)
    failed = False
    while pending and not failed or running:
        while pending and free and not failed:
            job, device = pending.pop(0), free.pop(0)
            env = dict(os.environ)
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            job.log.parent.mkdir(parents=True, exist_ok=True)
            with open(job.log, "w") as out:
                running[device] = (job, subprocess.Popen(job.command, stdout=out, stderr=subprocess.STDOUT, env=env))
            say(f"[job {job.number}] started on {'GPU ' + device if device is not None else 'the CPU'}: "
                f"{job.run_dir} (log: {job.log})")
        time.sleep(poll_s)
        for device, (job, proc) in list(running.items()):
            if proc.poll() is None:
                continue
            job.returncode = proc.returncode
            del running[device]
            free.append(device)
            done.append(job)
            failed = failed or proc.returncode != 0
            say(f"[job {job.number}] {'finished' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}")
    return done


def visible_devices(gpus: Sequence[int] | None) -> list[str | None]:
    """The devices runs go to: ``gpus`` as given, else every GPU this process sees; ``[None]`` without one."""
    if gpus is not None:
        return [str(int(g)) for g in gpus] or [None]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] or [None]


@dataclass
class GpuPoolConf:
    _target_: str = "hydra_plugins.sparsetrain_gpus.gpus.GpuPoolLauncher"
    #: GPU indices to use (default: every visible GPU; none: the runs go one after another on the CPU)
    gpus: list[int] | None = None


ConfigStore.instance().store(group="hydra/launcher", name="gpus", node=GpuPoolConf, provider="sparsetrain")


class GpuPoolLauncher(Launcher):
    """Hydra's launcher for ``hydra/launcher=gpus`` (:func:`run_pool` does the work)."""

    def __init__(self, gpus: Sequence[int] | None = None) -> None:
        self.gpus = None if gpus is None else list(gpus)
        self.config: DictConfig | None = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def _job(self, overrides: Sequence[str], number: int, sweep_dir: Path) -> Job:
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = number
            sweep_config.hydra.job.num = number
        run_dir = sweep_dir / str(sweep_config.hydra.sweep.subdir)
        command = [sys.executable, "-m", "sparsetrain.cli", "train", *overrides, f"hydra.run.dir={run_dir}"]
        return Job(number, command, run_dir, sweep_dir / "logs" / f"{number}.log")

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        jobs = [self._job(o, initial_job_idx + i, sweep_dir) for i, o in enumerate(job_overrides)]
        devices = visible_devices(self.gpus)
        print(f"hydra/launcher=gpus: {len(jobs)} runs on {len(devices)} "
              f"{'GPU(s)' if devices[0] is not None else 'CPU slot'}, one run per GPU at a time", flush=True)
        done = run_pool(jobs, devices, say=lambda line: print(line, flush=True))
        failed = [j for j in done if j.returncode != 0]
        for job in failed:
            print(f"error: job {job.number} ({job.run_dir}) failed with exit {job.returncode}: see {job.log}",
                  file=sys.stderr)
        if failed:
            skipped = len(jobs) - len(done)
            if skipped:
                print(f"error: {skipped} run(s) not started after the failure; the same command with "
                      f"trainer.resume=auto goes on", file=sys.stderr)
            raise SystemExit(1)
        return [JobReturn(overrides=list(j.command[4:-1]), working_dir=str(j.run_dir), task_name="train",
                          status=JobStatus.COMPLETED, _return_value=None) for j in done]
