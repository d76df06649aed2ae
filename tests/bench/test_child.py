"""A bench's child runs end with the bench: on --timeout, on SIGTERM / SIGINT to the bench, and their own children
(data-loader or compile workers) with them."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sparsetrain
from sparsetrain.bench._child import Stopped, group_alive, run_child

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file() or os.name != "posix",
                                reason="process groups and /proc (Linux)")

ROOT = Path(sparsetrain.__file__).resolve().parents[1]

# A child that starts a grandchild, writes both pids, and sleeps; the grandchild sleeps too.
FAMILY = """
import os, subprocess, sys, time
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {grand.pid}")
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def _wait_for(path: Path, seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and len(text := path.read_text().split()) == 2:
            return [int(p) for p in text]
        time.sleep(0.05)
    raise AssertionError(f"the child never wrote {path}")


def _gone(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_timeout_ends_the_child_and_its_children(tmp_path):
    pids_file = tmp_path / "pids"
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        rc = run_child([sys.executable, "-c", FAMILY, str(pids_file)], log, timeout=3.0, grace=2.0)
    assert rc is None
    assert time.monotonic() - t0 < 20
    pids = _wait_for(pids_file, 1.0)
    assert _gone(pids, 1.0), [p for p in pids if _running(p)]
    assert not group_alive(pids[0])


def test_normal_exit_returns_the_code_and_sweeps_stragglers(tmp_path):
    # the child exits 3 at once, leaving a sleeping grandchild behind: the code comes back, the grandchild goes
    leaver = ("import os, subprocess, sys\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              "open(sys.argv[1], 'w').write(f'{os.getpid()} {g.pid}')\nsys.exit(3)\n")
    pids_file = tmp_path / "pids"
    with open(tmp_path / "log", "w") as log:
        rc = run_child([sys.executable, "-c", leaver, str(pids_file)], log, timeout=60, grace=2.0)
    assert rc == 3
    assert _gone(_wait_for(pids_file, 1.0), 1.0)


def test_output_goes_to_the_file_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with open(tmp_path / "log", "w") as log:
        rc = run_child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], log,
                       timeout=60)
    assert rc == 0
    assert (tmp_path / "log").read_text().split() == ["out", "err"]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_to_the_bench_ends_the_family(tmp_path, sig):
    pids_file = tmp_path / "pids"
    bench = ("import sys\nfrom sparsetrain.bench._child import Stopped, run_child\n"
             "try:\n"
             f"    run_child([sys.executable, '-c', {FAMILY!r}, {str(pids_file)!r}], open({str(tmp_path / 'log')!r}, 'w'),"
             " timeout=120, grace=2.0)\n"
             "except Stopped as s:\n    print('stopped', s.signum)\n    sys.exit(128 + s.signum)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", bench], stdout=subprocess.PIPE, text=True, env=env)
    pids = _wait_for(pids_file)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, out
    assert out.split() == ["stopped", str(int(sig))]
    assert _gone(pids), [p for p in pids if _running(p)]


def test_stopped_names_the_signal():
    assert str(Stopped(signal.SIGTERM)) == "stopped by SIGTERM"
