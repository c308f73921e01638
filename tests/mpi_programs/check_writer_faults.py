"""Writers across a dead rank under ULFM, for tests/test_faults.py: ``mpiexec --with-ft ulfm -n 4 python
check_writer_faults.py DIR TIMEOUT`` (Open MPI 5; every rank on one node).

Ranks 0-2 are learners (their replay runs on a communicator of their own, split from ``COMM_WORLD``);
rank 3 is an actor rank, as on another node: it feeds learners 1 and 2 through two ``gm.MpiWriter`` on
``COMM_WORLD`` (the learners ``accept_remote(COMM_WORLD)``). Every learner also has a writer process
(``gm.Writer`` at its ``writer_address``) that inserts an episode every few milliseconds, each id
recorded in its report once ``insert`` returned. After a checkpoint (``DIR/ck``) the writers start;
learner 2 then dies (SIGKILL) inside a ``sample``. The survivors see the sample fail, ``recover(DIR/ck)``
and sample on. Then:

- the writer processes of learners 0 and 1 go on across the failure and the recovery, into the new replay:
  each of their episodes is held afterwards and is drawn by the new replay's samples;
- the actor's ``MpiWriter`` of learner 1 goes on too (its inbox moves to the new replay): each episode it
  sent is held and drawn afterwards;
- the actor's ``MpiWriter`` of learner 2 raises WriterError (MPI reports the dead rank), and so does the
  writer process of learner 2 (its owner is gone); their episodes after the checkpoint are lost;
- the draws of the new replay (uniform) pass a chi-square test over everything it holds.

Prints ``PASS <check> rank=R`` / ``WRONG <what> rank=R`` lines and the figures on one ``FIGURES`` line;
every rank leaves with ``os._exit`` (MPI_Finalize may wait for the dead rank). Every wait is bounded.
"""
from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import gear_mpi as gm
from fault_checks import (SETUP_TIMEOUT, die_in_next_sample, draws_problems, sample_must_fail, say,
                          shorten_deadline)  # beside this file

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
LEARNERS, ACTOR, DEAD = 3, 3, 2
SPEC = gm.TrajectorySpec({"id": ((), "int64"), "obs": ((3,), "float32")}, max_length=3)
WRITER_PERIOD = 0.04  # seconds between a writer's episodes
AFTER_RECOVERY = 0.6  # seconds the survivors sample on before the writers are told to stop
CHILDREN: list = []  # this rank's writer process, killed if the rank fails
RECOVERED_TIMEOUT = 60.0  # the recovered replay's deadline (the killed learner's replay: the one given)


def traj(ident: int) -> dict[str, np.ndarray]:
    n = 1 + ident % SPEC.max_length
    return {"id": np.full(n, ident, np.int64), "obs": np.full((n, 3), ident % 1009, np.float32)}


#: a writer process (argv: address, report path, first id, go file, stop file, period): inserts from when the
#: go file appears until the stop file appears (then flushes) or WriterError; reports the ids whose insert
#: returned and how it ended, as JSON
WRITER = """
import json, os, sys, time
import numpy as np
import gear_mpi as gm
address, report, first, go, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
period = float(sys.argv[6])
w = gm.Writer(address, timeout=20.0)
open(report + ".started", "w").close()
t0 = time.monotonic()
while not os.path.exists(go) and time.monotonic() - t0 < 60:
    time.sleep(0.005)
ids, ended, last, t0 = [], "no stop within 60 s", time.monotonic(), time.monotonic()
try:
    while time.monotonic() - t0 < 60:
        if os.path.exists(stop):
            w.flush(20.0)
            ended = "stopped"
            break
        ident = first + len(ids)
        n = 1 + ident % 3
        w.insert({"id": np.full(n, ident, np.int64), "obs": np.full((n, 3), ident % 1009, np.float32)})
        ids.append(ident)
        last = time.monotonic()
        time.sleep(period)
except gm.WriterError as e:
    ended = f"{type(e).__name__} {time.monotonic() - last:.3f} s after its last episode: {e}"
with open(report + ".tmp", "w") as f:
    json.dump({"ids": ids, "ended": ended}, f)
os.rename(report + ".tmp", report)
"""


def report_path(base: str, who: str) -> str:
    return os.path.join(base, f"report-{who}.json")


def actor(base: str, timeout: float) -> None:
    """Rank 3: an MpiWriter to learner 1 (survives) and one to learner 2 (dies); insert into both until the
    stop file, then flush the one that lives; report as JSON."""
    WORLD.Barrier()  # the learners accept_remote and saved DIR/ck
    writers = {1: gm.MpiWriter(WORLD, 1, timeout=timeout * 5), DEAD: gm.MpiWriter(WORLD, DEAD, timeout=timeout * 2)}
    sent: dict[int, list[int]] = {1: [], DEAD: []}
    ended = {1: "no stop within 60 s", DEAD: "no WriterError"}
    last = {1: time.monotonic(), DEAD: time.monotonic()}
    stop, t0 = os.path.join(base, "stop"), time.monotonic()
    while time.monotonic() - t0 < 60 and writers:
        if os.path.exists(stop):
            if 1 in writers:
                try:
                    writers[1].flush(timeout * 5)
                    ended[1] = "stopped"
                except gm.WriterError as e:
                    ended[1] = f"{type(e).__name__}: {e}"
            break
        for learner in list(writers):
            ident = 6_000_000 + 10_000 * learner + len(sent[learner])
            try:
                writers[learner].insert(traj(ident))
                sent[learner].append(ident)
                last[learner] = time.monotonic()
            except gm.WriterError as e:
                ended[learner] = f"{type(e).__name__} {time.monotonic() - last[learner]:.3f} s after its last " \
                                 f"episode: {e}"
                writers.pop(learner).close()  # the learner is gone: returns at once
        time.sleep(WRITER_PERIOD)
    for learner, w in writers.items():
        try:  # a goodbye not answered is reported (the learners then see it), not raised: they would wait 90 s
            w.close()
        except gm.WriterError as e:
            ended[learner] = f"close: {type(e).__name__}: {e}"
    with open(report_path(base, "actor") + ".tmp", "w") as f:
        json.dump({"sent": {str(k): v for k, v in sent.items()}, "ended": {str(k): v for k, v in ended.items()}}, f)
    os.rename(report_path(base, "actor") + ".tmp", report_path(base, "actor"))
    say("PASS", "actor-done")
    sys.stdout.flush()
    os._exit(0)


def held_ids(replay: gm.Replay, comm) -> list[int]:
    mine = [int(replay.get(k)["id"][0]) for k in replay.shard.live_keys().tolist()]
    return sorted(i for part in comm.allgather(mine) for i in part)


def learner(base: str, timeout: float) -> None:
    comm = WORLD.Split(0, RANK)
    # the long SETUP_TIMEOUT until the armed sample, which alone gets the short deadline: on a loaded machine
    # (load average 54 beside other MPI jobs, 2026-12-05) the learners reached the first save more than 4 s
    # apart; the deadline is for the dead rank, not for them
    replay = gm.Replay(SPEC, 6000, gm.Uniform(), comm=comm, seed=3, timeout=SETUP_TIMEOUT, max_items=3000)
    replay.accept_remote(WORLD)
    go, stop = os.path.join(base, "go"), os.path.join(base, "stop")
    mine = report_path(base, f"writer-{RANK}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, replay.writer_address(), mine,
                             str(5_000_000 + 10_000 * RANK), go, stop, str(WRITER_PERIOD)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    CHILDREN.append(proc)
    deadline = time.monotonic() + 60
    while not os.path.exists(mine + ".started") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    before = [RANK * 1000 + i for i in range(5)]
    replay.insert_many([traj(i) for i in before])
    checkpoint = os.path.join(base, "ck")
    replay.save(checkpoint)  # before the writers' episodes: those of learner 2 are all lost
    WORLD.Barrier()  # the actor starts; no deadline: the writer processes may take a while to start
    if RANK == 0:
        open(go, "w").close()  # the writer processes start
    for _ in range(15):  # the writers and the actor go on meanwhile; each sample takes their episodes in
        replay.sample(8, 1)
        time.sleep(WRITER_PERIOD)
    comm.Barrier()
    shorten_deadline(replay, timeout)  # the deadline is for the dead rank: the armed sample only
    if RANK == DEAD:
        die_in_next_sample(replay)
    failed = sample_must_fail(replay, 8, 1)
    # the recovered replay waits longer: what follows checks the writers, not the deadline, and on a loaded
    # machine (load average 46 beside other MPI jobs, 2026-12-05) a survivor fell 4 s behind in the draws
    rec = replay.recover(checkpoint, seed=5, timeout=RECOVERED_TIMEOUT)
    # a survivor that stops reaching its samples prints where it is (stderr) before its partner's deadline ends
    # the job (CI 2026-12-05: one did, and the job's output told nothing of where)
    faulthandler.dump_traceback_later(RECOVERED_TIMEOUT - 20, exit=False)
    new, rcomm = rec.replay, rec.comm
    # the survivors meet (an MPI barrier, no deadline) before sampling on: on a loaded machine one reached its
    # first sample after recovery more than 4 s after the other (CI, 2026-12-05, under a 4 s deadline then)
    rcomm.Barrier()
    problems = []
    if rec.dead != [DEAD] or rec.survivors != [0, 1]:
        problems.append(f"dead={rec.dead} survivors={rec.survivors}")
    # the writers go on into the new replay; the survivors agree when the time is up (rank 0's clock): each
    # sample is a collective, and a loop that each rank ended on its own clock left one a sample ahead of the
    # other under load, in its next sample while the other waited in the allreduce below (CI 2026-12-05)
    t1 = time.monotonic()
    while rcomm.bcast(time.monotonic() - t1 < AFTER_RECOVERY):
        new.sample(8, 1)
        time.sleep(WRITER_PERIOD)
    if RANK == 0:
        open(stop, "w").close()
    # sample on until every report is written (the writers flush: their owners must take their episodes in)
    reports = [report_path(base, w) for w in ("writer-0", "writer-1", f"writer-{DEAD}", "actor")]
    # the survivors leave together: once every report is there, or once one of them has waited 90 s (each
    # deadline is its own rank's: one leaving alone strands the other in its next sample, CI 2026-12-05)
    deadline = time.monotonic() + 90
    while True:
        new.sample(8, 1)
        if rcomm.allreduce(int(not all(os.path.exists(p) for p in reports) and time.monotonic() < deadline),
                           op=MPI.MIN) == 0:
            break
        time.sleep(0.01)
    new.ingest()
    rcomm.Barrier()
    proc.wait(timeout=30)
    got = {w: json.load(open(p)) if os.path.exists(p) else {} for w, p in zip(("0", "1", "dead", "actor"), reports)}
    held = held_ids(new, rcomm)
    survivors_writers = got["0"].get("ids", []) + got["1"].get("ids", [])
    actor_kept = got["actor"].get("sent", {}).get("1", [])
    actor_lost = got["actor"].get("sent", {}).get(str(DEAD), [])
    dead_writer = got["dead"].get("ids", [])
    for w in ("0", "1"):
        if got[w].get("ended") != "stopped":
            problems.append(f"writer of learner {w}: {got[w].get('ended', 'no report')}")
    if got["actor"].get("ended", {}).get("1") != "stopped":
        problems.append(f"MpiWriter of learner 1: {got['actor'].get('ended')}")
    dead_ended = got["actor"].get("ended", {}).get(str(DEAD), "")
    # MPI reports the dead learner (WriterError "is gone"), or, where it has not noticed yet, no acknowledgement
    # comes: WriterTimeoutError after the writer's timeout (2 x TIMEOUT here)
    if not (dead_ended.startswith("WriterError") and "is gone" in dead_ended or
            dead_ended.startswith("WriterTimeoutError")):
        problems.append(f"MpiWriter of the dead learner: {dead_ended or 'no report'}")
    if not got["dead"].get("ended", "").startswith("WriterError"):
        problems.append(f"writer of the dead learner: {got['dead'].get('ended', 'no report')}")
    if not survivors_writers or not actor_kept or not actor_lost or not dead_writer:
        problems.append(f"too few episodes: {len(survivors_writers)} {len(actor_kept)} {len(actor_lost)} "
                        f"{len(dead_writer)}")
    hs = set(held)
    missing = sorted(set(survivors_writers + actor_kept) - hs)
    if missing:
        problems.append(f"{len(missing)} episodes of the survivors' writers are not held: {missing[:6]}")
    back = sorted(hs & set(actor_lost + dead_writer))
    if back:
        problems.append(f"episodes sent to the dead learner after the checkpoint are held: {back[:6]}")
    if not set(i for r in range(LEARNERS) for i in range(r * 1000, r * 1000 + 5)) <= hs:
        problems.append("the checkpoint's trajectories are not all held")
    # the draws: uniform over everything held; every episode the survivors' writers wrote is drawn
    wrong, figures = draws_problems(new, rcomm, held, 150)
    drawn, pvalue = figures["drawn"], figures["pvalue"]
    by_id = dict(zip(held, drawn.tolist()))
    never = [i for i in survivors_writers + actor_kept if by_id.get(i, 0) == 0]
    if never:
        problems.append(f"{len(never)} writer episodes never drawn in {drawn.sum()} draws: {never[:6]}")
    problems += wrong
    new.close()
    faulthandler.cancel_dump_traceback_later()
    if problems:
        say("WRONG", "; ".join(problems))
    else:
        say("PASS", "writers-across-recover")
        if RANK == 0:
            after = [i for i in survivors_writers + actor_kept]
            print("FIGURES " + json.dumps({
                "failed_s": round(failed, 2), "held": len(held), "writer_episodes_kept": len(survivors_writers),
                "actor_episodes_kept": len(actor_kept), "actor_episodes_lost": len(actor_lost),
                "dead_writer_episodes": len(dead_writer), "draws": int(drawn.sum()),
                "min_draws_of_a_writer_episode": int(min(by_id[i] for i in after)), "pvalue": round(pvalue, 3),
                "dead_mpiwriter": dead_ended[:160], "dead_writer": got["dead"]["ended"][:160]}), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    base, timeout = sys.argv[1], float(sys.argv[2])
    if WORLD.size != LEARNERS + 1:
        raise SystemExit(f"run on {LEARNERS + 1} ranks, not {WORLD.size}")
    try:
        if RANK == ACTOR:
            WORLD.Split(1, RANK)  # the learners' split is collective over COMM_WORLD
            actor(base, timeout)
        else:
            learner(base, timeout)
    except BaseException:  # an unexpected error: this rank leaves at once (MPI_Finalize could wait on the others)
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        for child in CHILDREN:
            child.kill()
        os._exit(1)
