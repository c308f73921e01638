"""gear_mpi on two "hosts": node detection, per-host /dev/shm, window paths, exact windows in every mode.

Run by tests/test_two_hosts.py on 4 ranks: 2 on each of two hosts made on this machine
(network, UTS and mount namespaces: scripts/hosts/two_hosts.py), launched by hydra's
mpiexec through the ssh stand-in scripts/hosts/ns_ssh. It names the hosts in
``GEAR_MPI_TWO_HOSTS`` (``gmhost-a,gmhost-b``); without it (or on another rank count) the
module skips. The same run also starts tests/mpi/test_windows.py (global weights and order,
priority updates across hosts) and tests/mpi/test_distribution.py (chi-square).
"""
from __future__ import annotations

import os
import re
import socket

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, check_windows, fill, make_replay, owner_of, shard_sizes

HOSTS = [h for h in os.environ.get("GEAR_MPI_TWO_HOSTS", "").split(",") if h]
pytestmark = pytest.mark.skipif(len(HOSTS) != 2 or SIZE != 4,
                                reason="needs 4 ranks on the two hosts of tests/test_two_hosts.py")

SELECTORS = {"Uniform": lambda: gm.Uniform(), "Prioritized": lambda: gm.Prioritized(0.7, 0.5),
             "Fifo": lambda: gm.Fifo(), "Lifo": lambda: gm.Lifo(), "MaxPriority": lambda: gm.MaxPriority(),
             "MinPriority": lambda: gm.MinPriority()}
SHM = "/dev/shm"


def hostnames() -> list[str]:
    """Every rank's hostname, by rank."""
    return COMM.allgather(socket.gethostname())


def same_host() -> list[int]:
    names = hostnames()
    return [r for r in range(SIZE) if names[r] == names[RANK]]


def test_ranks_are_placed_two_per_host():
    """hydra placed ranks 0, 1 on the first host and 2, 3 on the second (``-hosts a:2,b:2``)."""
    assert hostnames() == [HOSTS[0], HOSTS[0], HOSTS[1], HOSTS[1]]
    assert MPI.Get_processor_name() == HOSTS[RANK // 2]


def test_comm_type_shared_sees_two_nodes_of_two_ranks():
    node = COMM.Split_type(MPI.COMM_TYPE_SHARED, key=RANK)
    try:
        assert node.allgather(RANK) == same_host()
        assert sorted({tuple(m) for m in COMM.allgather(node.allgather(RANK))}) == [(0, 1), (2, 3)]
    finally:
        node.Free()


def test_each_host_has_its_own_dev_shm():
    """A file one rank puts in /dev/shm is seen by the ranks of its host only; so is MPICH's node
    segment (``mpich_shm_<job>_<node>``). The first rank of each host lists its /dev/shm for
    tests/test_two_hosts.py, which checks that none of it is in the machine's own /dev/shm."""
    # MPICH may create and drop other segments (per communicator) while this runs: compare node segments
    node_segments = {n for n in os.listdir(SHM) if re.fullmatch(r"mpich_shm_[0-9a-f]+_\d+", n)}
    by_rank = COMM.allgather(node_segments)
    assert node_segments, "MPICH's node segment must be in this host's /dev/shm"
    for r in range(SIZE):
        if r in same_host():
            assert by_rank[r] & node_segments, by_rank
        else:
            assert not by_rank[r] & node_segments, by_rank
    reports = os.environ.get("GEAR_MPI_REPORT_DIR")
    if reports and RANK in (0, 2):
        with open(os.path.join(reports, f"shm-{socket.gethostname()}.txt"), "w") as f:
            f.write("\n".join(sorted(os.listdir(SHM))))
    probe = os.path.join(SHM, f"gear_hosts_probe_{RANK}")
    with open(probe, "w") as f:
        f.write(socket.gethostname())
    try:
        COMM.Barrier()
        seen = sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(SHM) if n.startswith("gear_hosts_probe_"))
        COMM.Barrier()
    finally:
        os.unlink(probe)
    assert seen == same_host(), (seen, same_host())


def test_replay_node_view_follows_the_hosts():
    """The replay's node (gear_mpi.distributed.node) is this rank's host: its shard is in shared memory, node
    peers are read directly, the other host's ranks through the transport."""
    replay = make_replay(gm.Uniform())
    try:
        peers = same_host()
        assert replay.node.ranks == peers and replay.node.size == 2
        assert replay.shard.shm_name, "memory=None must pick shared memory: the node has 2 ranks"
        assert replay.node.direct.tolist() == [r in peers for r in range(SIZE)]
        assert replay.node.remote.tolist() == [int(r not in peers) for r in range(SIZE)]
        assert replay.node.any_remote
    finally:
        replay.close()


@pytest.mark.parametrize("mode", ["decentralized", "centralized"])
def test_windows_of_the_other_host_travel_through_mpi(mode):
    """Each rank's counters match its batch: rows owned by its host peer came from shared memory,
    rows owned by the other host's ranks through MPI (own rows count as neither)."""
    replay = make_replay(gm.Uniform(), mode)
    try:
        fill(replay, 5, seed=11)
        peers = same_host()
        shared = mpi = 0
        for _ in range(4):
            owners = [owner_of(k) for k in replay.sample(12, 4).meta_numpy()[0].tolist()]
            shared += sum(o in peers and o != RANK for o in owners)
            mpi += sum(o not in peers for o in owners)
        st = replay.stats()
        assert st["per_rank"]["windows_shared"][RANK] == shared
        assert st["per_rank"]["windows_mpi"][RANK] == mpi
        assert st["total"]["windows_shared"] > 0 and st["total"]["windows_mpi"] > 0, st["total"]
    finally:
        replay.close()


def check_against_get_many(replay: gm.Replay, batch: gm.Batch) -> None:
    """Each window equals the same steps of the trajectory get_many fetches for its key (plain MPI)."""
    cols, mask = batch.numpy(), batch.mask_numpy()
    keys, _, _, lengths = batch.meta_numpy()
    trajs = replay.get_many(keys)
    for i, traj in enumerate(trajs):
        assert traj is not None
        pad = int(np.argmax(mask[i]))
        n = int(lengths[i])
        offset = int(np.searchsorted(traj["step"], cols["step"][i, pad]))
        for name, column in traj.items():
            np.testing.assert_array_equal(cols[name][i, pad:pad + n], column[offset:offset + n], err_msg=name)


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("mode", ["decentralized", "centralized", "local"])
def test_every_mode_and_selector_is_bit_exact(mode, selector):
    """Windows equal the inserted steps (the reference every rank gathered) and what get_many
    returns for the same keys, in each alignment; local mode serves each rank from its own shard."""
    sizes = shard_sizes()   # uneven, rank 1 (on the first host) empty
    replay = make_replay(SELECTORS[selector](), mode)
    try:
        ref = fill(replay, sizes[RANK], seed=5)
        for align, window in (("random", 5), ("head", 12), ("tail", 7)):
            ask = 0 if (mode == "local" and sizes[RANK] == 0) else 3 + RANK
            batch = replay.sample(ask, window, align)
            assert len(batch) == ask
            check_windows(batch, ref, window, align)
            check_against_get_many(replay, batch)
            if mode == "local":
                assert all(owner_of(k) == RANK for k in batch.meta_numpy()[0].tolist())
        st = replay.stats()
        assert st["per_rank"]["items"] == sizes
        if mode == "local":
            assert st["total"]["windows_mpi"] == 0 and st["total"]["windows_shared"] == 0, st["total"]
    finally:
        replay.close()
