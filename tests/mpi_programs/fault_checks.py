"""What the ULFM fault programs share (check_faults.py ``kill``/``recover``, check_writer_faults.py; they import
this from their own folder): a rank killed inside a ``sample()``, the survivors' failing sample, and the
chi-square test of the recovered replay's draws.

- :func:`shorten_deadline`: a replay built with the long :data:`SETUP_TIMEOUT` gets the scenario's short
  deadline only for the steps that meet the dead rank.
- :func:`die_in_next_sample`: the calling rank SIGKILLs itself inside its next ``replay.sample()``, after that
  call has begun (in place of the sample's exchange), so the others are left in the collective.
- :func:`sample_must_fail`: the survivors' next sample must raise CollectiveError; one that returns prints
  ``WRONG ... rank=R`` and leaves with ``os._exit(0)`` (MPI_Finalize would wait for the dead rank).
- :func:`draws_problems`: sample the (recovered) replay, count every id's draws over all its ranks and test
  the counts against the expected probabilities (chi-square).

Importing this module makes SIGUSR2 print every thread's stack to stderr (``faulthandler``): the tests send it
to a job's ranks before they kill a job that outlived its limit, so that a hang says where it hung.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

RANK = MPI.COMM_WORLD.rank
faulthandler.register(signal.SIGUSR2, all_threads=True)

#: the deadline of every step before a rank is killed: on a loaded machine (CI's other test worker beside the
#: job) ranks reach the same save or sample seconds apart, and the short deadline is meant for the dead rank only
SETUP_TIMEOUT = 120.0


def shorten_deadline(replay: gm.Replay, seconds: float) -> None:
    """Give every communicator ``replay`` waits on (its own, its node's and its closing duplicate; the node
    communicators copied the deadline when they were made) the deadline ``seconds``, on this rank."""
    for mc in (replay.comm, replay.node.node_comm, replay.node.closing):
        mc.timeout = float(seconds)


def say(word: str, what: str) -> None:
    """Print ``<word> <what> rank=R`` as one whole line (the tests read these lines)."""
    print(f"{word} {what} rank={RANK}", flush=True)


def die_in_next_sample(replay: gm.Replay) -> None:
    """Make this rank die (SIGKILL) inside its next ``replay.sample()``, after the call has begun."""
    def die(*args, **kwargs):
        print(f"DYING rank={RANK} at={time.time():.3f}", flush=True)  # the wall clock of the kill, for the tests
        os.kill(os.getpid(), signal.SIGKILL)
    replay._exchange = die
    replay._repeat.clear()  # its next sample takes the full path (a repeated call would not reach _exchange)


def sample_must_fail(replay: gm.Replay, batch: int, window: int) -> float:
    """``replay.sample(batch, window)`` with a rank dead: returns the seconds it took to raise CollectiveError;
    a sample that returns is reported (``WRONG``) and ends this rank (``os._exit(0)``)."""
    t0 = time.monotonic()
    try:
        replay.sample(batch, window)
    except gm.CollectiveError:
        return time.monotonic() - t0
    say("WRONG", "sample returned although a rank is dead")
    os._exit(0)


def draws_problems(replay: gm.Replay, comm, ids: list[int], rounds: int, expected=None) -> tuple[list[str], dict]:
    """Sample ``replay`` ``rounds`` times (64 windows of 1 step; collective over ``comm``, the replay's ranks)
    and test how often each of ``ids`` was drawn, summed over the ranks, against ``expected`` (relative
    probabilities; None: uniform) with a chi-square test.

    Returns:
        The problems found (an id drawn that is not in ``ids``, p < 1e-3) and the figures: ``drawn`` (the counts,
        in the order of ``ids``) and ``pvalue``.
    """
    from scipy import stats as sps
    counts = dict.fromkeys(ids, 0)
    problems = []
    for _ in range(rounds):
        for ident in replay.sample(64, 1)["id"][:, 0].tolist():
            if int(ident) not in counts:
                problems.append(f"drew id {int(ident)}, which the replay should not hold")
                counts[int(ident)] = 0
            counts[int(ident)] += 1
    drawn = np.sum(comm.allgather(np.array([counts[i] for i in ids])), axis=0)
    f_exp = None if expected is None else drawn.sum() * np.asarray(expected, float) / np.sum(expected)
    pvalue = sps.chisquare(drawn, f_exp).pvalue
    if pvalue < 1e-3:
        problems.append(f"chi-square p={pvalue:.2g}")
    return problems, {"drawn": drawn, "pvalue": pvalue}
