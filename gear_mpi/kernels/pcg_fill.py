"""numpy's ``Generator(PCG64).random`` on the threads: the same doubles, the same stream (CPU kernels; issue 34).

A W3 sample (65,536 draws) spent about 0.2 ms of its 6 ms drawing its uniforms from the shard's generator on
one thread while the other waited. PCG64 (numpy's, XSL-RR 128/64) is a 128-bit linear congruential generator:
step ``s = s * M + inc`` (mod 2**128), output ``rotr64(hi(s) ^ lo(s), hi(s) >> 58)``; a double is the output's
top 53 bits times 2**-53 (numpy's ``next_double``). The state ``d`` steps ahead is one affine map, computed in
O(log d) 128-bit products (:func:`_jump`), so each thread starts its slice of the values where the serial
generator would be and draws it on its own. :func:`fill` reads the generator's state, fills, and sets the
state ``n`` steps ahead: the same values and the same state afterwards as ``rng.random(out=out)``, bit for bit
(the buffered 32-bit half, which doubles never use, kept as it was).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

MULT_HI = np.uint64(0x2360ED051FC65DA4)  # PCG's default 128-bit multiplier
MULT_LO = np.uint64(0x4385DF649FCCF645)
MASK64 = (1 << 64) - 1
#: a PCG64 stream as a kernel takes it: four uint64 words, the state and the increment, each (high, low)
STATE_WORDS = 4
#: values per slice a thread draws (a parallel region below two slices costs more than it saves)
SLICE = 1 << 13


@intrinsic
def _mul_add(typingctx, ahi, alo, bhi, blo, chi, clo):
    """``(a * b + c) mod 2**128`` of 128-bit numbers given as (high, low) uint64 halves: (high, low)."""
    u64 = types.uint64
    sig = types.UniTuple(u64, 2)(u64, u64, u64, u64, u64, u64)

    def codegen(context, builder, signature, args):
        i128 = ir.IntType(128)
        i64 = ir.IntType(64)

        def join(hi, lo):
            return builder.or_(builder.shl(builder.zext(hi, i128), ir.Constant(i128, 64)), builder.zext(lo, i128))

        r = builder.add(builder.mul(join(args[0], args[1]), join(args[2], args[3])), join(args[4], args[5]))
        hi = builder.trunc(builder.lshr(r, ir.Constant(i128, 64)), i64)
        lo = builder.trunc(r, i64)
        return context.make_tuple(builder, signature.return_type, [hi, lo])

    return sig, codegen


@njit(cache=True, inline="always")
def _jump(shi, slo, ihi, ilo, d):
    """The state ``d`` steps after ``(shi, slo)`` with increment ``(ihi, ilo)``: (high, low). O(log d)."""
    one = np.uint64(1)
    zero = np.uint64(0)
    amh, aml = zero, one  # the map so far: s -> am * s + ap
    aph, apl = zero, zero
    cmh, cml = MULT_HI, MULT_LO  # the map of 2**k steps
    cph, cpl = ihi, ilo
    while d > 0:
        if d & 1:
            amh, aml = _mul_add(amh, aml, cmh, cml, zero, zero)
            aph, apl = _mul_add(aph, apl, cmh, cml, cph, cpl)
        # the map twice: m' = m * m, p' = (m + 1) * p
        m1h, m1l = _mul_add(cmh, cml, zero, one, zero, one)
        cph, cpl = _mul_add(m1h, m1l, cph, cpl, zero, zero)
        cmh, cml = _mul_add(cmh, cml, cmh, cml, zero, zero)
        d >>= 1
    return _mul_add(amh, aml, shi, slo, aph, apl)


@njit(cache=True, inline="always")
def _output(shi, slo):
    """numpy's ``next_double`` of the PCG64 state ``(shi, slo)`` (just stepped): XSL-RR, top 53 bits."""
    x = shi ^ slo
    rot = shi >> np.uint64(58)
    v = (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))
    return np.float64(v >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, inline="always")
def _draw_slice(shi, slo, ihi, ilo, out, lo, hi):
    """``out[lo:hi]`` from the state before value ``lo``, as four interleaved quarters (each from its own
    jumped state: four independent chains of 128-bit products in flight instead of one)."""
    q = (hi - lo) // 4
    ah, al = shi, slo
    bh, bl = _jump(shi, slo, ihi, ilo, q)
    ch, cl = _jump(shi, slo, ihi, ilo, 2 * q)
    dh, dl = _jump(shi, slo, ihi, ilo, 3 * q)
    for i in range(lo, lo + q):
        ah, al = _mul_add(ah, al, MULT_HI, MULT_LO, ihi, ilo)
        bh, bl = _mul_add(bh, bl, MULT_HI, MULT_LO, ihi, ilo)
        ch, cl = _mul_add(ch, cl, MULT_HI, MULT_LO, ihi, ilo)
        dh, dl = _mul_add(dh, dl, MULT_HI, MULT_LO, ihi, ilo)
        out[i] = _output(ah, al)
        out[i + q] = _output(bh, bl)
        out[i + 2 * q] = _output(ch, cl)
        out[i + 3 * q] = _output(dh, dl)
    for i in range(lo + 4 * q, hi):  # the last few, after the fourth quarter
        dh, dl = _mul_add(dh, dl, MULT_HI, MULT_LO, ihi, ilo)
        out[i] = _output(dh, dl)


@njit(cache=True, parallel=True, nogil=True)
def _fill(shi, slo, ihi, ilo, out, slices):
    n = out.shape[0]
    for t in prange(slices):
        lo = t * n // slices
        h, l = _jump(shi, slo, ihi, ilo, lo)
        _draw_slice(h, l, ihi, ilo, out, lo, (t + 1) * n // slices)


def fill(rng: np.random.Generator, out: np.ndarray, skip: int = 0) -> bool:
    """``rng.random(out=out)`` on the threads, then ``skip`` more values stepped over (as drawing them would),
    when ``rng`` draws from numpy's ``PCG64`` and ``out`` (float64, contiguous) holds at least ``2 * SLICE``
    values; else nothing is done.

    Args:
        rng: the generator (its state is read, and set ``len(out) + skip`` steps ahead).
        out: the float64 row to fill.
        skip: values to step over after ``out``'s.
    Returns:
        Whether ``out`` was filled (False: the caller draws as before).
    Cost: O(n / threads + log n) plus two state conversions (a few microseconds). Local; no collective.
    """
    n = out.shape[0]
    bg = rng.bit_generator
    if n < 2 * SLICE or type(bg) is not np.random.PCG64:
        return False
    state = bg.state
    s, inc = state["state"]["state"], state["state"]["inc"]
    shi, slo, ihi, ilo = (np.uint64(s >> 64), np.uint64(s & MASK64), np.uint64(inc >> 64), np.uint64(inc & MASK64))
    _fill(shi, slo, ihi, ilo, out, max(2, min(64, n // SLICE)))
    state["state"]["state"] = _advanced(s, inc, n + skip)
    bg.state = state
    return True


def _advanced(s: int, inc: int, d: int) -> int:
    """The PCG64 state ``d`` steps after ``s`` (Python integers; O(log d))."""
    m = (int(MULT_HI) << 64) | int(MULT_LO)
    am, ap, cm, cp = 1, 0, m, inc
    mod = (1 << 128) - 1
    while d:
        if d & 1:
            am, ap = (am * cm) & mod, (ap * cm + cp) & mod
        cp, cm = ((cm + 1) * cp) & mod, (cm * cm) & mod
        d >>= 1
    return (am * s + ap) & mod
