"""The compile options of serial CPU kernels whose loops call inlined helpers on arrays.

numba's plain (``parallel=False``) pipeline keeps the reference counting of the arrays that an inlined
helper (``inline="always"``) receives inside the caller's loop: an atomic increment and decrement per
array per call. Its parallel pipeline, with every parallel transformation turned off (:data:`SERIAL`),
compiles the same code without them: no parallel region, no thread, no warning, the same results. The
update of a sampled batch's loop (``priority_sampled``), N = 1e6, one thread, B = 8192: 476 us compiled the
plain way, 226 us with :data:`SERIAL` (its write pass alone; docs/BENCHMARKS.md, "The draw inside the
copy's region"). Use: ``@njit(cache=True, nogil=True, parallel=SERIAL)``.

numba warns at each such compile that ``parallel=True`` found nothing to run in parallel (a
``NumbaPerformanceWarning``); importing this module ignores that warning for gear_mpi's own functions only
(its text names the function's file), so that a user's own kernels still get it.
"""
from __future__ import annotations

import warnings

from numba.core.errors import NumbaPerformanceWarning

#: numba's ``parallel=`` options with every transformation off: the parallel pipeline's compile of serial code
SERIAL = {"comprehension": False, "reduction": False, "inplace_binop": False, "setitem": False, "numpy": False,
          "stencil": False, "fusion": False, "prange": False}

warnings.filterwarnings("ignore", message=r"(?s).*no transformation for parallel execution was possible.*"
                        r"gear_mpi[/\\](kernels|selection|storage)[/\\]", category=NumbaPerformanceWarning)
