"""Which partitions of a partitioned dock a get should ask last: those its last take found drained.

A sampled get of a partitioned dock takes from one partition at a time (``partitioned_gets.py``). Once a
partition has handed out every group that qualifies for a consumer (a FIFO pipeline drains them one after the
other), a take there finds nothing and is still a script call on that partition's primary: at 24 partitions of
~11 groups, gets of 16 groups made more empty takes than takes that found rows. The sampling script says, with
its pick, how many units still qualify there (lua/sample.lua's ``left``); a partition with none left is marked
here, for that consumer and those columns, and the gets that follow ask it last.

A mark only reorders: a partition marked is still asked whenever the others fall short, so a get never returns
``(None, None)`` or waits because of a mark (what each interleaving relies on: ``partitioned_gets.py``). A mark
ends when this object puts into the partition or gives rows back to it, and at the latest ``seconds`` after it
was made (another process's put, give-back or an expired lease refills it without telling this object): a
partition with rows again is asked in its turn after at most that long, as a reader misses a lost put wake-up for
at most as long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

__all__ = ["DRAINED_SECONDS", "Drained", "DrainKey"]

#: Longest a partition found drained is asked after the others without this object seeing it refilled: as long as
#: a lost put wake-up delays a reader (the re-check of ``PutListener.wait``'s callers).
DRAINED_SECONDS = 1.0

#: What a mark is for: the consumer, group mode or not, and the columns asked for (what qualifies depends on all).
DrainKey = tuple[str, bool, tuple[str, ...]]


class Drained:
    """Partitions found drained, per ``DrainKey``, each until a deadline (see the module docstring)."""

    def __init__(self, seconds: float):
        self._seconds = seconds
        self._until: dict[DrainKey, dict[int, float]] = {}
        self._lock = threading.Lock()  # threads share a dock object; a race would only reorder, but dicts resize

    @staticmethod
    def key(consumer: str, groups: bool, columns: Sequence[str]) -> DrainKey:
        return consumer, groups, tuple(sorted(columns))

    def order(self, key: DrainKey, partitions: Sequence[int]) -> list[int]:
        """``partitions`` (a get's order) with those marked drained for ``key`` moved last, each part in order."""
        now = time.monotonic()
        with self._lock:
            marks = self._until.get(key)
            if not marks:
                return list(partitions)
            for p in [p for p, until in marks.items() if until <= now]:
                del marks[p]
            if not marks:
                return list(partitions)
            return [p for p in partitions if p not in marks] + [p for p in partitions if p in marks]

    def saw(self, key: DrainKey, partition: int, left: int) -> None:
        """A take of ``partition`` for ``key`` left ``left`` units qualifying there (0: it found nothing)."""
        with self._lock:
            if left > 0:
                marks = self._until.get(key)
                if marks:
                    marks.pop(partition, None)
            else:
                self._until.setdefault(key, {})[partition] = time.monotonic() + self._seconds

    def refilled(self, partitions: Iterable[int] | None = None, columns: Iterable[str] | None = None) -> None:
        """This object may have made rows qualify again in ``partitions`` (None: in any): forget their marks;
        with ``columns`` (a put's), only the marks of keys asking for one of them: a put readies only the rows'
        cells of its columns, so rows that did not qualify for a consumer asking none of them still do not (a
        pipeline stage's put of its results into the partition it just drained does not undo the mark)."""
        written = None if columns is None else set(columns)
        with self._lock:
            if partitions is None and written is None:
                self._until.clear()
                return
            for key, marks in self._until.items():
                if written is not None and written.isdisjoint(key[2]):
                    continue
                for p in list(marks) if partitions is None else set(partitions) & marks.keys():
                    del marks[p]

    def marked(self, key: DrainKey) -> set[int]:
        """The partitions marked drained for ``key`` now (for tests and inspection)."""
        now = time.monotonic()
        with self._lock:
            return {p for p, until in self._until.get(key, {}).items() if until > now}
