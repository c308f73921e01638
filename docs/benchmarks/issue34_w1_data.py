"""Issue 34, item 6: the W1 data both W1 probes load (issue34_w1_calls.py, issue34_w1_phases.py): 1024 hopper
trajectories of 1000 steps over the ranks (each rank 16 distinct ones, repeated), compare_peers' priorities."""
import sys
from pathlib import Path

import gear_mpi as gm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.peers._common import HOPPER, HOPPER_T, hopper_priorities, hopper_trajectory  # noqa: E402


def w1_data(comm):
    """(spec, this rank's trajectories, their priorities, how many, the trajectory length)."""
    k, rank = comm.size, comm.rank
    mine = 1024 // k
    spec = gm.TrajectorySpec(HOPPER, max_length=HOPPER_T)
    traj = [hopper_trajectory(rank * 100_000 + i) for i in range(16)]
    trajs = [traj[i % 16] for i in range(mine)]
    prio = hopper_priorities(1024)[rank::k][:mine]
    return spec, trajs, prio, mine, HOPPER_T


def w1_replay(comm, mode: str):
    """A Prioritized(0.6, 0.4) replay in ``mode`` holding this rank's W1 data, and its W1 batch (32 windows of
    the whole trajectory, "head") after 50 warm-up calls into it."""
    spec, trajs, prio, mine, length = w1_data(comm)
    rp = gm.Replay(spec, mine * length, gm.Prioritized(0.6, 0.4), mode=mode, comm=comm, seed=0, timeout=300)
    rp.insert_many(trajs, prio)
    b = None
    for _ in range(50):
        b = rp.sample(32, length, "head", out=b)
    return rp, b
