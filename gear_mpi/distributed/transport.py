"""Window transport: choices and windows from their owners into the requesters' batches.

After a plan has assigned items, every owner sends each requester one 48-byte
*choice* per item (``kernels.gather.CHOICE``: key, window placement,
probability, weight) in one alltoallv. The windows themselves travel one of
three ways, decided per owner by the :class:`~gear_mpi.distributed.node.NodeView`:

- **direct**: the requester maps the owner's memory (itself, or a node peer's
  shared memory) and copies the window out of it -- on the CPU with
  ``gather_from_owners`` (one kernel for the whole batch), on the GPU with
  ``cuda_gather.gather_into`` from the memory mapped into the device;
- **host MPI**: one alltoallv per column, posted together with the choices'
  and received straight into the batch rows (``B W S`` bytes in all). Windows of a
  compressed column (:class:`~gear_mpi.spec.Compressed`) are decompressed by their owner
  into its send buffer and travel raw: on the 2-core CI machine a 84x84 Pong window
  decompresses at about 1.4 GB/s, so sending compressed chunks would move the same
  decompression to the requester and add the bytes of every chunk a window only partly
  covers (see docs/guide/storage.md). Node peers under ``memory="shm"`` read a compressed
  column directly: the requester decodes the owner's chunks from the node-shared chunk
  table (:mod:`gear_mpi.storage.shared_chunks`); under ``memory="file"`` they take this path;
- **device exchange** (``device="cuda"``): windows packed on the GPU, one
  ``all_to_all_single`` per column over NCCL (``window_transport="nccl"``) or a
  CUDA-aware MPI (``"mpi"``), then copied into the batch rows.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from ..batch import Batch
from .comm import MpiComm, displacements
from ..kernels import gather as gather_kernels
from .node import CHOICE_CAPACITY, NodeView
from ..shard import Shard
from ..storage import derived as derived_columns

_WIDTH = gather_kernels.CHOICE_WIDTH
#: the rows of a device sample's one upload (:meth:`WindowTransport._upload_rows`)
_DEVICE_ROWS = ("start", "valid", "pad_front", "row", "key", "probability", "weight")
_START, _VALID, _PAD, _ROW, _KEY, _PROBABILITY, _WEIGHT = range(len(_DEVICE_ROWS))


class WindowTransport:
    """Moves choices and windows for one replay (see the module docstring).

    Construction is collective (a torch.distributed bootstrap) when a device replay has windows to
    send through NCCL; otherwise local.
    Args:
        comm: the replay's communicator.
        node: this rank's :class:`~gear_mpi.distributed.node.NodeView`, attached.
        shard: this rank's shard.
        device: the replay's ``DeviceContext`` (None: a host replay).
        kind: ``"nccl"`` or ``"mpi"``, how a device replay's windows travel between nodes.
        process_group: an existing torch.distributed group for the NCCL path (None: bootstrap one).
    Raises:
        ValueError, CollectiveTimeoutError: as :class:`~gear_mpi.distributed.torch_comm.TorchComm` (NCCL path only).
    """

    def __init__(self, comm: MpiComm, node: NodeView, shard: Shard, device=None, kind: str = "nccl",
                 process_group=None):
        self.comm, self.node, self.shard, self.device = comm, node, shard, device
        self.spec = shard.spec
        self.torch_comm = None
        self.copy_seconds = 0.0  # time in exchange() outside MpiComm waits (gear_mpi.stats)
        self._decode_error: Exception | None = None  # this sample's first failure to decode a compressed chunk
        if device is not None and node.any_remote and kind == "nccl":
            from .torch_comm import TorchComm
            backend = "gloo" if device.simulator else "nccl"
            self.torch_comm = TorchComm(comm, backend, comm.timeout, process_group=process_group)

    def exchange(self, choices: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, window: int,
                 local: bool = False, out: Batch | None = None, counts: np.ndarray | None = None,
                 context: np.ndarray | None = None) -> Batch:
        """Deliver the choices and windows of one sample into a batch, in owner order.

        Collective unless ``local``. Cost: one alltoallv of 48 bytes per item, in flight together with
        one alltoallv per column for windows sent through the transport; each delivered byte copied once on a node.
        Args:
            choices: this rank's served choices, ``[n, CHOICE_WIDTH]`` int64, in requester order.
            send_counts: choices (and windows) for each requester r, ``send_counts[r]``.
            recv_counts: items each owner o serves this rank, ``recv_counts[o]``.
            window: steps per window.
            local: this rank serves only itself (mode "local" on a GPU): no communication.
            out: a host batch of exactly these windows to fill (checked by the caller), or None: a new one.
            counts: ``[ranks, ranks]``, items owner o serves requester r at ``[r, o]``, when every rank knows
                them (None: unknown). With a node board and no owner serving more than it holds, the choices
                travel through the board (no MPI message; :class:`~gear_mpi.distributed.node.NodeBoard`).
            context: a spec with derived columns (host replays): each served window's context
                (``Shard.frame_context``); then one more alltoallv round (:meth:`_derived_exchange`).
        Returns:
            The :class:`~gear_mpi.batch.Batch` of ``sum(recv_counts)`` windows (on the device for a device replay).
        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline.
            CollectiveError: (NCCL path) the torch communicator broke in an earlier call.
        """
        start, waited = time.perf_counter(), self.comm.waited
        try:
            return self._exchange(choices, send_counts, recv_counts, window, local, out, counts, context)
        finally:  # packing, the batch's pages and the window copies: everything but the collectives' waits
            self.copy_seconds += time.perf_counter() - start - (self.comm.waited - waited)

    def _exchange(self, choices: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, window: int,
                  local: bool, out: Batch | None, counts: np.ndarray | None = None,
                  context: np.ndarray | None = None) -> Batch:
        node, size = self.node, self.comm.size
        self._decode_error = None
        row_of_owner = np.zeros(size + 1, np.int64)
        np.cumsum(recv_counts, out=row_of_owner[1:])
        nb = int(row_of_owner[-1])
        if self.device is None:
            batch = out if out is not None else Batch.empty(self.spec, nb, window)
            data, mask = batch.numpy(), batch._mask_np
        else:
            data = {c.name: self.device.empty((nb, window) + c.shape, c.dtype) for c in self.spec.columns}
            mask = self.device.empty((nb, window), np.bool_)
        board = node.board if counts is not None and self.device is None else None
        context_sent = None  # context windows _post_host decompressed, for _derived_exchange to send
        if local:
            got = choices
        elif board is not None and int(counts.sum(0).max()) <= CHOICE_CAPACITY:  # every owner's fit
            board.post(choices, node.epoch)
            got = np.empty((nb, _WIDTH), np.int64)
            board.collect(counts, node.epoch, choices, got, "sample (choices)")
        else:
            # choices and (for requesters that cannot read this rank's memory) windows, in flight at once
            fields = gather_kernels.choice_records(choices)
            win_start, n_valid, pad_front = fields["start"], fields["valid"], fields["pad_front"]
            got = np.empty((nb, _WIDTH), np.int64)
            requests = [self.comm.ialltoallv(choices.reshape(-1), send_counts * _WIDTH, got.reshape(-1),
                                             recv_counts * _WIDTH)]
            send_buffers = []  # must outlive the requests
            if node.any_remote and self.device is None:
                send_buffers, context_sent = self._post_host(requests, send_counts, win_start, n_valid, pad_front,
                                                             recv_counts, row_of_owner, batch, window, context)
            elif node.any_remote:
                self._device_windows(send_counts, win_start, n_valid, pad_front, recv_counts, row_of_owner,
                                     data, window)
            self.comm.wait_all(requests, "sample (choices and windows)")
            del send_buffers
        if self.device is None:
            # windows read directly (this rank's own and, on the shared-memory path, the node's), keys,
            # lengths, probabilities and mask of every row: one kernel
            keys, probabilities, weights, lengths = batch.meta_numpy()
            store = self.shard.store
            # the batch's column addresses, built and checked once per batch (it holds nb windows: made for
            # them, or matched to them as out=); gather.out_addresses would check them again every call
            gather_kernels.gather_rows_from_owners(node.column_addrs, store.gather_step_bytes,
                                                   self.shard.capacity_steps, node.direct, row_of_owner, got,
                                                   batch.column_addresses(), window, mask, keys, lengths,
                                                   probabilities, weights)
            if store.compressed:  # compressed columns of the windows read directly: decoded here
                with self._decode_failure_kept():
                    self._decode_direct(node, row_of_owner, got, batch, window)
            if self.spec.derived:
                self._derived_exchange(choices, context, send_counts, recv_counts, row_of_owner, got, batch, window,
                                       local, context_sent)
            if store.compressed:  # every decode failure of this sample, here or in a window this rank sent
                err, self._decode_error = self._decode_error, None
                if local:
                    if err is not None:
                        raise err
                else:  # one rank's damaged chunk fails the sample on every rank (an allgather of 8 bytes a rank)
                    self.comm.agree(err, "sample (windows)")
            return batch
        import torch
        from ..kernels import cuda_gather
        got_fields = gather_kernels.choice_records(got)
        rows = self._upload_rows(got_fields, nb)
        ctx = self.device
        on_device = ctx.numba_view(rows)  # one view for the kernels (numba waits for the tensor's stream once)
        for o in range(size):
            lo, hi = int(row_of_owner[o]), int(row_of_owner[o + 1])
            if hi > lo and node.direct[o]:
                part = tuple(on_device[k, lo:hi] for k in (_START, _VALID, _PAD, _ROW))
                self._device_gather(node.device_views[o], part, data)
        if self.spec.compressed:
            self._device_compressed(got_fields, row_of_owner, data, window)
        cuda_gather.fill_mask(on_device[_VALID], on_device[_PAD], on_device[_ROW], ctx.numba_view(mask), ctx.threads)
        batch = Batch.from_tensors(data, mask, rows[_KEY], rows[_PROBABILITY].view(torch.float64),
                                   rows[_WEIGHT].view(torch.float64).to(torch.float32), rows[_VALID])
        ctx.synchronize()
        return batch

    def _upload_rows(self, got_fields: np.ndarray, nb: int):
        """What a device batch's rows need from their choices, in one host-to-device copy: a ``[7, nb]`` int64
        tensor on the device whose rows are the ring start (modulo the capacity), real steps, leading padding,
        batch row, key, and the bits of the probability and of the importance weight (float64). The gathers,
        the mask and the batch's metadata tensors are views of it. Cost: O(nb) on the host, one copy of
        ``56 nb`` bytes (before: one copy per index array, per owner and again for the mask, and one per
        metadata tensor)."""
        import torch
        host = np.empty((len(_DEVICE_ROWS), nb), np.int64)
        np.remainder(got_fields["start"], self.shard.capacity_steps, out=host[_START])
        host[_VALID] = got_fields["valid"]
        host[_PAD] = got_fields["pad_front"]
        host[_ROW] = np.arange(nb, dtype=np.int64)
        host[_KEY] = got_fields["key"]
        host[_PROBABILITY] = got_fields["probability"].view(np.int64)
        host[_WEIGHT] = got_fields["weight"].view(np.int64)
        return torch.from_numpy(host).to(self.device.torch_device)

    def _decode_direct(self, node, row_of_owner: np.ndarray, got: np.ndarray, batch: Batch, window: int) -> None:
        """The compressed columns of the windows this rank read directly (its own, node peers'), decoded into
        the batch rows (those with frame stacks are decoded with their stacks, later). O(chunks touched)."""
        for o in np.flatnonzero(node.direct).tolist():
            lo, hi = int(row_of_owner[o]), int(row_of_owner[o + 1])
            if hi <= lo:
                continue
            src = self._chunks_of(o)
            later = derived_columns.chunk_sources(self.spec, src)
            mine = gather_kernels.choice_records(got[lo:hi])
            src.gather_compressed(mine["start"], mine["valid"], mine["pad_front"], np.arange(lo, hi, dtype=np.int64),
                                  {n: v for n, v in zip(self.spec.names, batch.byte_views()) if n not in later},
                                  window, mine["key"])

    def _derived_exchange(self, choices: np.ndarray, context: np.ndarray, send_counts: np.ndarray,
                          recv_counts: np.ndarray, row_of_owner: np.ndarray, got: np.ndarray, batch: Batch,
                          window: int, local: bool, context_sent: dict | None = None) -> None:
        """The derived columns (frame stacks, next steps) of a host batch, rebuilt by this requester: each
        window's context (one int64) travels in one alltoallv; the frames of windows whose owner's memory
        this rank reads (itself, node peers) are read there, those of other owners travel as context
        windows (``context_before + W + tail`` source steps each, one alltoallv per source column: fewer
        bytes than the rebuilt columns' ``frames`` steps per window step and column). Collective unless
        ``local``. ``context_sent``: the context windows to send, where :meth:`_post_host` decompressed them
        already (None: packed here). Cost: these exchanges, then :func:`~gear_mpi.storage.derived.rebuild_derived`."""
        spec, node, nb = self.spec, self.node, int(row_of_owner[-1])
        got_ctx = context
        buffers, remote_rows = {}, np.zeros(0, np.int64)
        if not local:
            got_ctx = np.empty(nb, np.int64)
            requests = [self.comm.ialltoallv(np.ascontiguousarray(context, np.int64), send_counts, got_ctx,
                                             recv_counts)]
            send_buffers = {}
            if node.any_remote:
                recv_from, send_to, pick = self._remote_plan(send_counts, recv_counts)
                fields = gather_kernels.choice_records(choices)
                send_buffers = context_sent  # decompressed with the windows sent (_post_host), or now:
                e = derived_columns.context_steps(spec, window)
                if send_buffers is None:
                    with self._decode_failure_kept():
                        send_buffers = derived_columns.pack_context(spec, self.shard.store.byte_views(),
                                                                    self.shard.capacity_steps, fields["start"][pick],
                                                                    context[pick], fields["valid"][pick], window,
                                                                    self.shard.store)
                if send_buffers is None:  # a damaged chunk: sent unfilled
                    send_buffers = {n: np.empty(len(pick) * e * spec[n].step_bytes, np.uint8)
                                    for n in derived_columns.sources(spec)}
                for name, sendbuf in send_buffers.items():
                    row_bytes = e * spec[name].step_bytes
                    buffers[name] = np.empty(int(recv_from.sum()) * row_bytes, np.uint8)
                    requests.append(self.comm.ialltoallv(sendbuf, send_to * row_bytes, buffers[name],
                                                         recv_from * row_bytes))
                remote_rows = np.concatenate(
                    [np.arange(row_of_owner[o], row_of_owner[o + 1]) for o in range(self.comm.size)
                     if not node.direct[o]] + [np.zeros(0, np.int64)]).astype(np.int64)
            self.comm.wait_all(requests, "sample (frame context)")
            del send_buffers
        with self._decode_failure_kept():
            self._rebuild_derived(got, got_ctx, row_of_owner, batch, window, buffers, remote_rows)

    @contextlib.contextmanager
    def _decode_failure_kept(self):
        """Around a step that decodes compressed chunks: a failure (a damaged chunk, CorruptDataError) is kept
        for the sample's one agreement (:meth:`_exchange`) instead of raised on this rank alone, whose peers
        would then wait in the next exchange. A replay without compressed columns raises as before."""
        try:
            yield
        except Exception as err:
            if not self.spec.compressed:
                raise
            self._decode_error = self._decode_error or err

    def _rebuild_derived(self, got: np.ndarray, got_ctx: np.ndarray, row_of_owner: np.ndarray, batch: Batch,
                         window: int, buffers: dict, remote_rows: np.ndarray) -> None:
        """The derived columns of every row: rebuilt from the rings this rank reads, or from the context windows
        received (``buffers``, for ``remote_rows``). Local; O(rows x derived steps)."""
        spec, node, nb = self.spec, self.node, int(row_of_owner[-1])
        fields = gather_kernels.choice_records(got)
        starts, valid, pad = fields["start"], fields["valid"], fields["pad_front"]
        outs = batch.derived_views()
        rows = np.arange(nb, dtype=np.int64)
        for o in range(self.comm.size):
            lo, hi = row_of_owner[o], row_of_owner[o + 1]
            if hi > lo and (o == self.comm.rank or node.direct[o] and spec.compressed):
                # windows decoded here: this rank's own, a node peer's shared chunks (compressed sources: their
                # columns too)
                store = self._chunks_of(o)
                own = {n: v for n, v in zip(spec.names, batch.byte_views())
                       if n in derived_columns.chunk_sources(spec, store)}
                derived_columns.rebuild_local(spec, store, node.column_addrs[o], starts[lo:hi], got_ctx[lo:hi],
                                              valid[lo:hi], pad[lo:hi], rows[lo:hi], outs, window, own,
                                              fields["key"][lo:hi])
            elif hi > lo and node.direct[o]:  # a node peer's ring, read in place
                derived_columns.rebuild_derived(spec, node.column_addrs[o], self.shard.capacity_steps, starts[lo:hi],
                                                got_ctx[lo:hi], valid[lo:hi], pad[lo:hi], rows[lo:hi], outs, window)
        if len(remote_rows):
            derived_columns.rebuild_from_context(spec, buffers, got_ctx[remote_rows], valid[remote_rows],
                                                 pad[remote_rows], remote_rows, outs, window)

    def _chunks_of(self, owner: int):
        """Where owner ``owner``'s compressed columns are decoded from: this rank's store, or a node peer's
        shared chunks (:class:`~gear_mpi.storage.shared_chunks.PeerChunks`). O(1)."""
        return self.shard.store if owner == self.comm.rank else self.node.peer_chunks[owner]

    def _host_decoded(self, src, column, starts, valid, pad, keys, window: int, dst) -> None:
        """Windows of compressed ``column`` decoded on the host from ``src`` (a store or a node peer's shared
        chunks) into the device's page-locked staging buffer, then copied into ``dst`` (a flat uint8 device
        tensor of ``len(starts)`` rows). Cost: the decompression, one host-to-device copy."""
        n, row_bytes = len(starts), window * column.step_bytes
        if n == 0:
            return
        stage = self.device.staging(n * row_bytes)[:n * row_bytes]
        src.gather_compressed(starts, valid, pad, np.arange(n, dtype=np.int64), {column.name: stage.numpy()}, window,
                              keys)
        dst.copy_(stage)

    def _device_compressed(self, fields: dict, row_of_owner: np.ndarray, data: dict, window: int) -> None:
        """A device batch's compressed columns of the windows read directly (this rank's own, node peers'
        under ``memory="shm"``): decoded on the host, then copied (:meth:`_host_decoded`)."""
        import torch
        for c in self.spec.columns:
            if c.compression is None:
                continue
            row_bytes = window * c.step_bytes
            flat = data[c.name].view(-1).view(torch.uint8)
            for o in np.flatnonzero(self.node.direct).tolist():
                lo, hi = int(row_of_owner[o]), int(row_of_owner[o + 1])
                if hi > lo:
                    self._host_decoded(self._chunks_of(o), c, fields["start"][lo:hi], fields["valid"][lo:hi],
                                       fields["pad_front"][lo:hi], fields["key"][lo:hi], window,
                                       flat[lo * row_bytes:hi * row_bytes])

    def _device_gather(self, views: dict, part: tuple, data: dict) -> None:
        """Zero-copy gather on the GPU: windows read from mapped host memory into device columns. ``part``: the
        device arrays of ring starts (already modulo the capacity), real steps, padding and batch rows of one
        owner's windows (:meth:`_upload_rows`); the mask is filled once for the whole batch, by the caller."""
        from ..kernels import cuda_gather
        ctx = self.device
        cuda_gather.gather_into(views, self.spec, self.shard.capacity_steps, *part,
                                {n: ctx.numba_view(t) for n, t in data.items()}, None, ctx.gather_threads)

    def _remote_plan(self, send_counts, recv_counts):
        """Counts through the transport, and which of this rank's served items travel (send order)."""
        direct = self.node.direct
        recv_from = np.where(direct, 0, recv_counts)
        send_to = np.where(direct, 0, send_counts)
        send_first = displacements(send_counts)
        pick = np.concatenate([np.arange(send_first[r], send_first[r] + send_to[r]) for r in range(self.comm.size)]
                              ).astype(np.int64) if send_to.sum() else np.zeros(0, np.int64)
        return recv_from, send_to, pick

    def _device_windows(self, send_counts, win_start, n_valid, pad_front, recv_counts, row_of_owner,
                        data: dict, window: int) -> None:
        """Windows for requesters on other nodes, over torch.distributed (NCCL) between device buffers:
        packed on the GPU straight from mapped host memory, received into a device scratch buffer,
        then copied into the batch rows of their owners."""
        import torch
        from ..kernels import cuda_gather
        ctx, cap, direct = self.device, self.shard.capacity_steps, self.node.direct
        recv_from, send_to, pick = self._remote_plan(send_counts, recv_counts)
        n_out, n_in = len(pick), int(recv_from.sum())
        remote_rows = torch.from_numpy(np.concatenate(
            [np.arange(row_of_owner[o], row_of_owner[o + 1]) for o in range(self.comm.size) if not direct[o]]
            + [np.zeros(0, np.int64)]).astype(np.int64)).to(ctx.torch_device)
        nb = int(recv_counts.sum())
        own_views = self.node.device_views[self.comm.rank]
        for c in self.spec.columns:
            row_bytes = window * c.step_bytes
            send = ctx.empty((n_out * row_bytes,), np.uint8)
            if n_out and c.compression is not None:  # decoded on the host, then copied to the device
                self._host_decoded(self.shard.store, c, win_start[pick] % cap, n_valid[pick], pad_front[pick], None,
                                   window, send)
            elif n_out:
                cuda_gather.gather_windows(own_views[c.name], cap, c.step_bytes, win_start[pick] % cap,
                                           n_valid[pick], pad_front[pick], np.arange(n_out, dtype=np.int64),
                                           ctx.numba_view(send), window, ctx.gather_threads)
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

    def _post_host(self, requests: list, send_counts, win_start, n_valid, pad_front, recv_counts,
                   row_of_owner, batch: Batch, window: int, context: np.ndarray | None = None) -> list:
        """Post one alltoallv per column: windows for requesters that cannot read this rank's
        memory, received straight into the batch rows. With ``context`` (derived columns) over compressed
        sources, the windows' context windows are decompressed here once and the source columns' windows
        sent are copied out of them rather than decompressed again.

        Returns:
            ``(send buffers, context windows)``: keep the buffers alive until the requests end; the context
            windows (None where none were decompressed) are :meth:`_derived_exchange`'s to send."""
        recv_from, send_to, pick = self._remote_plan(send_counts, recv_counts)
        n_out = len(pick)
        store = self.shard.store
        views = store.byte_views()
        cap = self.shard.capacity_steps
        shared = derived_columns.chunk_sources(self.spec, store) if context is not None and n_out else frozenset()
        context_sent = None
        # a window that cannot be decoded (a damaged chunk) is sent unfilled and its error kept for the sample's
        # agreement (exchange): the requesters are not left waiting for it
        if shared:
            with self._decode_failure_kept():
                context_sent = derived_columns.pack_context(self.spec, views, cap, win_start[pick], context[pick],
                                                            n_valid[pick], window, store)
            if context_sent is None:
                shared = frozenset()
            e = derived_columns.context_steps(self.spec, window)
        buffers = []
        for c in self.spec.columns:
            row_bytes = window * c.step_bytes
            sendbuf = np.empty(n_out * row_bytes, np.uint8)
            if c.name in shared:  # the window within its context window: a copy
                gather_kernels.gather_windows(context_sent[c.name], n_out * e, c.step_bytes,
                                              np.arange(n_out, dtype=np.int64) * e + context[pick], n_valid[pick],
                                              pad_front[pick], np.arange(n_out, dtype=np.int64), sendbuf, window)
            elif n_out and c.compression is not None:  # decompressed here: windows travel raw (see module docstring)
                if self._decode_error is None:  # (after a failure the windows go unfilled)
                    with self._decode_failure_kept():
                        self.shard.store.gather_compressed(win_start[pick], n_valid[pick], pad_front[pick],
                                                           np.arange(n_out, dtype=np.int64), {c.name: sendbuf}, window)
            elif n_out:
                gather_kernels.gather_windows(views[c.name], cap, c.step_bytes, win_start[pick] % cap,
                                              n_valid[pick], pad_front[pick], np.arange(n_out, dtype=np.int64),
                                              sendbuf, window)
            dst = batch.numpy()[c.name].reshape(-1).view(np.uint8)
            requests.append(self.comm.ialltoallv(sendbuf, send_to * row_bytes, dst, recv_from * row_bytes,
                                                 recv_displs=row_of_owner[:-1] * row_bytes))
            buffers.append(sendbuf)
        return buffers, context_sent

    def close(self) -> None:
        """Destroy the torch process group this transport created (if any). Idempotent."""
        if self.torch_comm is not None:
            self.torch_comm.close()
            self.torch_comm = None
