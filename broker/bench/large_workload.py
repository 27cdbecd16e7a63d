"""The large-batch workload of ``broker bench --large``: TransferQueue's published benchmark batch.

``scripts/performance_test/perftest.py`` in the ``transferqueue`` 0.1.11 wheel puts ``fields`` float32
columns of shape (batch, seq_len) (default 1024 x 10 x 8192 = 0.3125 GiB) from a writer to a reader.
Its ``--use_complex_case`` makes a third of the columns ragged (row j is ``1 + j * (seq_len - 1) /
(batch - 1)`` long, rounded: an arithmetic progression from 1 to seq_len) and a third strings (each
the hex of ``seq_len * 2`` random bytes, so as many characters as a full row has bytes); the rest, the
first ``(fields + 2) // 3`` and any left over, stay regular. This module builds the same batch,
seeded, as plain Python values (a stacked tensor, a list of 1-D tensors, a list of str per column)
and checksums what a reader got back.

It imports nothing of the broker, only torch: the TransferQueue child (``large_tq.py``) runs it in
an interpreter that may not have the broker installed.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: A column's kind: one stacked tensor, ragged rows (1-D tensors), or strings.
REGULAR, RAGGED, STRING = "regular", "ragged", "string"

#: perftest reports sizes in GiB; so does the large mode, so its GB/s compare with TransferQueue's.
GIB = 1 << 30


@dataclass(frozen=True)
class LargeWorkload:
    """``batch`` rows of ``fields`` columns of up to ``seq_len`` float32 values (or characters)."""

    batch: int = 1024
    fields: int = 10
    seq_len: int = 8192
    complex: bool = False
    seed: int = 0

    def columns(self) -> list[tuple[str, str]]:
        """``(name, kind)`` of every column, named as perftest names them."""
        if not self.complex:
            return [(f"field_{i}", REGULAR) for i in range(self.fields)]
        regular = ragged = (self.fields + 2) // 3
        strings = self.fields - regular - ragged
        return ([(f"field_{i}", REGULAR) for i in range(regular)]
                + [(f"nested_field_{i}", RAGGED) for i in range(ragged)]
                + [(f"nontensor_field_{i}", STRING) for i in range(strings)])

    def names(self) -> list[str]:
        return [name for name, _ in self.columns()]

    def kinds(self) -> dict[str, str]:
        return dict(self.columns())

    def ragged_lengths(self) -> list[int]:
        """perftest's row lengths of a ragged column: 1 to seq_len in equal steps."""
        step = (self.seq_len - 1) / (self.batch - 1) if self.batch > 1 else 0
        return [max(1, min(int(round(1 + j * step)), self.seq_len)) for j in range(self.batch)]

    def payload_bytes(self) -> int:
        """Bytes of tensor data and string characters in the batch (what GB/s is counted on)."""
        per_kind = {REGULAR: self.batch * self.seq_len * 4, RAGGED: sum(self.ragged_lengths()) * 4,
                    STRING: self.batch * self.seq_len * 4}
        return sum(per_kind[kind] for _, kind in self.columns())

    def label(self) -> str:
        return "complex" if self.complex else "plain"


def make_batch(w: LargeWorkload) -> dict[str, Any]:
    """The batch: a (batch, seq_len) float32 tensor per regular column, a list of 1-D float32 tensors per
    ragged column, a list of str per string column."""
    gen = torch.Generator().manual_seed(w.seed)
    rng = random.Random(w.seed)
    lengths = w.ragged_lengths()
    out: dict[str, Any] = {}
    for name, kind in w.columns():
        if kind == REGULAR:
            out[name] = torch.randn(w.batch, w.seq_len, dtype=torch.float32, generator=gen)
        elif kind == RAGGED:
            flat = torch.randn(sum(lengths), dtype=torch.float32, generator=gen)
            out[name] = list(torch.split(flat, lengths))
        else:
            out[name] = [rng.randbytes(w.seq_len * 2).hex() for _ in range(w.batch)]
    return out


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's storage as bytes, without a copy."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _row_bytes(value: Any) -> Iterable[bytes | memoryview]:
    """The bytes of a column's rows, in row order, whatever shape a system hands them back in."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            # A jagged nested tensor's values are its rows back to back: the same bytes in the same order.
            yield as_bytes(value.values().contiguous())
        else:
            yield as_bytes(value.contiguous())
        return
    for row in value:
        if isinstance(row, str):
            yield row.encode()
        elif isinstance(row, torch.Tensor):
            yield as_bytes(row.contiguous())
        elif isinstance(row, bytes | bytearray | memoryview):
            yield memoryview(row)
        else:
            raise TypeError(f"a row of type {type(row).__name__} cannot be checksummed")


def checksum(batch: dict[str, Any], names: Sequence[str]) -> dict[str, int]:
    """CRC-32 of each column's bytes in row order: equal for a stacked tensor and for its rows one by one
    (CRC-32 chains over concatenated input), so every system's reply can be checked against the batch."""
    out: dict[str, int] = {}
    for name in names:
        crc = 0
        for chunk in _row_bytes(batch[name]):
            crc = zlib.crc32(chunk, crc)
        out[name] = crc
    return out
