"""Ranks in different collective calls: run as ``mpiexec -n K python check_mismatch.py TRANSPORT SCENARIO...``.

Rank 0 makes one call of the replay, every other rank another (the pairs of issue 30:
``update_priorities`` against ``stats``, ``stats`` against ``get_many``, ``sample`` against
``stats``, ...). Every rank must raise the same :class:`gear_mpi.CollectiveError`, naming both
calls and their number, well within the replay's ``timeout`` (no wrong result, no timeout), and
the replay must then refuse every call at once and close locally. TRANSPORT: ``board`` (one node:
the heads travel through the node board's shared memory) or ``mpi`` (``force_alltoallv=True``: no
board, every head is an MPI allgather).

Each scenario builds its replay on a duplicate of COMM_WORLD: a call with a payload behind its head
(``stats``, a deferred update) leaves that payload pending on the duplicate after a mismatch.

Lines printed (whole lines, one write each): ``MSG <scenario> rank=R <message>`` (the error's message, for
the calling test to compare between ranks), ``PASS <scenario> rank=R``, or ``WRONG <scenario> rank=R
<what>``. It stays a program, not a tests/mpi module: a rank's failure must not leave the others
waiting in a pytest session, and the pending payloads are left to MPI_Finalize (MPICH 5 and Open MPI 5
finalize past them, measured; Open MPI prints an ``MPI Error in NBC subrequest`` for the two payloads of
different sizes that met).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
TIMEOUT = 10.0  # the replay's deadline: a mismatch must be told long before it
PROMPT = 3.0    # seconds within which a mismatch is raised (a timeout would take TIMEOUT)
SPEC = gm.TrajectorySpec({"x": ((2,), np.float32), "t": ((), np.int64)}, max_length=5)

#: scenario -> (rank 0's call, the other ranks' call); the names their heads carry are those of CALLED
SCENARIOS = {
    "update-vs-stats": ("update_priorities", "stats"),
    "stats-vs-update": ("stats", "update_priorities"),
    "getmany-vs-stats": ("get_many", "stats"),
    "stats-vs-getmany": ("stats", "get_many"),
    "sample-vs-stats": ("sample", "stats"),
    "stats-vs-sample": ("stats", "sample"),
    "updatekeys-vs-sample": ("update_keys", "sample"),
    "sampleout-vs-getmany": ("sample_out", "get_many"),
    "localsample-vs-update": ("sample_local", "update_keys"),
    "save-vs-stats": ("save", "stats"),
    "meter-vs-update": ("meter", "update_priorities"),
    "batches-extra-update": ("batches_update", "batches"),
    "batches-update-vs-stats": ("batches_update", "batch_then_stats"),  # two payloads behind their heads
    "clear-vs-sample": ("clear", "sample"),
}
CALLED = {"update_priorities": "update_priorities", "update_keys": "update_priorities", "stats": "stats",
          "get_many": "get_many", "sample": "sample", "sample_out": "sample", "sample_local": "sample",
          "save": "save", "meter": "RateMeter", "batches_update": "update_priorities (batches)",
          "batches": "sample", "batch_then_stats": "stats", "clear": "clear"}


def say(word: str, name: str, text: str = "") -> None:
    line = f"{word} {name} rank={RANK}" + (f" {text}" if text else "") + "\n"
    sys.stdout.flush()
    os.write(1, line.encode())  # one write: lines of different ranks do not interleave


def build(transport: str) -> gm.Replay:
    replay = gm.Replay(SPEC, 400, gm.Prioritized(0.6, 0.4), comm=COMM.Dup(), timeout=TIMEOUT, seed=3,
                       force_alltoallv=transport == "mpi")
    rng = np.random.default_rng(RANK)
    for i in range(30):
        n = int(rng.integers(1, SPEC.max_length + 1))
        replay.insert({"x": rng.standard_normal((n, 2)).astype(np.float32), "t": np.full(n, i, np.int64)},
                      float(rng.uniform(0.5, 2.0)))
    return replay


def call(replay: gm.Replay, what: str, batch, folder: str):
    """Make call ``what``; returns what it returned (a mismatch must raise instead)."""
    if what == "update_priorities":
        return replay.update_priorities([], [])
    if what == "update_keys":
        return replay.update_priorities(batch.meta_numpy()[0], np.full(len(batch), 2.0))
    if what == "stats":
        return replay.stats()["total"]["items"]
    if what == "get_many":
        return replay.get_many(batch.meta_numpy()[0])
    if what == "sample":
        return replay.sample(4)
    if what == "sample_out":
        return replay.sample(len(batch), out=batch)
    if what == "sample_local":
        return replay.sample(4, mode="local")
    if what == "save":
        return replay.save(os.path.join(folder, "cp"), progress=False)
    if what == "meter":
        return gm.RateMeter(replay, every=1)
    if what == "clear":
        return replay.clear()
    # batches: rank 0 gives an update the others do not; its thread applies it (prefetch=0: before the
    # second sample) while theirs run the second sample, or (batch_then_stats) leave the loop after one batch
    # and call stats (the same limit everywhere: batches() refuses limits that differ between ranks)
    with replay.batches(4, prefetch=0, limit=3) as it:
        for j, b in enumerate(it):
            if what == "batches_update" and j == 0:
                it.update_priorities(b.meta_numpy()[0], np.full(len(b), 2.0))
            if what == "batch_then_stats":
                break
    return replay.stats() if what == "batch_then_stats" else "all batches"


def expected(scenario: str, number: int) -> list[str]:
    first, other = (CALLED[c] for c in SCENARIOS[scenario])
    rest = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"
    return [f"rank 0 called {first} (call #{number})", f"{rest} called {other} (call #{number})"]


def run(transport: str, scenario: str, folder: str) -> None:
    replay = build(transport)
    name = f"{transport}:{scenario}"
    if (replay.node.board is not None) != (transport == "board"):
        say("WRONG", name, f"node board {replay.node.board!r} with transport {transport}")
    batch = replay.sample(4)  # call #1, alike on every rank
    mine = SCENARIOS[scenario][0 if RANK == 0 else 1]
    number = 4 if scenario.startswith("batches") else 2  # the iterator's head is call #2, its first sample #3
    COMM.Barrier()
    start = time.monotonic()
    try:
        got = call(replay, mine, batch, folder)
        say("WRONG", name, f"returned {got!r:.200} after {time.monotonic() - start:.2f} s")
        return
    except gm.CollectiveError as e:
        took, error = time.monotonic() - start, e
    except Exception as e:  # noqa: BLE001 -- anything else is the fault this checks for
        say("WRONG", name, f"raised {type(e).__name__}: {e}"[:400])
        return
    message = str(error)
    say("MSG", name, message)
    problems = []
    if type(error) is not gm.CollectiveError:
        problems.append(f"raised {type(error).__name__}, not CollectiveError")
    if took > PROMPT:
        problems.append(f"took {took:.2f} s")
    problems += [f"no {part!r} in the message" for part in expected(scenario, number) if part not in message]
    start = time.monotonic()
    try:
        replay.stats()
        problems.append("a later stats() worked")
    except gm.CollectiveError as e:
        if "unusable" not in str(e) or time.monotonic() - start > 0.5:
            problems.append(f"a later stats(): {e}")
    start = time.monotonic()
    replay.close()  # local: the communicator is broken
    if time.monotonic() - start > PROMPT:
        problems.append(f"close took {time.monotonic() - start:.2f} s")
    if problems:
        say("WRONG", name, "; ".join(problems))
    else:
        say("PASS", name)


def main() -> None:
    transport, scenarios = sys.argv[1], sys.argv[2:]
    folder = COMM.bcast(tempfile.mkdtemp(prefix="gear_mismatch_") if RANK == 0 else None, 0)
    for scenario in scenarios:
        run(transport, scenario, folder)
        COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
