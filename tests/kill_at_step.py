"""Test launcher: ``python tests/kill_at_step.py N[:SIGNAL] train ...`` runs ``sparsetrain.cli.main`` and sends
this process a signal right after optimizer step N: SIGKILL by default (a simulated crash), or the one named
(``13:SIGTERM``: a cluster's preemption). The kill-and-resume tests need no hook in the training loop: the
run's scheduler gets its ``step`` wrapped, and the loop calls it once after every optimizer step.
"""
import os
import signal
import sys

import sparsetrain.config
from sparsetrain.cli import main


def _signal_after(step_at: int, signum: int):
    build_run = sparsetrain.config.build_run

    def build_run_then_arm(cfg):
        spec = build_run(cfg)
        step = spec.scheduler.step

        def step_then_signal(n: int):
            record = step(n)
            if n == step_at:
                os.kill(os.getpid(), signum)
            return record

        spec.scheduler.step = step_then_signal
        return spec

    return build_run_then_arm


if __name__ == "__main__":
    at, _, name = sys.argv[1].partition(":")
    sparsetrain.config.build_run = _signal_after(int(at), getattr(signal, name or "SIGKILL"))
    sys.exit(main(sys.argv[2:]))
