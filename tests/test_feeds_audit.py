"""Edge states of the writers, the rate limiter and the rate meter that an audit found mishandled.

- A writer used in a child forked from its process wrote into the parent's staging area (two producers on a
  single-producer ring), and the child's ``close()`` ended the parent's writer for the owner: the owner freed the
  slot, and the parent's later episodes were lost while its ``flush()`` said they were in. Now the child's copy is
  closed: its calls raise WriterError naming the fork, its ``close()`` does nothing.
- A child forked from the owner that exited normally removed the owner's writers' staging areas (the intake's
  exit handler ran there too): a writer the owner had not yet attached was dropped, its episodes lost.
- A limiter waiting for more items than the replay can hold waited ``rate_limit_timeout``; refused at once now.
- A huge ``writer_slack`` (2**63) or band (``SampleToInsertRatio(1, 1, 1e300)``) raised OverflowError at
  ``writer_address()`` and at every sample: a hold cap and budget shares that did not fit int64. Now no limit.
- ``RateMeter(seconds=inf)`` (or 1e308) raised OverflowError at its second snapshot; a closed meter's
  ``snapshot`` raised AttributeError; a meter on a closed replay was built (and Dup'ed its communicator).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from writer_actor import MAX_LENGTH, SPEC_COLUMNS  # noqa: E402

SPEC = gm.TrajectorySpec({k: (s, d) for k, (s, d) in SPEC_COLUMNS.items()}, max_length=MAX_LENGTH)

# an owner (a Shard with its ingest point) and a writer in one fresh process, which then forks
_PROLOGUE = f"""
import os, sys, numpy as np
sys.path.insert(0, {str(HERE)!r})
import gear_mpi as gm
from gear_mpi.feeds import intake
from writer_actor import SPEC_COLUMNS, MAX_LENGTH
spec = gm.TrajectorySpec({{k: (s, d) for k, (s, d) in SPEC_COLUMNS.items()}}, max_length=MAX_LENGTH)
step = {{"x": np.zeros(3, np.float32), "img": np.zeros((4, 4), np.uint8), "r": 0.0}}
shard = gm.Shard(spec, 4000, gm.Fifo(), max_items=1000)
point = intake.WriterIntake(shard)
w = gm.Writer(point.address, timeout=2)
"""


def run(code: str) -> list[str]:
    """Run ``_PROLOGUE + code`` in a fresh interpreter; its output lines (it must exit 0)."""
    p = subprocess.run([sys.executable, "-c", _PROLOGUE + code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return p.stdout.split("\n")[:-1]


def test_a_writer_inherited_by_a_forked_child_is_closed_there():
    lines = run("""
w.append(step); w.end_episode()
point.drain(np.inf)                    # the owner has attached the writer
r, wr = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        w.append(step)
        said = "wrote"
    except gm.WriterError as e:
        said = str(e)
    w.close()                          # must not end the parent's writer
    os.write(wr, said.encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 1000).decode())
for _ in range(3):
    w.append(step); w.end_episode()
point.drain(np.inf)
print(len(shard), w.staged)
w.flush(1.0)
w.close(); point.close(); shard.close()
""")
    assert lines[0].startswith("append: this writer belongs to process "), lines
    assert "make a new gm.Writer(address) in this process" in lines[0]
    assert lines[1] == "4 0", lines  # the parent's episodes, every one


def test_a_forked_child_of_the_owner_leaves_its_writers_staging_areas():
    lines = run("""
staging = point.address + "_w0"
assert os.path.exists("/dev/shm/" + staging)
pid = os.fork()
if pid == 0:
    sys.exit(0)                        # a normal exit: exit handlers run in the child
os.waitpid(pid, 0)
print(os.path.exists("/dev/shm/" + staging))
w.append(step); w.end_episode()
point.drain(np.inf)                    # attaches the writer only now
print(len(shard))
w.close(); point.close(); shard.close()
print(os.path.exists("/dev/shm/" + staging))
""")
    assert lines == ["True", "1", "False"], lines


def test_a_limiter_waiting_for_more_items_than_the_replay_holds_is_refused_at_once():
    step = {"x": np.zeros((1, 3), np.float32), "img": np.zeros((1, 4, 4), np.uint8), "r": np.zeros(1)}
    lim = gm.SampleToInsertRatio(1.0, 50, 10.0)
    with gm.Replay(SPEC, 400, gm.Uniform(), max_items=20, rate_limiter=lim, rate_limit_timeout=60,
                   timeout=20) as replay:
        replay.insert(step)
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"waits for 50 live items, but the replay holds at most 20 \(1 ranks "
                                             r"of max_items=20\)"):
            replay.sample(1, window=1)
        assert time.monotonic() - start < 10
        assert len(replay) == 1 and replay.stats()["total"]["sampled"] == 0


@pytest.mark.parametrize("limiter, slack", [((1.0, 1, 10.0), 2 ** 63), ((1.0, 1, 10.0), 10 ** 30),
                                           ((1.0, 1, 1e300), None)])
def test_a_huge_slack_or_band_is_no_limit(limiter, slack):
    step = {"x": np.zeros(3, np.float32), "img": np.zeros((4, 4), np.uint8), "r": 0.0}
    with gm.Replay(SPEC, 400, gm.Uniform(), rate_limiter=gm.SampleToInsertRatio(*limiter), writer_slack=slack,
                   timeout=20) as replay:
        with gm.Writer(replay.writer_address(), timeout=5) as w:
            for _ in range(3):
                w.append(step)
                w.end_episode()
        assert replay.sample(1, window=1).keys.shape == (1,)
        assert replay.stats()["total"]["ingested"] == 3


def test_rate_meter_refuses_infinite_seconds_and_huge_ones_run():
    with gm.Replay(SPEC, 400, gm.Uniform(), timeout=20) as replay:
        with pytest.raises(ValueError, match=r"seconds must be a positive finite number, got inf"):
            gm.RateMeter(replay, seconds=float("inf"))
        with gm.RateMeter(replay, seconds=1e308) as meter:
            assert [meter.step() for _ in range(4)] == [None] * 4  # no report due; no OverflowError


def test_a_closed_meter_and_a_closed_replay_say_so():
    replay = gm.Replay(SPEC, 400, gm.Uniform(), timeout=20)
    meter = gm.RateMeter(replay, every=1)
    meter.step()
    meter.close()
    with pytest.raises(RuntimeError, match="this meter is closed"):
        meter.step()
    meter.close()  # idempotent
    replay.close()
    with pytest.raises(RuntimeError, match="RateMeter: the replay is closed"):
        gm.RateMeter(replay, every=1)


@pytest.mark.parametrize("kw, what", [({"timeout": True}, "timeout must be a positive number of seconds, got True"),
                                      ({"hold_timeout": True}, "hold_timeout must be None or a positive number")])
def test_a_writer_refuses_true_as_a_timeout(kw, what):
    """``Writer(address, timeout=True)`` was taken as one second (bool is an int)."""
    with pytest.raises(ValueError, match=what):
        gm.Writer("gear_mpi_no_such_address", **kw)


@pytest.mark.parametrize("value", [True, 0, -1.0, float("nan"), "60"])
def test_a_replay_refuses_a_rate_limit_timeout_that_is_not_seconds(value):
    """``rate_limit_timeout=True`` was taken as one second (bool is an int); nothing is built."""
    with pytest.raises(ValueError, match=rf"rate_limit_timeout must be a positive number of seconds, got {value!r}"):
        gm.Replay(SPEC, 400, gm.Uniform(), rate_limiter=gm.MinSize(1), rate_limit_timeout=value)
