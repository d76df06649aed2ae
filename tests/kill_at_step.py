"""Test launcher: ``python tests/kill_at_step.py N train ...`` runs ``sparsetrain.cli.main`` and SIGKILLs the
process right after optimizer step N (a simulated crash), so the kill-and-resume test needs no hook in the
training loop. The run's scheduler gets its ``step`` wrapped: the loop calls it once after every optimizer step.
"""
import os
import signal
import sys

import sparsetrain.config
from sparsetrain.cli import main


def _kill_after(kill_at: int):
    build_run = sparsetrain.config.build_run

    def build_run_then_arm(cfg):
        spec = build_run(cfg)
        step = spec.scheduler.step

        def step_then_kill(n: int):
            record = step(n)
            if n == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return record

        spec.scheduler.step = step_then_kill
        return spec

    return build_run_then_arm


if __name__ == "__main__":
    sparsetrain.config.build_run = _kill_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
