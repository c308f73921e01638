"""A kernel's compiled entry point, for a call made again with arguments of the same types (issue 34).

Calling a numba kernel through its dispatcher types every argument first (about 85 ns an argument here, a
tuple's items each), looks the types up among the compiled overloads, then calls that overload's entry point,
which unboxes the arguments. A training loop that samples into the same batch and updates its priorities makes
the same call with the same arrays thousands of times: the sampling kernel takes 26 arguments, the update 19,
and the dispatcher's typing was 2.2 of the 8.3 us of Python in a warm one-step sample of 64 items, and more
with the caches cold after a batch's copy. :func:`entry_point` finds that overload once, so that the caller can
call it directly.

The caller vouches that later calls pass arguments of exactly the types the entry was found for: an entry
point unboxes what it is given as its own signature says, with no check, so an array of another dtype or
layout would be misread. Callers keep an entry only with the objects whose types fix it (the shard's table
and index arrays, a thread's scratch, a batch's rows) and find it again when any of them changes. Where numba
does not compile (``NUMBA_DISABLE_JIT``) there is no entry point, and callers use the dispatcher as before.
"""
from __future__ import annotations

from typing import Any, Callable

try:  # numba's own fingerprint of an argument's type, the key of its dispatcher's fast path (C, about 0.2 us)
    from numba._dispatcher import compute_fingerprint as _fingerprint
except ImportError:  # pragma: no cover - a numba without it: nothing is called directly
    _fingerprint = None


#: entry points found, by kernel and the fingerprints of the arguments' types: a record made again (another
#: thread, another batch size, a call with other arguments between) finds its entry without numba's typing
_FOUND: dict = {}


def entry_point(kernel: Any, args: tuple) -> Callable | None:
    """The compiled entry point of ``kernel``'s overload for the types of ``args``.

    Args:
        kernel: a numba dispatcher (an ``njit`` function) already called once with arguments of these types
            (so the overload is compiled or loaded from numba's cache).
        args: the arguments of such a call, positionally, every parameter given.
    Returns:
        A callable taking the same positional arguments, or None: ``kernel`` is not a dispatcher (numba's JIT
        disabled), or it has no overload for exactly these types. Cost: the fingerprints of the arguments' types
        (about 0.3 us an argument), and the first time for these types numba's typing of them in Python (about
        25 us an argument); local.
    """
    overloads = getattr(kernel, "overloads", None)
    typeof = getattr(kernel, "typeof_pyval", None)
    if overloads is None or typeof is None:
        return None
    prints = tuple(type_fingerprint(a) for a in args)  # (about 8 us for the sampling kernel's 26 arguments)
    key = (kernel, prints) if None not in prints else None
    found = _FOUND.get(key) if key is not None else None
    if found is not None:
        return found
    try:  # numba's typing of each argument in Python: about 0.6 ms for the same 26
        compiled = overloads.get(tuple(typeof(a) for a in args))
    except Exception:  # an argument numba cannot type: the dispatcher would refuse it as well
        return None
    run = getattr(compiled, "entry_point", None)
    if run is not None and key is not None:
        _FOUND[key] = run
    return run


def type_fingerprint(value: Any) -> bytes | None:
    """numba's fingerprint of ``value``'s argument type: equal fingerprints, equal types (an array's dtype,
    dimensions, layout and writability; numba types no other property of an array). For a caller that passes an
    array it did not make to an entry point: it compares this with the fingerprint of the array the entry was
    found for.

    Args:
        value: an argument (an array, a scalar).
    Returns:
        The fingerprint, or None where numba has none for it (then the caller must use the dispatcher).
        Cost: O(1), about 0.2 us.
    """
    if _fingerprint is None:
        return None
    try:
        return _fingerprint(value)
    except Exception:  # a value without a fast fingerprint (numba types it the slow way)
        return None


class KernelCalls:
    """The kernels a repeated call makes, each called through its dispatcher the first time and through its
    entry point from then on (:func:`entry_point`). For a caller whose arguments keep their types from call to
    call (its own arrays and Python scalars of one kind): it calls ``runs[i](*args)`` then, while ``found[i]`` is
    False, :meth:`settle` with the same arguments.

    Args:
        kernels: the dispatchers, in the caller's order.
    """

    __slots__ = ("runs", "found")

    def __init__(self, *kernels: Any):
        self.runs = list(kernels)
        self.found = [False] * len(kernels)

    def settle(self, i: int, args: tuple) -> None:
        """After kernel ``i``'s call with ``args`` (compiled for their types now): its entry point from now on,
        or its dispatcher where it has none. O(1): the arguments' type fingerprints (:func:`entry_point`; numba's
        typing in Python too, the first time this process meets their types)."""
        if not self.found[i]:
            self.found[i] = True
            self.runs[i] = entry_point(self.runs[i], args) or self.runs[i]
