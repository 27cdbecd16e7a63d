"""The rows a leased ``get_experience`` returns: a list of row indexes that also names its lease."""

from __future__ import annotations


class LeasedRows(list[int]):
    """Row indexes handed out under a lease, with the lease's ``token`` and ``consumer``.

    It is a plain list in every other way (compares, indexes, pickles and crosses Ray as one), so
    MindSpeed-style code keeps working; ``dock.ack(consumer, rows)`` reads the token from it. The token
    identifies this one delivery, like an SQS receipt handle: once the lease expired and the rows went
    to another call, or a clear made way for new rows, an ack naming it releases nothing. Slicing gives
    a plain list; ack part of a delivery with ``dock.ack(consumer, part, token=rows.token)``.
    """

    __slots__ = ("token", "consumer")

    def __init__(self, rows: list[int], token: str, consumer: str):
        super().__init__(rows)
        self.token = token
        self.consumer = consumer

    def __reduce__(self) -> tuple[type[LeasedRows], tuple[list[int], str, str]]:  # list's would drop the slots
        return LeasedRows, (list(self), self.token, self.consumer)

    def __repr__(self) -> str:
        return f"LeasedRows({list(self)!r}, token={self.token!r}, consumer={self.consumer!r})"


def like(rows: list[int], new_rows: list[int]) -> list[int]:
    """``new_rows`` (a reordering or padding of ``rows``) under the same lease as ``rows``, if it had one."""
    return LeasedRows(new_rows, rows.token, rows.consumer) if isinstance(rows, LeasedRows) else new_rows
