"""Replay: a distributed replay whose sampling, collection and updates are SPMD collectives.

Every rank of ``comm`` owns one :class:`~gear_mpi.shard.Shard`. ``insert`` and
``insert_many`` are local. ``sample``, ``update_priorities``, ``stats`` and
``close`` are collectives: every rank calls them, in the same order, like an
``MPI_Allreduce``. A rank may ask for any batch size (0 included), but
``window`` and ``align`` must be the same on every rank.

Modes of ``sample`` (``P`` ranks, ``B`` items asked on this rank, ``Btot`` over
all ranks, ``W`` window, ``S`` bytes per step):

- ``"decentralized"`` (default, exact): one allgather of a 7-value header
  (status, B, window, align, mass, size, smallest weight); each requester's
  per-shard counts are a multinomial over the shard masses, drawn from a stream
  that every rank holds identically, so every rank knows every count without an
  alltoall; each owner selects that many items from its shard; one alltoallv of
  48-byte choices (key, start, length, padding, probability, weight) back to the
  requesters, in flight together with the windows' alltoallvs. P(item) =
  weight / (total weight of all shards), exactly. Ordered selectors (Fifo,
  Lifo, Max/MinPriority) take the global order instead: one allgatherv of each
  shard's ``min(Btot, size)`` best sort keys, and every rank computes the same
  global merge (the ``Btot`` globally best items, dealt to requesters in rank order).
- ``"centralized"`` (the GEAR paper's other mode, kept for comparison): rank 0
  gathers the selection state of every shard (all live weights: 16 bytes per
  item; or the ordered candidates), selects for every rank, and scatters the
  choices to the owners; then the same exchange of choices and windows.
- ``"local"``: each rank samples its own shard; no communication; probabilities
  and weights are those of the local shard.

Windows: a requester copies windows owned by ranks on its own node straight out
of their shared memory (the owner sends only the 48-byte choice); windows owned
by ranks on other nodes travel in one alltoallv per column, received straight
into the batch (``B W S`` bytes in all, plus padding). ``force_alltoallv=True``
sends every window owned by another rank through MPI, so the inter-node path
runs and is measured on one machine. The node fence keeps an owner from
overwriting a window a peer still reads: after a sample each rank publishes, in
its shared memory's header, that it finished reading its peers' windows; an
owner about to write its shard (insert) first waits until every node peer has
published the last sample. No message is sent: when another collective has been
passed since, the wait is free, which it always is in a sampling loop.

Failures: arguments are checked on every rank and agreed in the first
collective of the call, so a bad argument on one rank raises the same error
(``"sample: rank R: ..."``) on every rank. A rank that does not arrive within
``timeout`` seconds makes the others raise :class:`CollectiveTimeoutError`;
the replay is then unusable (later collectives raise at once).
"""
from __future__ import annotations

import os
import secrets
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from . import keys as keyspace
from .batch import Batch
from .comm import MpiComm
from .device import DeviceContext, parse_device
from .errors import CollectiveTimeoutError, EmptyReplayError, InvalidKeyError
from .kernels import gather as gather_kernels
from .kernels import hints
from .keys import as_key_array
from .memory import reads_done_counter
from .selectors import Selector, Uniform
from .shard import Shard, attach_columns, check_batch_size, check_window, column_addresses
from .spec import TrajectorySpec, validate_priorities

MODES = ("decentralized", "centralized", "local")
_META = gather_kernels.META  # key, window start, real steps, leading padding, probability bits, weight bits
_STATS = ("items", "live_steps", "steps_used", "total_weight", "inserted", "evicted", "removed", "sampled",
          "stale_updates", "stored_bytes", "raw_bytes", "windows_shared", "windows_mpi")


class Replay:
    """A replay sharded over the ranks of an mpi4py communicator (see the module docstring).

    Construction is collective (it agrees on the arguments, a key tag and the
    node layout, and maps the node's shared memory). ``memory=None`` picks
    POSIX shared memory when several ranks share a node, numpy otherwise.
    ``seed`` fixes every rank's streams (each rank derives its own).
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, sampler: Selector | None = None, *,
                 mode: str = "decentralized", comm=None, seed: int = 0, timeout: float = 60.0,
                 max_items: int | None = None, max_times_sampled: int | None = None, memory: str | None = None,
                 force_alltoallv: bool = False, device: str = "cpu", process_group=None,
                 window_transport: str = "nccl"):
        from mpi4py import MPI

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if window_transport not in ("nccl", "mpi"):
            raise ValueError(f"window_transport must be 'nccl' or 'mpi', got {window_transport!r}")
        self.window_transport = window_transport
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        sampler = Uniform() if sampler is None else sampler
        self.comm = MpiComm(comm, timeout)
        self.mode = mode
        self.force_alltoallv = bool(force_alltoallv)
        rank, size = self.comm.rank, self.comm.size
        if size > keyspace.MAX_RANKS:
            raise ValueError(f"at most {keyspace.MAX_RANKS} ranks are supported, got {size}")
        device_kind, _ = parse_device(device)
        signature = repr((spec.to_dict(), capacity_steps, max_items, max_times_sampled, repr(sampler), mode,
                          self.force_alltoallv, seed, memory, device_kind, window_transport))
        sigs = self.comm.comm.allgather(signature)
        if len(set(sigs)) != 1:
            bad = next(r for r, s in enumerate(sigs) if s != sigs[0])
            raise ValueError(f"Replay: rank {bad} was constructed with other arguments than rank 0 "
                             f"(every rank must pass the same spec, capacity, sampler, mode and seed)")
        self.node_comm = self.comm.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        node_ranks = self.node_comm.allgather(rank)
        _share_cores(len(node_ranks))
        if memory is None:
            memory = "shm" if len(node_ranks) > 1 else "numpy"
        tag = self.comm.bcast_object(secrets.randbits(keyspace.TAG_BITS))
        streams = np.random.SeedSequence(seed).spawn(size)[rank].spawn(2)
        # the GPU follows the local rank (rank within the node) unless device names one
        self.device = DeviceContext(device, self.node_comm.Get_rank()) if device_kind == "cuda" else None
        self.shard = Shard(spec, capacity_steps, sampler, max_items=max_items, max_times_sampled=max_times_sampled,
                           memory=memory, seed=streams[0], rank=rank, tag=tag, device_context=self.device)
        self.rng = np.random.Generator(np.random.PCG64(streams[1]))
        # the same on every rank: per-requester shard counts (decentralized) are drawn from it
        self.shared_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1 << 30,))))
        self._epoch = 0    # samples this rank has entered (the same count on every rank: sample is collective)
        self._settled = 0  # the last sample whose node-peer reads are known to be over
        self.spec = spec
        self.selector = sampler
        # the node peers' columns, mapped from their shared memory (rank -> arena, byte views)
        self._arenas = {rank: self.shard.store.arena}
        self.peer_views: dict[int, dict[str, np.ndarray]] = {rank: self.shard.store.byte_views()}
        names = self.node_comm.allgather(self.shard.shm_name)
        if memory == "shm":
            for peer, name in zip(node_ranks, names):
                if peer != rank and name is not None:
                    self._arenas[peer], self.peer_views[peer] = attach_columns(name, spec, self.shard.capacity_steps)
            self.node_comm.Barrier()  # every peer has mapped the segments: drop their names so that
            self.shard.store.arena.unlink()  # no crash can leave them behind in /dev/shm
        # a window owned by rank o is copied straight from o's memory when direct[o]; symmetric on a
        # node: every rank of a node maps every other's columns, or none does
        self.direct = np.array([r in self.peer_views and (r == rank or not self.force_alltoallv)
                                for r in range(size)])
        self.any_remote = any(self.comm.comm.allgather(not bool(self.direct.all())))
        # the node fence's counters: this rank's own (peers read it) and every peer's that reads this rank
        self._reads_done = reads_done_counter(self.shard.store.arena.buffer)
        self._peer_done = [reads_done_counter(self._arenas[r].buffer) for r in range(size)
                           if r != rank and self.direct[r]]
        # the address of every directly readable column (owner x column), for the gather kernel
        self._column_addrs = np.zeros((size, len(spec.columns)), np.int64)
        for r, views in self.peer_views.items():
            if self.direct[r]:
                self._column_addrs[r] = column_addresses(views, spec, self.shard.capacity_steps)
        self._peer_direct = (self.direct & (np.arange(size) != rank)).astype(np.int64)  # node peers read directly
        self._remote = (~self.direct).astype(np.int64)
        self._node_peers = bool(self._peer_direct.any())
        self.device_views: dict[int, dict] = {}
        self._mapped = []
        self.torch_comm = None
        if self.device is not None:
            # page-lock the node's arenas and map them into this GPU's address space (zero copy)
            from .pinned import map_byte_views
            for r, arena in self._arenas.items():
                mapped, views = map_byte_views(arena.buffer, self.peer_views[r])
                self._mapped.append(mapped)
                self.device_views[r] = views
            if self.any_remote and window_transport == "nccl":
                from .comm_torch import TorchComm
                backend = "gloo" if self.device.simulator else "nccl"
                self.torch_comm = TorchComm(self.comm.comm, backend, timeout, process_group=process_group)
        self.windows_shared = 0  # windows this rank copied from a node peer's shared memory
        self.windows_mpi = 0  # windows this rank received through MPI
        self.closed = False

    # ---- local operations -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def __len__(self) -> int:
        """Live trajectories in this rank's shard (local, O(1)); see :meth:`stats` for the total."""
        return len(self.shard)

    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0) -> int:
        """Add one trajectory to this rank's shard (local; see :meth:`Shard.insert`). Returns its key."""
        self._settle()
        return self.shard.insert(trajectory, priority)

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None) -> np.ndarray:
        """Add trajectories to this rank's shard (local; see :meth:`Shard.insert_many`). Returns their keys."""
        self._settle()
        return self.shard.insert_many(trajectories, priorities)

    def get(self, key: int) -> dict[str, np.ndarray]:
        """A trajectory of this rank's shard (local)."""
        return self.shard.get(key)

    # ---- sample -----------------------------------------------------------------------------
    def sample(self, batch_size: int, window: int | None = None, align: str = "random") -> Batch:
        """Collective: every rank receives ``batch_size`` windows drawn from the whole replay.

        Cost per call (decentralized, proportional): two rounds of latency -- an
        allgather of 56 bytes per rank, then, in flight together, one alltoallv of
        48 bytes per item and one alltoallv per column carrying ``W S`` bytes per
        window owned on another node. A counter published at the end (read by an
        owner before it next writes its shard; see the module docstring) keeps owners
        from overwriting windows that node peers still copy.
        Selection on the owner: O(items log n); copies: each delivered byte once
        on a node, twice (pack + MPI) across nodes.
        """
        self._check_open()
        if self.mode == "local":
            if self.device is None:
                return self.shard.sample(batch_size, window, align)
            return self._sample_local_device(batch_size, window, align)
        err = None
        try:
            batch_size = check_batch_size(batch_size)
            window, code = check_window(self.spec, window, align)
        except Exception as e:  # agreed below, so every rank raises it
            err, batch_size, window, code = e, 0, 0, 0
        sh = self.shard
        head = self.comm.agree(err, "sample", [batch_size, window, code, sh.total_weight, len(sh), sh.min_weight])
        # every rank has entered this sample, so every node peer is done reading the last one's windows
        self._epoch += 1
        self._settled = self._epoch - 1
        try:
            return self._sample_agreed(head, window, code)
        finally:
            if self._node_peers:  # this rank's reads of its node peers' memory for this sample are over
                hints.publish(self._reads_done, self._epoch)

    def _sample_agreed(self, head: np.ndarray, window: int, code: int) -> Batch:
        """The part of :meth:`sample` after the arguments are agreed (``head``: a row per rank)."""
        sizes_f, windows, codes, masses_f, counts_f, mins = zip(*head.tolist())  # a few numbers per rank
        if len(set(windows)) > 1 or len(set(codes)) > 1:
            raise ValueError(f"sample: window and align must be the same on every rank; got windows "
                             f"{[int(w) for w in windows]} and align codes {[int(c) for c in codes]}")
        total, wmin, wanted = sum(masses_f), min(mins), sum(sizes_f) > 0
        if wanted and sum(counts_f) == 0:
            raise EmptyReplayError("sample: the replay is empty on every rank")
        if wanted and self.selector.proportional and total <= 0.0:
            raise EmptyReplayError("sample: every live item of the replay has priority 0")
        sizes = np.array(sizes_f, np.int64)
        if self.selector.proportional:
            if self.mode == "decentralized":
                return self._exchange(*self._draw_decentralized(sizes, head[:, 3], total), window, code, total, wmin)
            assign, recv_counts = self._draw_centralized(sizes)
        else:
            if self.mode == "decentralized":
                assign, recv_counts = self._merge_ordered(sizes, np.array(counts_f, np.int64))
            else:
                assign, recv_counts = self._merge_ordered_at_root(sizes, np.array(counts_f, np.int64))
        return self._exchange(*_flatten(assign), recv_counts, window, code, total, wmin)

    def _sample_local_device(self, batch_size: int, window: int | None, align: str) -> Batch:
        """Mode "local" on a GPU: select from this shard, gather on the device; no communication."""
        batch_size = check_batch_size(batch_size)
        window, code = check_window(self.spec, window, align)
        if batch_size:
            self.shard.check_can_sample()
        counts = np.zeros(self.size, np.int64)
        counts[self.rank] = batch_size
        return self._exchange(self.shard.select(batch_size), counts, counts, window, code, self.shard.total_weight,
                              self.shard.min_weight, local=True)

    def _draw_decentralized(self, sizes: np.ndarray, masses: np.ndarray, total: float):
        """Counts[r, o] ~ Multinomial(B_r, mass_o / total), independently per requester r.

        Drawn from a stream that every rank holds and advances identically, so the
        whole count matrix is known everywhere without an alltoall. Owners then draw
        that many items from their own shard: P(item) = w_i / total exactly.
        Returns (this rank's slots in requester order, how many for each requester,
        how many each owner serves this rank).
        """
        counts = self.shared_rng.multinomial(sizes, masses / total)
        serve = np.ascontiguousarray(counts[:, self.rank])
        return self.shard.select(int(serve.sum())), serve, counts[self.rank]

    def _draw_centralized(self, sizes: np.ndarray):
        """Rank 0 gathers every live weight, draws for everybody, scatters the choices."""
        slots, weights = self.shard.live_weights()
        packed = np.stack([slots, weights.view(np.int64)], 1).reshape(-1)
        gathered, counts = self.comm.gatherv(packed, 0, "sample (gather state)")
        chunks = None
        if self.rank == 0:
            table = gathered.reshape(-1, 2)
            owner = np.repeat(np.arange(self.size), counts // 2)
            cum = np.cumsum(table[:, 1].view(np.float64))
            picks = np.searchsorted(cum, self.rng.random(int(sizes.sum())) * cum[-1], side="right")
            picks = np.minimum(picks, len(cum) - 1)
            requester = np.repeat(np.arange(self.size), sizes)
            chunks = []
            for o in range(self.size):
                mine = owner[picks] == o
                # (requester, slot) pairs, already in requester order
                chunks.append(np.stack([requester[mine], table[picks[mine], 0]], 1).reshape(-1))
        return self._scatter_assignments(chunks)

    def _merge_ordered(self, sizes: np.ndarray, counts: np.ndarray):
        """Every rank merges the shards' best candidates the same way; owners serve their part."""
        btot = int(sizes.sum())
        slots, keys = self.shard.ordered_candidates(btot)
        ncand = np.minimum(counts, btot)
        all_keys = self.comm.allgatherv(keys, ncand, "sample (candidates)")
        owner, index, requester = _global_order(all_keys, ncand, sizes)
        me = owner == self.rank
        serve_req, serve_idx = requester[me], index[me]
        assign = [slots[serve_idx[serve_req == r]] for r in range(self.size)]
        recv = np.bincount(owner[requester == self.rank], minlength=self.size)
        return assign, recv

    def _merge_ordered_at_root(self, sizes: np.ndarray, counts: np.ndarray):
        """Rank 0 gathers the candidates, merges, and scatters the choices."""
        btot = int(sizes.sum())
        slots, keys = self.shard.ordered_candidates(btot)
        gathered, _ = self.comm.gatherv(np.stack([slots, keys], 1).reshape(-1), 0, "sample (gather state)")
        chunks = None
        if self.rank == 0:
            table = gathered.reshape(-1, 2)
            ncand = np.minimum(counts, btot)
            owner, index, requester = _global_order(table[:, 1], ncand, sizes)
            offsets = np.concatenate([[0], np.cumsum(ncand)[:-1]])
            chunks = []
            for o in range(self.size):
                mine = owner == o
                chunks.append(np.stack([requester[mine], table[offsets[o] + index[mine], 0]], 1).reshape(-1))
        return self._scatter_assignments(chunks)

    def _scatter_assignments(self, chunks):
        pairs = self.comm.scatterv(chunks, np.int64, 0, "sample (scatter choices)").reshape(-1, 2)
        assign = [pairs[pairs[:, 0] == r, 1] for r in range(self.size)]
        recv = self.comm.alltoall(np.array([len(a) for a in assign], np.int64), "sample (counts)")
        return assign, recv

    def _exchange(self, slots: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, window: int,
                  code: int, total: float, wmin: float, local: bool = False) -> Batch:
        """Owners send choices (and windows for remote requesters); requesters assemble the batch.

        ``slots``: what this rank serves, in requester order (``send_counts`` each).
        ``local``: this rank serves only itself (mode "local" on a GPU): no communication.
        """
        sh, size = self.shard, self.size
        meta = sh.choice_rows(slots, window, code, total, wmin)
        win_start, n_valid, pad_front = meta[:, 1], meta[:, 2], meta[:, 3]
        row_of_owner = np.zeros(size + 1, np.int64)
        np.cumsum(recv_counts, out=row_of_owner[1:])
        nb = int(row_of_owner[-1])
        if self.device is None:
            batch = Batch.empty(self.spec, nb, window)
            data, mask = batch.numpy(), batch._mask_np
        else:
            data = {c.name: self.device.empty((nb, window) + c.shape, c.dtype) for c in self.spec.columns}
            mask = self.device.empty((nb, window), np.bool_)
        if local:
            got = meta
        else:
            # choices and (for requesters that cannot read this rank's memory) windows, in flight at once
            got = np.empty((nb, _META), np.int64)
            requests = [self.comm.ialltoallv(meta.reshape(-1), send_counts * _META, got.reshape(-1),
                                             recv_counts * _META)]
            send_buffers = []  # must outlive the requests
            if self.any_remote and self.device is None:
                send_buffers = self._post_windows(requests, send_counts, win_start, n_valid, pad_front, recv_counts,
                                          row_of_owner, batch, window)
            elif self.any_remote:
                self._device_windows(send_counts, win_start, n_valid, pad_front, recv_counts, row_of_owner,
                                     data, window)
            self.comm.wait_all(requests, "sample (choices and windows)")
            del send_buffers
        self.windows_shared += int(recv_counts @ self._peer_direct)
        self.windows_mpi += int(recv_counts @ self._remote)
        if self.device is None:
            # windows read directly (this rank's own and, on the shared-memory path, the node's), keys,
            # lengths, probabilities and mask of every row: one kernel
            keys, probabilities, weights, lengths = batch.meta_numpy()
            gather_kernels.gather_from_owners(self._column_addrs, self.spec.step_bytes_array, sh.capacity_steps,
                                              self.direct, row_of_owner, got, batch.byte_views(), window, mask,
                                              keys, lengths, probabilities)
            weights[:] = got[:, 5].view(np.float64)
        else:
            g_start, g_valid, g_pad = got[:, 1].copy(), got[:, 2].copy(), got[:, 3].copy()
            rows = np.arange(nb, dtype=np.int64)
            for o in range(size):
                lo, hi = row_of_owner[o], row_of_owner[o + 1]
                if hi > lo and self.direct[o]:
                    self._device_gather(self.device_views[o], (g_start[lo:hi], g_valid[lo:hi], g_pad[lo:hi],
                                                               rows[lo:hi]), data, mask)
            from .kernels import cuda_gather
            cuda_gather.fill_mask(g_valid, g_pad, rows, self.device.numba_view(mask), self.device.threads)
            dev = self.device.torch_device
            batch = Batch.from_tensors(data, mask, torch.from_numpy(got[:, 0].copy()).to(dev),
                                       torch.from_numpy(got[:, 4].view(np.float64).copy()).to(dev),
                                       torch.from_numpy(got[:, 5].view(np.float64).astype(np.float32)).to(dev),
                                       torch.from_numpy(g_valid).to(dev))
            self.device.synchronize()
        sh.after_sampling(slots)
        return batch

    def _device_gather(self, views: dict, part: tuple, data: dict, mask) -> None:
        """Zero-copy gather on the GPU: windows read from mapped host memory into device columns."""
        from .kernels import cuda_gather
        ctx = self.device
        cuda_gather.gather_into(views, self.spec, self.shard.capacity_steps, *part,
                                {n: ctx.numba_view(t) for n, t in data.items()}, ctx.numba_view(mask), ctx.threads)

    def _remote_plan(self, send_counts, recv_counts):
        """Counts through the transport, and which of this rank's served items travel (send order)."""
        recv_from = np.where(self.direct, 0, recv_counts)
        send_to = np.where(self.direct, 0, send_counts)
        send_first = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
        pick = np.concatenate([np.arange(send_first[r], send_first[r] + send_to[r]) for r in range(self.size)]
                              ).astype(np.int64) if send_to.sum() else np.zeros(0, np.int64)
        return recv_from, send_to, pick

    def _device_windows(self, send_counts, win_start, n_valid, pad_front, recv_counts, row_of_owner,
                        data: dict, window: int) -> None:
        """Windows for requesters on other nodes, over torch.distributed (NCCL) between device buffers:
        packed on the GPU straight from mapped host memory, received into a device scratch buffer,
        then copied into the batch rows of their owners."""
        from .kernels import cuda_gather
        ctx, cap = self.device, self.shard.capacity_steps
        recv_from, send_to, pick = self._remote_plan(send_counts, recv_counts)
        n_out, n_in = len(pick), int(recv_from.sum())
        remote_rows = torch.from_numpy(np.concatenate(
            [np.arange(row_of_owner[o], row_of_owner[o + 1]) for o in range(self.size) if not self.direct[o]]
            + [np.zeros(0, np.int64)]).astype(np.int64)).to(ctx.torch_device)
        nb = int(recv_counts.sum())
        for c in self.spec.columns:
            row_bytes = window * c.step_bytes
            send = ctx.empty((n_out * row_bytes,), np.uint8)
            if n_out:
                cuda_gather.gather_windows(self.device_views[self.rank][c.name], cap, c.step_bytes,
                                           win_start[pick] % cap, n_valid[pick], pad_front[pick],
                                           np.arange(n_out, dtype=np.int64), ctx.numba_view(send), window,
                                           ctx.threads)
            recv = ctx.empty((n_in * row_bytes,), np.uint8)
            ctx.synchronize()
            what = f"sample (windows of {c.name!r})"
            if self.torch_comm is not None:
                self.torch_comm.alltoallv(send, send_to * row_bytes, recv, recv_from * row_bytes, what)
            else:  # a CUDA-aware MPI reads and writes the device buffers itself
                self.comm.alltoallv_bytes(send, send_to * row_bytes, recv, recv_from * row_bytes, what)
            if n_in:
                rows_view = data[c.name].view(-1).view(torch.uint8).view(nb, row_bytes)
                rows_view.index_copy_(0, remote_rows, recv.view(n_in, row_bytes))

    def _post_windows(self, requests: list, send_counts, win_start, n_valid, pad_front, recv_counts,
                      row_of_owner, batch: Batch, window: int) -> list:
        """Post one alltoallv per column: windows for requesters that cannot read this rank's
        memory, received straight into the batch rows. Returns the send buffers (keep them alive)."""
        recv_from, send_to, pick = self._remote_plan(send_counts, recv_counts)
        n_out = len(pick)
        views = self.shard.store.byte_views()
        cap = self.shard.capacity_steps
        buffers = []
        for c in self.spec.columns:
            row_bytes = window * c.step_bytes
            sendbuf = np.empty(n_out * row_bytes, np.uint8)
            if n_out:
                gather_kernels.gather_windows(views[c.name], cap, c.step_bytes, win_start[pick] % cap,
                                              n_valid[pick], pad_front[pick], np.arange(n_out, dtype=np.int64),
                                              sendbuf, window)
            dst = batch.numpy()[c.name].reshape(-1).view(np.uint8)
            requests.append(self.comm.ialltoallv(sendbuf, send_to * row_bytes, dst, recv_from * row_bytes,
                                                 recv_displs=row_of_owner[:-1] * row_bytes))
            buffers.append(sendbuf)
        return buffers

    def _settle(self) -> None:
        """The node fence: before this rank writes its shard again, wait until every node peer has
        finished reading its windows of the last sample (each publishes the last sample it finished
        in its arena's header). Free when a collective has been passed since; otherwise a spin on
        a few shared counters, with the communicator's deadline."""
        if not self._node_peers or self._settled == self._epoch:
            return
        epoch = self._epoch
        deadline = time.monotonic() + self.comm.timeout
        while any(int(d[0]) < epoch for d in self._peer_done):
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(f"node fence: a node peer did not finish reading this rank's windows "
                                             f"of sample {epoch} within timeout={self.comm.timeout:g} s")
            os.sched_yield()
        hints.fence()  # no write of ours before the peers' reads that the counters vouch for
        self._settled = epoch

    # ---- priorities ---------------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Collective: route each key's new priority to its owner; returns how many of this
        rank's keys were applied (stale keys are dropped and counted in :meth:`stats`).

        Cost: one allgather (status), one alltoall of counts, one alltoallv of 16
        bytes per key, one alltoall of applied counts; O(n) on the owner plus one
        batched index update. Duplicate keys: the highest rank's value wins, and
        within a rank the last one.
        """
        self._check_open()
        err = None
        try:
            keys = as_key_array(keys)
            pr = validate_priorities(priorities, len(keys))
            tag, owner, _, _ = keyspace.decode(keys)
            bad = (keys < 0) | (tag != self.shard.tag) | (owner >= self.size)
            if bad.any():
                raise InvalidKeyError(f"key {int(keys[np.flatnonzero(bad)[0]])} was not issued by this replay")
        except Exception as e:
            err, keys, pr, owner = e, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
        self.comm.agree(err, "update_priorities")
        self._settle()
        if self.mode == "local":
            return int(self.shard.apply_priorities(keys, pr).sum())
        order = np.argsort(owner, kind="stable")
        send_counts = np.bincount(owner, minlength=self.size).astype(np.int64)
        packed = np.stack([keys[order], pr[order].view(np.int64)], 1).reshape(-1)
        recv_counts = self.comm.alltoall(send_counts, "update_priorities (counts)")
        got = np.empty((int(recv_counts.sum()), 2), np.int64)
        self.comm.alltoallv(packed, send_counts * 2, got.reshape(-1), recv_counts * 2, "update_priorities (keys)")
        applied = self.shard.apply_priorities(got[:, 0], got[:, 1].view(np.float64).copy())
        source = np.repeat(np.arange(self.size), recv_counts)
        per_source = np.bincount(source, weights=applied, minlength=self.size).astype(np.int64)
        back = self.comm.alltoall(per_source, "update_priorities (applied)")
        return int(back.sum())

    # ---- stats and lifetime -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Collective: per-shard counters (lists indexed by rank), totals, and balance
        (largest shard / mean shard, in items). Cost: one allgather of 12 values per rank."""
        self._check_open()
        mine = self.shard.stats()
        mine.update(windows_shared=self.windows_shared, windows_mpi=self.windows_mpi)
        table = self.comm.agree(None, "stats", [mine[k] for k in _STATS])
        self._settle()
        out: dict[str, Any] = {"ranks": self.size, "mode": self.mode}
        for i, k in enumerate(_STATS):
            col = table[:, i]
            out[k] = [float(v) if k == "total_weight" else int(v) for v in col]
            out[f"total_{k}"] = float(col.sum()) if k == "total_weight" else int(col.sum())
        items = table[:, 0]
        out["balance"] = float(items.max() / items.mean()) if items.sum() else 1.0
        return out

    def close(self) -> None:
        """Collective: wait for every rank, unmap the node's shared memory, free the shard.

        If the communicator is broken (after a timeout) it closes locally only.
        Idempotent.
        """
        if self.closed:
            return
        self.closed = True
        try:
            if self.comm.broken is None and self.size > 1:
                self._settle()
                self.comm.barrier("close")
        finally:
            for mapped in self._mapped:  # unregister the pinned mappings before unmapping the arenas
                mapped.close()
            self._mapped, self.device_views = [], {}
            if self.torch_comm is not None:
                self.torch_comm.close()
            self.peer_views = {}
            for r, arena in self._arenas.items():
                if r != self.rank:
                    arena.close()
            self._arenas = {}
            self.shard.close()
            try:
                self.node_comm.Free()
            except Exception:
                pass

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Replay is closed")
        self.comm.check_usable()

    def __enter__(self) -> "Replay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Replay(rank={self.rank}/{self.size}, mode={self.mode!r}, sampler={self.selector!r}, "
                f"items_here={len(self.shard)})")

    # ---- checkpoints (see gear_mpi.checkpoint) -------------------------------------------------
    def save(self, path) -> None:
        """Collective: write a crash-safe, checksummed checkpoint of every shard to directory ``path``."""
        from .checkpoint import save
        save(self, path)

    @classmethod
    def load(cls, path, comm=None, **overrides) -> tuple["Replay", tuple[np.ndarray, np.ndarray]]:
        """Collective: restore a checkpoint onto ``comm``; returns ``(replay, key_map)`` (old -> new keys)."""
        from .checkpoint import load
        return load(path, comm, cls, **overrides)


def _share_cores(ranks_on_node: int) -> None:
    """Give this rank's numba kernels its share of the node's cores (unless NUMBA_NUM_THREADS is set):
    ranks that each start as many threads as the node has cores oversubscribe it."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return
    import numba
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, cores // max(1, ranks_on_node))))


def _flatten(assign: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-requester slot lists as (slots in requester order, count for each requester)."""
    counts = np.array([len(a) for a in assign], np.int64)
    return np.concatenate(assign).astype(np.int64, copy=False), counts


def _global_order(keys: np.ndarray, ncand: np.ndarray, sizes: np.ndarray):
    """Merge candidate lists (concatenated by owner, each best first) into the global order.

    Returns, for the ``sum(sizes)`` picks: owner, index in the owner's list, and
    requester (picks dealt to requesters in rank order; cycling through the
    candidates when fewer exist than asked). Ties: lower owner rank, then the
    owner's own order. Cost: O(C log C) for C candidates.
    """
    owner_all = np.repeat(np.arange(len(ncand)), ncand)
    index_all = np.arange(len(keys)) - np.repeat(np.concatenate([[0], np.cumsum(ncand)[:-1]]), ncand)
    order = np.lexsort((index_all, owner_all, keys))
    btot = int(sizes.sum())
    picks = np.resize(order, btot) if len(order) else np.zeros(0, np.int64)
    requester = np.repeat(np.arange(len(sizes)), sizes)
    return owner_all[picks], index_all[picks], requester
