"""Memory hints for the CPU kernels: software prefetch; ordered stores for flags that other
processes read; an atomic counter that hands out work to threads as they arrive; a flag that one
thread raises and the others of a parallel region wait for (release / acquire).

Batched draws, updates and window copies touch memory at random: cache misses
that, issued one after another, cost a DRAM latency each. Asking for the next
ones while the current one is served lets the memory system overlap them.
Scratch rows that a kernel walks side by side are staggered (:func:`staggered_rows`) so
that entry ``k`` of each row falls in a different cache set.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


def _emit_prefetch(builder, ptr):
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the CPU to load the cache line of ``arr[idx]`` (``llvm.prefetch``: no fault, no effect on results).

    The address follows the array's stride (a broadcast row, stride 0, asks for its one line), so a
    non-contiguous 1-D array never sends the hint to memory outside it."""
    sig = types.void(arr, types.intp)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        a = context.make_array(aty)(context, builder, args[0])
        if aty.layout in "CF" or aty.ndim != 1:
            ptr = builder.gep(a.data, [args[1]])
        else:
            strides = cgutils.unpack_tuple(builder, a.strides, 1)
            ptr = cgutils.pointer_add(builder, a.data, builder.mul(args[1], strides[0]))
        _emit_prefetch(builder, builder.bitcast(ptr, cgutils.voidptr_t))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_address(typingctx, addr):
    """Hint the CPU to load the cache line at address ``addr`` (an int64; never faults)."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        _emit_prefetch(builder, builder.inttoptr(args[0], cgutils.voidptr_t))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fence(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


def _add_one(ordering: str):
    """The codegen of ``a[0] += 1`` as one atomic step of the given LLVM ``ordering`` on an int64 array ``a``,
    returning the value before."""
    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", a.data, ir.Constant(ir.IntType(64), 1), ordering)

    return codegen


@njit(cache=True, inline="always")
def counters(n):
    """``n`` int64 zeros for :func:`take_next`, :func:`raise_flag` and :func:`wait_flag` (slice one per
    counter: ``c[0:1]``), made by a plain loop: ``np.zeros`` in a parallel kernel is a parallel region of its
    own (numba makes it a parfor), one more wake-up of sleeping workers. O(n)."""
    c = np.empty(n, np.int64)
    for j in range(n):
        c[j] = 0
    return c


@intrinsic
def take_next(typingctx, counter):
    """``counter[0] += 1`` as one atomic step, returning the value before (an int64 array; monotonic order:
    it hands out indices, it orders no other memory). A parallel region over ``n`` lanes that each loop
    ``while (t := take_next(c)) < n`` shares ``n`` tasks among its threads as they arrive: the first
    lane a thread runs takes tasks until none is left, so a thread woken late takes what remains instead
    of a fixed share that the others wait for."""
    return types.int64(counter), _add_one("monotonic")


@intrinsic
def raise_flag(typingctx, flag):
    """``flag[0] += 1`` as one atomic step with release order (an int64 array): a thread that then reads
    the new value with :func:`flag_value` sees every store this thread made before. Returns the value before."""
    return types.int64(flag), _add_one("release")


@intrinsic
def flag_value(typingctx, flag):
    """``flag[0]`` read with acquire order (an int64 array): after it, this thread sees every store made
    before the :func:`raise_flag` that wrote the value read. The read is not hoisted out of a loop."""
    sig = types.int64(flag)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(a.data, "acquire", 8)

    return sig, codegen


#: the processor's spin-wait hint, where there is one: x86's ``pause``, Arm's ``yield`` (a waiting thread then
#: leaves its core's shared units to a sibling hyperthread, and a wait costs less power); elsewhere none
_SPIN_HINT = {"x86_64": "x86", "amd64": "x86", "i686": "x86", "i386": "x86", "aarch64": "arm",
              "arm64": "arm"}.get(platform.machine().lower())


@intrinsic
def spin_pause(typingctx):
    """The processor's spin-wait hint (:data:`_SPIN_HINT`; nothing where it has none). No effect on results."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _SPIN_HINT == "x86":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        elif _SPIN_HINT == "arm":
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i32]),
                                                "llvm.aarch64.hint")
            builder.call(fn, [i32(1)])  # YIELD
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cycle_count(typingctx):
    """The processor's cycle counter (``llvm.readcyclecounter``: x86's time-stamp counter; a fixed-rate counter
    on Arm; 0 where there is none), for bounding a wait, never for a result."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return sig, codegen


#: how long a thread of a parallel region waits for a flag (:func:`wait_flag`) before it leaves the work to the
#: thread that raises it: at most WAIT_SPINS reads, a pause between two (0.2-3 ms), and about WAIT_CYCLES of the
#: cycle counter (65-130 us at 2-4 GHz): past the serial work the kernels wait for (a draw of fewer than
#: ``priority_draw.DRAW_THREADS_MIN`` items, a slice of an update's checks: tens of microseconds), and short
#: where the OS preempted the thread that raises it (more threads than cores)
WAIT_SPINS = 1 << 16
WAIT_CYCLES = 1 << 18


@njit(cache=True, inline="always")
def wait_flag(flag, spins, cycles, target=1):
    """Wait until ``flag[0]`` reaches ``target`` (by default: is raised once), with the spin-wait hint between
    reads, at most ``spins`` reads and about ``cycles`` of the cycle counter (checked every 64 reads; a counter
    that does not move leaves the bound to ``spins``): True when it did, False when the wait gave up (the
    caller then leaves the work to the thread that raises it last)."""
    t0 = cycle_count()
    for i in range(spins):
        if flag_value(flag) >= target:
            return True
        spin_pause()
        if (i & 63) == 63 and cycle_count() - t0 > cycles:
            return False
    return False


@intrinsic
def address_pointer(typingctx, addr):
    """The address ``addr`` (an int64) as a ``void *`` for ``numba.carray``: an array over memory the caller keeps
    mapped (another process's shared segment). No check: the caller vouches for the address and the extent."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def load_u32_acquire(typingctx, addr):
    """The 32-bit unsigned word at address ``addr`` (an int64), read with acquire order (as an int64): after it this
    thread sees what the writer stored before it stored the value read (:func:`store_u32_release`). Never hoisted
    out of a loop, so a poll of another process's counter sees it move."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.zext(builder.load_atomic(ptr, "acquire", 4), ir.IntType(64))

    return sig, codegen


@intrinsic
def store_u32_release(typingctx, addr, value):
    """Store the low 32 bits of ``value`` at address ``addr`` (int64s) with release order: a reader that sees the
    value (:func:`load_u32_acquire`) sees every store this thread made before."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.store_atomic(builder.trunc(args[1], ir.IntType(32)), ptr, "release", 4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def publish(flag, value):
    """``flag[0] = value`` after every earlier load and store of this process (a full fence first):
    a reader in another process that sees ``value`` sees all that came before it."""
    _fence()
    flag[0] = value


@njit(cache=True, nogil=True)
def fence():
    """A full memory fence: nothing after it is done before everything before it."""
    _fence()


#: entries (8 bytes each) between staggered rows: 9 cache lines, so rows of a power-of-two length do not start at
#: one offset modulo 4 KiB (entry ``k`` of 8 such rows would share one L1 set, and one L2 set)
ROW_GAP = 72


def staggered_flat(rows: int, size: int, dtype=np.int64) -> np.ndarray:
    """The one allocation of :func:`staggered_rows`: ``rows * (size + ROW_GAP)`` entries of an 8-byte ``dtype``,
    row ``r`` being entries ``r * (size + ROW_GAP)`` onwards (a kernel given the flat array slices its rows
    itself: one argument for numba's dispatcher to type instead of a tuple of rows, about 65 ns a row).
    Uninitialised. O(1) (pages are committed when first written)."""
    if np.dtype(dtype).itemsize != 8:
        raise ValueError(f"staggered rows take an 8-byte dtype, got {np.dtype(dtype)}")
    return np.empty(rows * (size + ROW_GAP), dtype)


def staggered_rows(rows: int, size: int, dtype=np.int64) -> np.ndarray:
    """``rows`` rows of ``size`` entries of an 8-byte ``dtype`` in one allocation, row ``r`` starting
    ``r * (size + ROW_GAP)`` entries in, so that entry ``k`` of different rows lies in different cache sets
    (a kernel that walks several rows at once keeps them all in cache). Returns a ``[rows, size]`` view,
    C-contiguous rows, uninitialised. O(1) (pages are committed when first written)."""
    raw = staggered_flat(rows, size, dtype)
    return np.lib.stride_tricks.as_strided(raw, (rows, size), ((size + ROW_GAP) * 8, 8), writeable=True)
