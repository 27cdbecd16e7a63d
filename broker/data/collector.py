"""Python's cyclic garbage collector paused for the time of a large put.

A put of many rows makes a few objects per encoded value (a ``Framed`` row, the view of its tensor, its
pieces; the commands framed around them), and keeps them until its last slice is sent: 30,000 of them for
TransferQueue's benchmark batch (1,024 rows x 10 columns). They are acyclic and freed by reference counting
when the put returns, but the collector sees them alive in its young generations meanwhile, promotes them,
and counts them towards its next full pass, which walks every object of the process: 0.1-0.2 s in a
process holding torch (more in a Ray actor), landing in nearly every large put (``broker bench --large``,
docs/benchmark.md). Paused for the put, the collector never sees them: they are gone before it runs again,
and no full pass is owed to them. Cyclic garbage other threads make meanwhile waits for the put to end.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Encoded values (rows x columns) from which a put pauses the collector; below it, a put's objects are few.
LARGE_PUT_VALUES = 4096

_lock = threading.Lock()
_pauses = 0  # puts running with the collector paused, in every thread
_resume = False  # whether the first of them found it enabled (and so the last enables it again)


@contextmanager
def paused(values: int) -> Iterator[None]:
    """The block with automatic collection off if ``values`` (the put's rows x columns) is at least
    ``LARGE_PUT_VALUES``; puts in several threads at once share one pause, and a collector the process had
    disabled itself stays disabled."""
    if values < LARGE_PUT_VALUES:
        yield
        return
    global _pauses, _resume
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
