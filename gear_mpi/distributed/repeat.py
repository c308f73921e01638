"""A repeated decentralized ``Replay.sample`` into the same ``out=`` batch, or into a new batch each call, on one
node (issue 34, items 2 and 6).

A training loop calls ``replay.sample(B, W, align, out=batch)`` with the same arguments every step. On a
two-rank W1 call (32 hopper windows of 1000 steps, 2 MB a rank) about 90 us of the 0.24 ms went to the
Python around the gather: the argument checks, the batch's fit, the head's row and agreement, the header
checks, the plan's :class:`~gear_mpi.distributed.plans.Assignment`, the transport's dispatch and the
counters, in some 45 calls of 1-13 us. The first call of a series takes the full path and, where the call
qualifies (:func:`remember`), leaves a :class:`SampleRecord` on the replay: a weak reference to the batch,
the checked arguments, the head row with the call's fixed values, and the buffers a call reuses.
:func:`sample_again` then makes the same collective with them, in one function:

- the head (:mod:`gear_mpi.distributed.calls`): the same row through the node board, the same checks of
  the agreed table (another rank in another call, a rank's failed arguments: the same errors, raised on
  every rank by :meth:`ReplayCalls.check <gear_mpi.distributed.calls.ReplayCalls.check>`);
- the header checks (:func:`gear_mpi.distributed.header.check_mode` and ``check_header``, called when a
  quick test of the agreed rows finds anything to say);
- the decentralized plan's draws (:func:`gear_mpi.distributed.plans.multinomial_rows` on the shared stream,
  then the owner's draw with its own stream) and choices (:meth:`Shard.make_choices`), in the order and on
  the streams of the full path, so that a series gives the same batches bit for bit whichever path each
  call took (tests/test_replay_repeat.py);
- the choices through the node board and the requester's one gather kernel, the window counters, the
  owner's use counts and the node fence's publication, as :meth:`WindowTransport.exchange` and
  ``Replay._exchange`` do them.

Which calls qualify: a host replay whose ranks all share one node (a node board), a proportional selector
on a host index, decentralized, no rate limiter, writers, actor ranks or background checkpoints, no
derived or compressed columns, memory columns (no mapped checkpoint to hold), an ``int`` batch size of at
least 1, and an ``out=`` batch, or none: then the record (a *fresh* one, kept under ``id(None)``) repeats calls
that return a new batch, allocated as the full path allocates it (a 2-rank ``Replay.sample(32, 1)`` of one-step
items into new batches: 89-91 us a call through the full path, 54-57 us repeated; into ``out=``: 38-41 us).
Whatever changes that (a writer's address asked for, ``checkpoint_every``) sends the next call down the full
path (:meth:`SampleRecord.usable`). The record holds no strong reference to the batch or its arrays (its column
addresses are plain integers), so a dropped batch is freed and its reference counts stay what its holders make
them (``batches(recycle="auto")``).
"""
from __future__ import annotations

import time
import weakref

import numpy as np

from . import header
from .calls import _SPAN, OPS, WIDTH, ReplayCalls, mark_interrupted
from .header import ALIGN, BATCH, INSERTED, ITEMS, MASS, MIN_WEIGHT, MODE, SAMPLED, WINDOW
from .node import CHOICE_CAPACITY
from .plans import multinomial_rows, two_owner_rows
from ..batch import Batch, check_window
from ..kernels import gather as gather_kernels
from ..kernels import sample_rounds as rounds
from ..kernels.compiled import KernelCalls
from ..keys import GEN_MASK, SLOT_BITS, key_head
from ..selection.one_call import repeats
from ..selection.priority_index import PriorityIndex
from ..selection.selectors import Prioritized, Uniform

_DECENTRALIZED = header.MODES.index("decentralized")
_SAMPLE_OP = OPS.index("sample")  # a head's call is number * _SPAN + operation (distributed.calls)
_NO_ERROR = -1.0
_HEAD_COLUMNS = 2 + np.array([MASS, ITEMS, MIN_WEIGHT, INSERTED, SAMPLED], np.int64)  # (serve.sample_head)
_NO_UNIFORMS = np.zeros(0)
_HEAD, _CHOICES, _GATHER = 0, 1, 2  # a record's kernels (SampleRecord.kernels)


def qualifies(replay) -> bool:
    """Whether ``replay``'s decentralized samples can repeat through :func:`sample_again` (see the module
    docstring). Local, O(1)."""
    shard = replay.shard
    st = shard.store
    return (replay.node.board is not None and replay.device is None and isinstance(shard.index, PriorityIndex)
            and type(shard.selector) in (Uniform, Prioritized) and not shard.spec.derived and not st.compressed
            and st.arena is not None and st.arena.kind not in ("file", "mapped") and replay._feeds.idle
            and replay._checkpoints is None)


class SampleRecord:
    """What a repeated sample into ``out`` needs besides the replay's current state (see the module docstring).

    Args:
        replay: the :class:`~gear_mpi.replay.Replay` (not kept: the record lives on it).
        batch: the ``out=`` batch, checked to fit by the full path; None: a fresh record (new batches).
        args: ``(batch_size, window, align, mode)`` as the caller passed them.
        window, code: the checked window and align code.
    """

    __slots__ = ("batch", "fitted", "args", "b", "window", "code", "head", "outs", "got", "row_of_owner",
                 "counts", "peer_ranks", "key_head", "prioritized", "slots", "w", "ratio", "uniforms", "fresh",
                 "table", "kernels")

    def __init__(self, replay, batch, args: tuple, window: int, code: int):
        size = replay.comm.size
        self.fresh = batch is None  # a record of calls into new batches
        self.batch = None if self.fresh else weakref.ref(batch)  # the replay does not keep a batch its caller dropped
        self.fitted, self.args = None if self.fresh else batch._fits, args
        self.b, self.window, self.code = args[0], window, code
        head = np.zeros(WIDTH, np.float64)  # the fixed values of the call's head; the shard's are set per call
        head[0] = _NO_ERROR
        head[2 + BATCH], head[2 + WINDOW], head[2 + ALIGN], head[2 + MODE] = self.b, window, code, _DECENTRALIZED
        self.head = head
        # plain integers: no reference to the batch's arrays (a fresh record's come with each new batch)
        self.outs = None if batch is None else batch.column_addresses().copy()
        self.got = np.empty((self.b, gather_kernels.CHOICE_WIDTH), np.int64)  # the requester's choices, in owner order
        self.row_of_owner = np.zeros(size + 1, np.int64)
        self.counts = np.empty((size, size), np.int64)
        self.table = np.empty((size, WIDTH), np.float64)  # the heads' round's rows (read within the call)
        self.peer_ranks = [r for r, d in enumerate(replay.node.peer_direct.tolist()) if d]  # read in peers' memory
        st = replay.shard.store
        self.key_head = key_head(st.tag, st.rank)
        self.prioritized = type(replay.shard.selector) is Prioritized
        # the owner's scratch (kernels.serve), grown to the largest count served
        self.slots, self.w, self.ratio, self.uniforms = (np.empty(0, np.int64), np.empty(0),
                                                         np.empty(0, np.float32), np.empty(0))
        # the call's three kernels, through their entry points once compiled for its arguments' types (which are the
        # record's arrays, the shard's, the board's, a batch's rows and Python scalars of one kind each)
        self.kernels = KernelCalls(rounds.head_round, rounds.choices_round, gather_kernels.gather_rows_from_owners)

    def same(self, out, batch_size, window, align, mode) -> bool:
        """Whether a call with these arguments may reuse this record (:func:`one_call.repeats
        <gear_mpi.selection.one_call.repeats>`, a Shard's records' test). O(1)."""
        return repeats(self, out, (batch_size, window, align, mode))

    def usable(self, replay) -> bool:
        """Whether the replay still qualifies in what may change between calls: no rate limiter, writers,
        actor ranks or background checkpoints, and the call's mode decentralized. O(1)."""
        feeds = replay._feeds
        return (replay._checkpoints is None and feeds.rate_limiter is None and feeds.intake is None
                and not feeds.inboxes and (self.args[3] or replay.mode) == "decentralized")


KEPT = 8  # records a replay keeps (by out= batch): a batches() ring refills prefetch + 2 batches in turn


def remember(replay, out, batch_size, window, align, mode) -> None:
    """Keep a record of this call on ``replay._repeat`` (by ``id(out)``, the oldest of :data:`KEPT` dropped) for
    the next call into the same ``out`` (``out`` None: the next call into a new batch with these arguments),
    when it qualifies (see the module docstring). Called after a full-path sample returned. Local, O(ranks)."""
    unfitted = out is not None and (out._fits is None or out._meta_np is None)
    if (type(batch_size) is not int or batch_size < 1 or unfitted
            or (replay.mode if mode is None else mode) != "decentralized" or not qualifies(replay)):
        return
    checked, code = check_window(replay.spec, window, align)  # the full path checked them: no error here
    kept = replay._repeat
    kept.pop(id(out), None)
    while len(kept) >= KEPT:
        del kept[next(iter(kept))]
    kept[id(out)] = SampleRecord(replay, out, (batch_size, window, align, mode), checked, code)


def sample_counted(replay, rec: SampleRecord):
    """:func:`sample_again`, counted and guarded as ``Replay.sample``'s decorators count and guard its other calls
    (the replay checked open; ``stats.metered_sample``: the call, its time, its waits, rows and bytes;
    ``calls.interrupt_breaks``: an interrupt once the heads began marks the communicator), without their two
    wrapper layers (a two-rank call of 32 one-step items: 1 us of 21 in a fast hour of the reference VM, 4 of 40 in
    a slow one). Same returns and errors as :func:`sample_again`."""
    activity, calls = replay._activity, replay.calls
    start, waited, batch = time.perf_counter(), activity.comm.waited, None
    before = calls.count
    try:
        replay._check_open()  # (another thread while a batches() iterator owns the replay: raises at once)
        with replay.shard.lock:  # a close() from another thread waits for this call's reads of the shard
            replay.shard._check_open()  # (one that came first has freed them: as Shard.hold checks)
            batch = sample_again(replay, rec)
        return batch
    except BaseException as e:
        if calls.count != before:
            mark_interrupted((calls.comm,), "sample", e)
        raise
    finally:
        activity.count_sample(start, waited, batch)


def sample_again(replay, rec: SampleRecord):
    """The sample ``rec`` recorded, made again: the same collective as the full path of ``Replay.sample``
    (see the module docstring), with the arguments' checks ``rec`` stands for skipped.

    Collective over the node board: one head round (a row written, a counter published, the peers' awaited),
    one round of choices; then the requester's gather kernel. Cost: the full path's, less about the Python
    of its layers.
    Returns:
        ``rec``'s batch, filled (a fresh record's: a new batch).
    Raises:
        as ``Replay.sample``: CollectiveError (another rank in another call, or an earlier failure),
        another rank's argument error, ValueError (ranks asking for different windows, aligns or modes),
        EmptyReplayError, CollectiveTimeoutError.
    """
    comm, node, shard = replay.comm, replay.node, replay.shard
    board, index, st = node.board, shard.index, shard.store
    calls: ReplayCalls = replay.calls
    calls.count += 1
    # the heads' round in one call: the shard's numbers read from its arrays (header.build_row's values) into
    # this rank's head row, the row shared, every rank's read
    n, table = board.begin_round(), rec.table
    args = (rec.head, _HEAD_COLUMNS, float(calls.count * _SPAN + _SAMPLE_OP), index.tree.prefix, index.tree.l2_min,
            st.state, shard.samples_drawn, board.bases, comm.rank, n, table, *board.poll)
    kernels = rec.kernels
    code = kernels.runs[_HEAD](*args)
    if not kernels.found[_HEAD]:
        kernels.settle(_HEAD, args)
    if code != rounds.READ:
        board.end_heads(n, table, code, "sample")
    calls.check(table, None, "sample")
    rows = table[:, 2:].tolist()
    first = rows[0]
    masses = [r[MASS] for r in rows]
    mass = sum(masses)  # in rank order, as plans._mass sums
    asked = [r[BATCH] for r in rows]
    odd, items, wmin = False, 0.0, np.inf  # one loop (generator expressions cost microseconds, caches cold)
    for r in rows:
        odd = odd or r[WINDOW] != first[WINDOW] or r[ALIGN] != first[ALIGN] or r[MODE] != _DECENTRALIZED
        items += r[ITEMS]
        if r[MIN_WEIGHT] < wmin:  # (min over the ranks: no NaN in a head)
            wmin = r[MIN_WEIGHT]
    odd = odd or sum(asked) > 0 and (mass <= 0.0 or items == 0)
    if odd:  # the full path's checks, at the same points of the call: the same errors on every rank
        header.check_mode(table[:, 2:])
    node.epoch += 1  # node.begin_sample()
    node.settled = node.epoch - 1
    try:
        if odd:
            header.check_header(table[:, 2:], True)
        me = comm.rank
        counts = rec.counts
        if len(masses) == 2:  # the same draws as multinomial_rows, in lists (about 3 us less)
            pairs = two_owner_rows(replay.shared_rng, asked, masses[0], mass)
            counts[:] = pairs
            serve = pairs[0][me] + pairs[1][me]
            busiest = max(pairs[0][0] + pairs[1][0], pairs[0][1] + pairs[1][1])
            from_owner = pairs[me]
        else:
            counts[:] = multinomial_rows(replay.shared_rng, np.array(asked, np.int64), np.array(masses) / mass)
            serve = int(counts[:, me].sum())
            busiest = int(counts.sum(0).max())
            from_owner = counts[me].tolist()
        out = Batch.empty(replay.spec, rec.b, rec.window) if rec.fresh else rec.batch()
        if busiest > CHOICE_CAPACITY:  # an owner serves more than its board holds: MPI
            slots = shard.select(serve)
            choices = shard.make_choices(slots, rec.window, rec.code, mass, wmin)
            replay.transport.exchange(choices, np.ascontiguousarray(counts[:, me]), counts[me], rec.window, out=out,
                                      counts=counts)
        else:
            slots = _exchange(rec, replay, out, counts, from_owner, serve, mass, wmin)
        shared = 0  # windows copied from a node peer's memory (a loop: a generator costs ~10 us, caches cold)
        for r in rec.peer_ranks:
            shared += from_owner[r]
        replay._state.windows_shared += shared
        shard.after_sampling(slots)
    finally:
        node.publish()  # this rank's reads of its node peers' memory for this sample are over
    return out


def _exchange(rec: SampleRecord, replay, out, counts: np.ndarray, from_owner: list, serve: int, mass: float,
              wmin: float) -> np.ndarray:
    """The choices' round and the copy: as owner, draw ``serve`` slots on the shard's stream (draws, then
    placements, as ``Shard.select`` + ``Shard.make_choices``) and serve their choices into this rank's board; as
    requester, collect this rank's from every owner and gather its windows (:meth:`WindowTransport.exchange`'s
    node-board path; the time from the collected choices to the filled batch counted as its copy time).
    Returns the slots served."""
    node, comm, shard = replay.node, replay.comm, replay.shard
    board, st = node.board, shard.store
    # (no check_can_sample: an owner serves only with a positive mass in this call's head, read just now)
    if serve > len(rec.slots):  # the scratch grows to the largest count served
        rec.slots, rec.w, rec.ratio = np.empty(serve, np.int64), np.empty(serve), np.empty(serve, np.float32)
        rec.uniforms = np.empty(2 * serve)
    u = rec.uniforms[:serve]
    shard.rng.random(out=u)
    place = _NO_UNIFORMS
    if rec.code == 0:  # random alignment: a placement uniform per window, drawn after the draws'
        place = rec.uniforms[serve:2 * serve]
        shard.rng.random(out=place)
    slots, epoch = rec.slots[:serve], node.epoch
    beta = float(shard.selector.beta) if rec.prioritized else 1.0  # (a float: one compiled kernel)
    args = (shard.index._arrays, u, place, st.start, st.length, st.generation, rec.key_head, SLOT_BITS, GEN_MASK,
            st.capacity, rec.window, rec.code, mass, wmin, rec.prioritized, beta, slots, rec.w, rec.ratio,
            shard.spec.tail_steps, board.bases, comm.rank, counts, epoch, CHOICE_CAPACITY, rec.got, *board.poll)
    kernels = rec.kernels
    code = kernels.runs[_CHOICES](*args)
    if not kernels.found[_CHOICES]:
        kernels.settle(_CHOICES, args)
    if code != rounds.READ:
        board.end_choices(counts, epoch, board.choices[comm.rank], rec.got, code, "sample (choices)")
    transport = replay.transport
    start, waited = time.perf_counter(), comm.waited
    try:
        row_of_owner = rec.row_of_owner  # where each owner's windows begin in the batch (a cumulative sum)
        at = 0
        for o, k in enumerate(from_owner):
            at += k
            row_of_owner[o + 1] = at
        keys, probabilities, weights, lengths = out.meta_numpy()
        outs = rec.outs if rec.outs is not None else out.column_addresses()  # (a fresh record: the new batch's)
        args = (node.column_addrs, st.gather_step_bytes, shard.capacity_steps, node.direct, row_of_owner, rec.got,
                outs, rec.window, out._mask_np, keys, lengths, probabilities, weights)
        kernels.runs[_GATHER](*args)
        if not kernels.found[_GATHER]:
            kernels.settle(_GATHER, args)
    finally:
        transport.copy_seconds += time.perf_counter() - start - (comm.waited - waited)
    return slots
