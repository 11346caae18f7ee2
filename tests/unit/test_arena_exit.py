"""A trainer process's arena file is removed on any exit the process itself runs: an
uncaught exception, sys.exit, SIGTERM (unhandled), and a normal end; a kill -9 is left to
the next trainer's reclaim (`reclaim_orphans`, tests/unit/test_arena_files.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A trainer at work runs bytecode often. Not one long sleep: a SIGTERM taken by another
# thread (numpy's) leaves the main thread's sleep running and Python's handler waiting on it
# (weightsync.signal_wait), which hung this test about one run in ten.
WORKING = "for _ in range(600): time.sleep(0.1)"
ENDINGS = {
    "exception": "raise RuntimeError('the training step failed')",
    "exit": "sys.exit(3)",
    "end": "pass",
    "sigterm": WORKING,
    "sigterm-handled": WORKING,  # the trainer's own handler, set after the arena's
    "sigterm-ignored": "time.sleep(1)",  # SIGTERM ignored before the arena: it stays ignored
}
# The child states SIGTERM's disposition itself: a runner may start the tests with SIGTERM
# ignored (CI's does, and a child inherits that), where an unhandled SIGTERM ends nothing.
CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN if "ignored" in sys.argv[2] else signal.SIG_DFL)
from trainer_agent.serve.arena import Arena
arena = Arena("exit-test", slots=1, directory=sys.argv[1])
arena.ensure_slot_bytes(1 << 20)
if "handled" in sys.argv[2]:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
print(arena.path, flush=True)
sys.stdin.readline()  # the test looked at the file
{ending}
"""


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_an_arena_file_is_removed_on_every_exit_the_process_runs(ending: str, tmp_path: Path) -> None:
    code = CHILD.format(ending=ENDINGS[ending])
    with subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), ending],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            path = Path(child.stdout.readline().strip())
            assert path.exists() and path.parent == tmp_path
            child.stdin.write("go\n")
            child.stdin.flush()
            if ending.startswith("sigterm"):
                child.send_signal(signal.SIGTERM)
            rc = child.wait(30)
        finally:
            child.kill()
    assert not path.exists(), f"{ending}: {path} left behind"
    assert list(tmp_path.iterdir()) == []
    # SIGTERM ends the process as the signal does (-15), or with 143 where the host does not
    # deliver the signal the handler raises again (gVisor)
    want = {
        "exception": {1},
        "exit": {3},
        "end": {0},
        "sigterm": {-signal.SIGTERM, 143},
        "sigterm-handled": {143},
        "sigterm-ignored": {0},  # ran on past the signal, to its end
    }
    assert rc in want[ending]


def test_a_forked_child_leaves_its_parents_arena_alone(tmp_path: Path) -> None:
    code = CHILD.format(ending="import os\nif os.fork() == 0: sys.exit(0)\nos.wait(); print(arena.path.exists())")
    command = [sys.executable, "-c", code, str(tmp_path), "fork"]
    done = subprocess.run(command, cwd=ROOT, input="go\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True"  # the child's exit removed nothing of its parent's
    assert list(tmp_path.iterdir()) == []
