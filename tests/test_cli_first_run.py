"""Issue 19 (hardening), first run, through the REAL `sparsetrain` entry point from a directory of the user's:
the README's policy example works, a rejected config prints one line and creates nothing."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true"}
TINY = ["trainer.batch_size=8", "data.seq_len=32", "data.vocab_size=1024", "trainer.eval_batches=2",
        "trainer.eval_every=0", "logger.progress=false", "logger.plot=false"]

POLICY = '''
from pathlib import Path

from sparsetrain.sparsity import RigL


class GradEMA(RigL):
    ema: dict = {}

    def grow_scores(self, weight, grad, mask):
        old = self.ema.get(self.layer, 0.0)
        self.ema[self.layer] = 0.9 * old + grad.abs()
        with open(Path(__file__).with_name("calls.txt"), "a") as f:
            f.write(self.layer + "\\n")
        return self.ema[self.layer]
'''


def sparsetrain_command() -> list[str]:
    """The installed console script (its sys.path[0] is its bin folder, not the working directory)."""
    script = shutil.which("sparsetrain") or str(Path(sys.executable).with_name("sparsetrain"))
    if not Path(script).exists():
        pytest.fail("the sparsetrain entry point is not installed (pip install -e .)")
    return [script]


def run(args, cwd):
    return subprocess.run([*sparsetrain_command(), *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=600)


def test_the_readme_policy_example_runs_from_the_users_directory(tmp_path):
    """`sparsetrain train recipe=quickstart sparsity=rigl sparsity.scheduler.policy._target_=my_policies.GradEMA`
    with my_policies.py in the working directory (issue 19 item 12); no UserWarning on the way (item 17)."""
    (tmp_path / "my_policies.py").write_text(POLICY)
    r = run(["train", "recipe=quickstart", "sparsity=rigl", "sparsity.scheduler.policy._target_=my_policies.GradEMA",
             "trainer.max_steps=6", "sparsity.scheduler.num_updates=2", "sparsity.scheduler.end=1.0", *TINY,
             "hydra.run.dir=run"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = (tmp_path / "calls.txt").read_text().split()
    assert calls and all(c.startswith("bert.encoder.layer.") for c in calls)  # the user's policy chose the masks
    assert "UserWarning" not in r.stderr + r.stdout
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_a_rejected_config_prints_one_line_and_creates_nothing(tmp_path):
    """The default run dir (runs/<recipe>/<time>) is never created for a config that validation rejects
    (issue 19 item 8), and the error is one line naming the key."""
    r = run(["train", "recipe=quickstart", "data.seq_len=2"], cwd=tmp_path)
    assert r.returncode == 2
    assert list(tmp_path.iterdir()) == []
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: data.seq_len:")
