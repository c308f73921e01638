"""A shard closed by one thread while another uses it: the close waits for the call in flight, the calls after it
raise the closed shard's RuntimeError, and nothing reads or writes freed memory.

Before the shard's lock, TorchRL's own buffer tests (tests/mpi/torchrl_rb, one rank) ended in a segmentation fault
about one run in four on a loaded machine: their fixture closed the GearStorage while TorchRL's prefetch threads
were still sampling it, and the sampling kernel read the unmapped columns. tests/close_race_program.py repeats
such closes in a process of its own (so a crash fails the test rather than the test run); before the fix its
``sample`` and ``torchrl`` cases died of SIGSEGV within 30 cycles, and its ``full_sample`` and ``insert`` user
threads ended in errors other than the closed shard's (a KeyError or AttributeError from the emptied store).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm

PROGRAM = Path(__file__).resolve().parent / "close_race_program.py"
CLOSED = {"this Shard is closed", "this Replay is closed"}
SPEC = gm.TrajectorySpec({"x": ((3,), "float32")}, max_length=1)


@pytest.mark.parametrize("case, cycles", [("sample", 30), ("full_sample", 20), ("insert", 20), ("append", 20),
                                          ("replay", 20), ("torchrl", 15)])
def test_close_from_another_thread_never_frees_memory_in_use(case, cycles):
    if case == "torchrl":
        pytest.importorskip("torchrl")
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(PROGRAM), case, str(cycles)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, f"exit {run.returncode} (-11: a use of freed memory)\n{run.stdout}\n{run.stderr[-4000:]}"
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith(f"cycles {cycles} ended with "), run.stdout
    ended = set(ast.literal_eval(line.split(" ended with ", 1)[1]))  # the list of strings the program printed
    allowed = CLOSED | ({"None"} if case == "torchrl" else set())  # (a prefetch may finish before the close)
    assert ended <= allowed, (ended, run.stderr[-4000:])
    assert ended & CLOSED, f"no call met the closed {case} target: the race was not run"


def test_close_waits_for_a_hold_of_another_thread_then_calls_raise():
    shard = gm.Shard(SPEC, 64, gm.Prioritized(0.6, 0.4))
    keys = shard.insert_packed({"x": np.ones((8, 3), np.float32)}, np.ones(8, np.int64))
    inside, leave = threading.Event(), threading.Event()

    def holder():
        with shard.hold():
            inside.set()
            leave.wait(10)

    user = threading.Thread(target=holder)
    user.start()
    assert inside.wait(10)
    closer = threading.Thread(target=shard.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive(), "close() returned while another thread held the shard's memory"
    assert shard.store.arena is not None
    leave.set()
    user.join(10)
    closer.join(10)
    assert not closer.is_alive() and shard.store.arena is None
    for call in (lambda: shard.sample(4, 1), lambda: shard.update_priorities(keys, np.ones(8)),
                 lambda: shard.insert_packed({"x": np.ones((1, 3), np.float32)}, [1]),
                 lambda: shard.append_step({"x": np.ones(3, np.float32)}), lambda: shard.get(int(keys[0])),
                 lambda: shard.locate(keys), lambda: shard.priorities(keys), shard.clear):
        with pytest.raises(RuntimeError, match="this Shard is closed"):
            call()
    shard.close()  # idempotent


def test_one_thread_may_nest_holds_and_calls():
    """The lock is re-entrant: a call made inside a hold of the same thread (a save reading the shard, a
    replay's sample calling the shard's) does not wait for itself."""
    shard = gm.Shard(SPEC, 64, gm.Uniform())
    shard.insert_packed({"x": np.arange(24, dtype=np.float32).reshape(8, 3)}, np.ones(8, np.int64))
    with shard.hold():
        with shard.hold():
            batch = shard.sample(5, 1)
            assert shard.update_priorities(batch.keys.numpy(), np.ones(5)) == 5
            assert len(shard.insert_packed({"x": np.ones((2, 3), np.float32)}, [1, 1])) == 2
    closer = threading.Thread(target=shard.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "a hold was left taken"
