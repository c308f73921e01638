"""The one-call sample of a :class:`~gear_mpi.shard.Shard` (:func:`~gear_mpi.kernels.local_sample.sample_proportional`),
and its arguments kept for a training loop that samples into the same ``out=`` batch again (issue 34).

A W2-sized step (``Shard.sample(256, 1, out=batch)`` + ``update_priorities``) spent about 25 us of its
180 us in the Python around the kernel: the argument checks, the batch's fit, the shard's hold, the random
draws into a new array, the kernel's argument list (key head, column and batch addresses, scratch) and
numba's dispatch of about 30 arrays. :class:`Repeat` keeps what does not change between two calls into one
batch (a weak reference to it, its column addresses, a buffer for the uniforms), checked once by the full
path, and :func:`sample_again` makes the next call with them: the same kernel, the same random stream (the
uniforms come from the shard's generator as before, into a kept buffer), the same rows bit for bit. From the
second repeat the kernel is called through its compiled entry point with the arguments that do not change kept
together (:class:`PreparedSample`, :mod:`~gear_mpi.kernels.compiled`): numba's typing of 26 arguments was 2.2
of the 8.3 us of Python around a warm one-step sample of 64 items, the rest of the call's Python 4.4 us now.

Local: no communication. Which samples qualify: see :func:`fits`.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..batch import Batch
from ..kernels import bitgen, local_sample, pcg_fill, ring, thread_share
from ..kernels.compiled import entry_point
from ..kernels.priority_draw import DRAW_THREADS_MIN
from ..keys import GEN_MASK, SLOT_BITS, key_head
from .priority_index import PriorityIndex
from .selectors import Prioritized, Uniform

_NO_UNIFORMS = np.zeros(0)
#: from this batch size, placement uniforms that no window reads (see :func:`placement_unread`) are skipped by
#: advancing the generator instead of drawing them (about 3.5 ns a value against 1-2 us for the state check)
SKIP_MIN = 4096


def placement_unread(shard, b: int, window: int, code: int) -> bool:
    """Whether the ``b`` placement uniforms of a random-aligned sample (``code`` 0) need not be drawn: every
    trajectory fits in the window (the spec's ``max_length <= window``), so no placement reads its uniform
    (a window over a trajectory it covers starts at its first step whatever the uniform), and ``b`` is large
    enough to pay for :func:`draw_uniforms`' check. O(1)."""
    return code == 0 and b >= SKIP_MIN and shard.spec.max_length <= window


def kernel_stream(rng, b: int, code: int, skip: bool):
    """The generator words with which the sampling kernel draws this call's ``b`` uniforms itself, on its
    threads (``local_sample._bucket_parallel``): where ``b`` reaches ``SORT_PARALLEL_MIN``, ``rng`` is numpy's
    PCG64 and no placement uniform is read (``code`` not 0, or ``skip``). Returns ``(words, state)`` (the
    ``pcg_fill.STATE_WORDS`` uint64 words and the state dict read, for :func:`end_stream`), or ``(NO_GEN,
    None)``: the caller draws as before. O(1) (a state read, about 1 us)."""
    bg = rng.bit_generator
    if b < local_sample.SORT_PARALLEL_MIN or (code == 0 and not skip) or type(bg) is not np.random.PCG64:
        return local_sample.NO_GEN, None
    state = bg.state
    s, inc = state["state"]["state"], state["state"]["inc"]
    m = pcg_fill.MASK64
    words = np.array([s >> 64, s & m, inc >> 64, inc & m], np.uint64)  # pcg_fill.STATE_WORDS of them
    return words, state


def end_stream(rng, state: dict, n: int) -> None:
    """Set ``rng`` (whose ``state`` :func:`kernel_stream` read) ``n`` values ahead, as drawing them would leave
    it (the buffered 32-bit half as it was). O(log n)."""
    st = state["state"]
    st["state"] = pcg_fill._advanced(st["state"], st["inc"], n)
    rng.bit_generator.state = state


def _clear(state: dict) -> bool:
    return not state["has_uint32"] and not state["uinteger"]


def draw_uniforms(rng, draw_u, b: int, skip: bool, uniforms) -> None:
    """Fill ``uniforms`` from ``rng`` as ``rng.random(out=uniforms)`` does, or, where ``skip`` and the stream
    allows it, only its first ``b`` values (``draw_u``) and advance ``rng`` past the other ``b``: the same
    generator state afterwards (a float64 takes one 64-bit output of PCG64; ``advance`` clears the buffered
    32-bit half and its slot, so it is used only when both are clear, as they are unless 32-bit values were
    drawn). The values skipped are left as they were (the caller's kernel does not read them). O(b).
    """
    bg = rng.bit_generator
    if skip and type(bg) is np.random.PCG64 and _clear(bg.state):
        rng.random(out=draw_u)
        bg.advance(b)
    else:
        rng.random(out=uniforms)


def fits(shard) -> bool:
    """Whether ``shard``'s samples can go through one kernel (:mod:`~gear_mpi.kernels.local_sample`): a host
    index, ``Uniform`` or ``Prioritized`` exactly (their weights are known), no use limit, memory columns
    (not a file or a mapped checkpoint: no hold to take), no derived or compressed columns (neither is in
    the kernel). O(1).

    Args:
        shard: the :class:`~gear_mpi.shard.Shard`.
    Returns:
        True when :func:`sample_one_call` may serve its samples (of any size).
    """
    st = shard.store
    return (isinstance(shard.index, PriorityIndex) and type(shard.selector) in (Uniform, Prioritized)
            and shard.max_times_sampled == 0 and st.arena.kind not in ("file", "mapped")
            and not shard.spec.derived and not st.compressed)


class Repeat:
    """What a sample needs besides the shard's current table and index when it repeats an earlier one-call
    sample's arguments, made by :func:`remember` after the full checks of ``Shard.sample``: the call's
    arguments, a buffer for its uniforms and either (``out=`` given) a weak reference to that batch and its
    column addresses, or (a *fresh* record: no ``out=``) a weak reference to the last batch it returned; and
    a weak reference to that batch's keys array (``keys``), by which ``update_priorities`` knows the keys of
    the sample whose sorted draw the scratch holds (:mod:`~gear_mpi.selection.small_update`), even once the
    batch object is gone. The batch's metadata rows and mask are read from the batch at each reuse (cached
    there), so that the shard holds none of its arrays. A later call whose arguments compare equal
    (:meth:`same`), into the same ``out`` still fitted the same way or again into a new batch, goes through
    :func:`sample_again`.

    Args:
        batch: the ``out=`` batch (host; checked to fit by ``Batch.matches``), or the new batch of a fresh call.
        args: ``(batch_size, window, align, squeeze)`` as the caller passed them (``int`` batch size,
            ``int`` or None window).
        window, code: the checked window and align code.
        fresh: the call made ``batch`` (no ``out=``): later calls with these arguments and no ``out=`` repeat it.
        row_bytes: the bytes a batch row copies (the window's steps of every stored column).
    """

    __slots__ = ("batch", "fitted", "args", "b", "window", "code", "uniforms", "draw_u", "place_u", "outs",
                 "prioritized", "skip", "fresh", "keys", "row_bytes", "call", "update_call")

    def __init__(self, batch, args: tuple, window: int, code: int, prioritized: bool, skip: bool = False,
                 fresh: bool = False, *, row_bytes: int):
        b = args[0]
        self.row_bytes = row_bytes  # bytes a batch row copies (thread_share.caller_alone)
        self.batch = weakref.ref(batch)  # the shard does not keep a batch its caller dropped
        self.keys = weakref.ref(batch._meta_np[0])  # its keys array, alive while anything holds it or its tensor
        self.fitted, self.args, self.fresh = batch._fits, args, fresh
        self.b, self.window, self.code, self.prioritized = b, window, code, prioritized
        u = np.empty(2 * b if code == 0 else b)
        self.uniforms = u
        self.draw_u = u[:b]
        self.place_u = u[b:] if code == 0 else _NO_UNIFORMS
        self.skip = skip  # placement uniforms unread (placement_unread): skipped in the stream
        # nothing of the batch is held but the weak reference and its addresses (plain integers): its arrays and
        # tensors are read from the batch at each reuse (cached there, O(1)), so that the batch's reference
        # counts (Batch.references, batches(recycle="auto")) stay what its holders make them
        self.outs = None if fresh else batch.column_addresses().copy()
        self.call = None  # the sampling kernel's prepared call (prepare_sample), made at the first repeat
        self.update_call = None  # the sampled update's (sampled_update.update_batch)

    def same(self, out, batch_size, window, align, squeeze) -> bool:
        """:func:`repeats` of this record by a call with these arguments. O(1)."""
        return repeats(self, out, (batch_size, window, align, squeeze))


def repeats(record, out, args: tuple) -> bool:
    """Whether a call with ``args`` (batch size, window, then the rest, as ``record.args`` holds them) and ``out``
    may reuse ``record`` (a :class:`Repeat`, or a Replay's ``distributed.repeat.SampleRecord``: its ``args``,
    ``fresh``, ``batch`` and ``fitted``): arguments equal to the recorded ones with the same types (so a ``1.0``
    or a ``True`` still reaches the checks that refuse it), and either no ``out`` for a fresh record, or the same
    ``out`` object, still fitted as it was. O(1)."""
    batch_size, window = args[0], args[1]
    if type(batch_size) is not int or not (window is None or type(window) is int) or args != record.args:
        return False
    if record.fresh:
        return out is None
    return out is not None and out is record.batch() and out._fits is record.fitted


def sample_one_call(shard, batch, b: int, window: int, code: int):
    """Sample ``b`` windows of ``window`` steps (align ``code``) into ``batch`` in one kernel call, with the
    shard's stream: ``2 b`` uniforms (draws, then placements) for random alignment, else ``b``. The
    arguments were checked by the caller (``Shard.sample``) and the shard :func:`fits`. O(B log n) plus the
    copy; on the threads where they pay (:func:`~gear_mpi.kernels.thread_share.caller_alone`).

    Returns:
        ``batch``, filled.
    """
    u = np.empty(2 * b if code == 0 else b)  # the stream of select + make_choices: draws, placements
    skip = placement_unread(shard, b, window, code)
    gen, state = kernel_stream(shard.rng, b, code, skip)
    if state is None:
        draw_uniforms(shard.rng, u[:b], b, skip, u)
    uniforms, place_u = (u[:b], u[b:]) if code == 0 else (u, _NO_UNIFORMS)
    prioritized = type(shard.selector) is Prioritized
    _call_kernel(shard, uniforms, place_u, window, code, prioritized, batch.column_addresses(), batch,
                 b * window * shard.spec.step_bytes, gen)
    if state is not None:
        end_stream(shard.rng, state, u.shape[0])
    shard.samples_drawn += b
    return batch


def _head_args(shard, uniforms, place_u, window: int, code: int, prioritized: bool) -> tuple:
    """The sampling kernel's arguments before the batch's: the index, the uniforms, the table, the key head,
    the window and the columns. O(1)."""
    st = shard.store
    return (shard.index._arrays, uniforms, place_u, st.start, st.length, st.status, key_head(st.tag, st.rank),
            SLOT_BITS, GEN_MASK, st.capacity, window, code, prioritized, shard.column_addresses()[0],
            shard.spec.step_bytes_array)


def _beta(shard, prioritized: bool) -> float:
    """The importance weights' exponent the kernel applies (a float: one compiled kernel, whatever was set)."""
    return float(shard.selector.beta) if prioritized else 1.0


def _call_kernel(shard, uniforms, place_u, window: int, code: int, prioritized: bool, outs, batch, copy_bytes: int,
                 gen) -> None:
    """The sampling kernel over ``shard``'s index, table and columns into ``batch`` (its metadata rows and mask;
    its columns at the addresses ``outs``), on the calling thread alone where the threads would not pay for
    waking (:func:`~gear_mpi.kernels.thread_share.caller_alone`, ``copy_bytes`` the bytes it copies)."""
    keys, probabilities, weights, lengths = batch._meta_np
    b = uniforms.shape[0]
    iscr, fscr = local_sample._scratch(b)
    alone = thread_share.caller_alone(b, DRAW_THREADS_MIN, copy_bytes)
    try:
        local_sample._sample_kernel(*_head_args(shard, uniforms, place_u, window, code, prioritized), outs,
                                    batch._mask_np, keys, lengths, probabilities, weights, iscr, fscr, gen,
                                    shard.spec.max_length == 1, _beta(shard, prioritized))  # one-step: see the kernel
    finally:
        thread_share.give_back(alone)


class PreparedSample:
    """A repeated sample's kernel call with what does not change between calls (:func:`prepare_sample`): the
    compiled entry point (:func:`~gear_mpi.kernels.compiled.entry_point`; the dispatcher where there is none), the
    arguments before the batch's (the shard's index, table and columns, the record's uniform buffers, its window),
    the scratch of the thread it was made on, whose identity tells a call from another thread (or after a sample
    of another size on this one) to make it again, and the shard's generator with the words by which the kernel
    draws from it (:func:`~gear_mpi.kernels.bitgen.generator_words`) and its lock. It holds no array of a batch."""

    __slots__ = ("run", "head", "flat", "one_step", "rng", "words", "lock")

    def __init__(self, run, head: tuple, flat: tuple, one_step: bool, rng):
        self.run, self.head, self.flat, self.one_step = run, head, flat, one_step
        self.rng, self.words, self.lock = rng, bitgen.generator_words(rng), rng.bit_generator.lock


def prepare_sample(shard, rep: "Repeat", out, outs, flat: tuple) -> PreparedSample:
    """The :class:`PreparedSample` of ``rep`` on this thread, whose scratch is ``flat``, its entry point found
    for the types of a call into ``out`` (at ``outs``): the record's arrays are the ones every repeat passes, and
    a batch's rows have the same types in every batch ``Batch.empty`` makes. O(1): about 10 us (the arguments'
    type fingerprints; numba's typing of them, about 0.6 ms, the first time in a process)."""
    head = _head_args(shard, rep.draw_u, rep.place_u, rep.window, rep.code, rep.prioritized)
    one_step = shard.spec.max_length == 1
    keys, probabilities, weights, lengths = out._meta_np
    run = entry_point(local_sample._sample_kernel, head + (outs, out._mask_np, keys, lengths, probabilities, weights,
                                                           flat[0], flat[1], local_sample.NO_GEN, one_step, 1.0))
    return PreparedSample(run if run is not None else local_sample._sample_kernel, head, flat, one_step, shard.rng)


def remember(shard, batch, args: tuple, window: int, code: int, fresh: bool = False) -> None:
    """Keep a :class:`Repeat` of this call on ``shard`` (``shard._repeat``) when the next one with the same
    arguments can skip the checks: an ``int`` batch size of at least 1, and an ``out=`` host batch that fitted
    or (``fresh``) a new batch the call made. O(1).
    """
    b = args[0]
    if type(b) is int and b > 0 and (fresh or (batch._fits is not None and batch._meta_np is not None)):
        shard._repeat = Repeat(batch, args, window, code, type(shard.selector) is Prioritized,
                               placement_unread(shard, b, window, code), fresh,
                               row_bytes=window * shard.spec.step_bytes)


def sample_again(shard, rep: Repeat):
    """:func:`sample_one_call` into ``rep.batch`` (a fresh record: into a new batch, as ``Batch.empty`` makes
    one) with the arguments ``rep`` recorded: the same kernel on the same stream, without the per-call checks
    ``rep`` stands for, through the kernel's entry point (:func:`prepare_sample`, made again for another thread
    or after this thread's scratch was cut for another size). Still checked per call: the shard is open and has
    something to draw. O(B log n) plus the copy (and a new batch's allocation).

    Returns:
        The batch (``out=``: the caller checked with :meth:`Repeat.same` that it is alive: it passed it).
    Raises:
        RuntimeError: the shard is closed.
        EmptyReplayError: nothing to draw.
    """
    st = shard.store
    if st.arena is None:
        raise RuntimeError("this Shard is closed")
    if st.state[ring.LIVE_COUNT] <= 0 or shard.index.tree.prefix[-1] <= 0.0:  # (check_can_sample's test, inline)
        shard.check_can_sample()  # raises, naming which
    b = rep.b
    if rep.fresh:
        out = Batch.empty(shard.spec, b, rep.window, rep.args[3])
        rep.batch = weakref.ref(out)  # the last batch returned, whose keys update_priorities knows
        rep.keys = weakref.ref(out._meta_np[0])
        outs = out.column_addresses()
    else:
        out = rep.batch()
        outs = rep.outs
    rng = shard.rng
    flat = local_sample._scratch(b)
    call = rep.call
    if call is None or call.flat is not flat or call.rng is not rng:  # the first repeat, another thread or size
        call = rep.call = prepare_sample(shard, rep, out, outs, flat)
    lock = None
    if b < local_sample.SORT_PARALLEL_MIN:  # (what kernel_stream answers for them, without asking it)
        state = None
        if rep.skip:
            gen = local_sample.NO_GEN
            draw_uniforms(rng, rep.draw_u, b, True, rep.uniforms)
        else:  # drawn by the kernel as rng.random(out=rep.uniforms) draws them, under the generator's lock
            gen, lock = call.words, call.lock
    else:
        gen, state = kernel_stream(rng, b, rep.code, rep.skip)
        if state is None:
            draw_uniforms(rng, rep.draw_u, b, rep.skip, rep.uniforms)
    keys, probabilities, weights, lengths = out._meta_np
    tail = (outs, out._mask_np, keys, lengths, probabilities, weights, flat[0], flat[1], gen, call.one_step,
            _beta(shard, rep.prioritized))
    alone = thread_share.caller_alone(b, DRAW_THREADS_MIN, b * rep.row_bytes)
    try:
        if lock is None:
            call.run(*call.head, *tail)
        else:
            with lock:  # held while the kernel draws, as Generator.random holds it
                call.run(*call.head, *tail)
    finally:
        thread_share.give_back(alone)
    if state is not None:
        end_stream(shard.rng, state, rep.uniforms.shape[0])
    shard.samples_drawn += b
    return out
