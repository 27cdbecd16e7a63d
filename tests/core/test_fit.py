"""Rows cut to fit the server allocator's size classes (``broker/data/fit.py``): the memory they save, and
that a cut row reads back bit-exact however it is read, by a reader that wrote it or one that did not,
while it is rewritten, cleared, or broken behind the broker's back.

Docks are opened from URLs: only connections the broker opens send the halves uncopied, so only they cut.
"""

from __future__ import annotations

import os
import threading

import pytest
import redis
import torch

import broker.transfer_queue as tq
from broker import DecodeError, FencedError, TransferDock
from broker.connection.framing import LARGE, Framed
from broker.control import server_checks
from broker.data import codec, fit, row_header
from tests.helpers import bits, dense, empty_cluster

B, S = 64, 8192  # rows of 32 KiB of float32: just past a size class when stored whole

#: jemalloc 5's size classes from 4 KiB to 160 KiB (4 per doubling), as its own tables list them.
JEMALLOC_CLASSES = [4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768, 40960,
                    49152, 57344, 65536, 81920, 98304, 114688, 131072, 163840]


@pytest.fixture(params=["real", "redis62", "cluster"])
def store_url(request, monkeypatch):
    """An empty store's URL: Redis 7 (jemalloc here), Redis 6.2 (libc malloc), a cluster node. On 6.2 the
    docks opened cut rows as on jemalloc (they would not: see the test after the memory one), so that the
    reads are tried there too: rows cut on another server read the same (a copy of its data, say)."""
    if request.param == "redis62":
        monkeypatch.setattr(server_checks, "_allocator", lambda info: "jemalloc-5.3.0")
    if request.param == "cluster":
        empty_cluster(request.getfixturevalue("cluster_admin"))
        return request.getfixturevalue("cluster_url")
    url = request.getfixturevalue("redis62_url" if request.param == "redis62" else "real_url")
    redis.Redis.from_url(url).flushall()
    return url


def open_dock(url: str, name: str = "fit", **kwargs) -> TransferDock:
    # On a cluster a dock is sharded by default, and sharded docks store rows whole: one slot here.
    return TransferDock(url, name, B, 1, ["x", "s", "rag", "small"], ["c"], shards=0, **kwargs)


def batch(seed: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (S - 1) * j // (B - 1) for j in range(B)]  # ragged: some rows cut, some whole
    return {
        "x": list(torch.randn(B, S, generator=g).unbind()),
        "s": [f"{seed}:" + os.urandom(S * 2).hex() for _ in range(B)],
        "rag": [torch.randn(n, generator=g) for n in lengths],
        "small": [torch.tensor([seed, j]) for j in range(B)],
    }


def same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and bits(got) == bits(want)
    return got == want


def check_rows(got: dict, want: dict, rows: list[int]) -> None:
    for col, values in got.items():
        values = list(values.unbind()) if isinstance(values, torch.Tensor) else values
        assert len(values) == len(rows), col
        for value, row in zip(values, rows):
            assert same(value, want[col][row]), f"column {col} row {row}"


# -- the sizes --------------------------------------------------------------------------------------------


def test_size_classes_are_jemallocs():
    for size in range(4096, 163841, 7):
        assert fit.size_class(size) == min(c for c in JEMALLOC_CLASSES if c >= size)
        assert fit.class_below(size) == max(c for c in JEMALLOC_CLASSES if c <= size)


@pytest.mark.parametrize("length", [4096 + 32, 8192 + 32, 32768 + 32, 65536 + 32, 131072 + 32, 3 * 32768 + 32,
                                    32768 - 6, 40000, 4000])
def test_a_head_fills_its_class_and_a_row_wasting_little_is_whole(length):
    head = fit.head_length(length)
    need = length + fit.overhead(length)
    if (fit.size_class(need) - need) * fit.WASTE <= length or length < fit.MIN_CUT:
        assert head is None
        return
    assert head is not None and 0 < length - head < 64
    assert head + fit.overhead(head) == fit.class_below(need)  # the head takes a class, with nothing to spare


def test_a_cut_row_is_its_head_and_tail_and_the_put_is_left_as_it_was():
    row = torch.randn(S)
    values = {"0": codec.encode(row), "1": codec.encode_rows([row, row], framed=True)[1],
              "2": codec.encode(torch.randn(100))}
    framed_before = values["1"].pieces
    heads, tails = fit.cut(values)
    for field in ("0", "1"):
        head = heads[field]
        assert isinstance(head, Framed) and len(head) == fit.head_length(len(values[field]))
        assert bytes(head) + tails[field] == bytes(values[field])
        assert fit.is_head(bytes(head)) and not fit.is_head(bytes(values[field]))
    assert heads["2"] is values["2"] and "2" not in tails  # 1,632 bytes: stored whole
    assert values["1"].pieces is framed_before and len(values["1"]) == len(codec.encode(row))  # resent: cut again


def test_a_short_rows_head_is_a_copy_and_a_long_rows_a_view():
    """Heads of rows shorter than framing.LARGE are bytes (packed by hiredis, nothing for the collector);
    longer rows' heads are Framed views of the row."""
    short, long = codec.encode(torch.randn(1271)), codec.encode(torch.randn(8193))  # both cut
    assert len(short) < LARGE <= len(long)
    heads, tails = fit.cut({"s": short, "l": long})
    assert type(heads["s"]) is bytes and heads["s"] + tails["s"] == short
    assert isinstance(heads["l"], Framed) and bytes(heads["l"]) + tails["l"] == long


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_is_head_says_the_same_with_a_known_prefix_and_without(kind):
    """``is_head`` answers from the prefixes decoding accepted, or by reading the header: the same either way."""
    rows = [codec.encode(torch.randn(n)) for n in (1271, 1530, 8193)] + [codec.encode(torch.zeros(3, 700))]  # all cut
    values = [kind(bytes(v)) for row in rows for v in (row, fit.cut({"0": row})[0]["0"])]
    values += [kind(b"TD" + bytes(5000)), kind(b"x" * 5000)]
    row_header.DECODED_PREFIXES.clear()
    unknown = [fit.is_head(v) for v in values]
    codec.decode_rows(rows, where="k", fields=[str(i) for i in range(len(rows))])  # their prefixes, now known
    assert row_header.DECODED_PREFIXES
    assert [fit.is_head(v) for v in values] == unknown == [fit.whole_of_head(v, len(v)) is not None for v in values]
    assert unknown == [False, True] * 4 + [False, False]


@pytest.mark.parametrize("pieces", [
    (b"p" * 40, memoryview(bytes(range(256)) * 64)),  # a tensor row: the tail in its storage
    (bytes(range(256)) * 64 + b"p" * 40,),  # a string row: one piece
    (b"p" * 32, memoryview(bytes(range(256)) * 64), b"ab"),  # the tail across two pieces
], ids=["tensor", "bytes", "across"])
def test_a_tail_is_the_rows_bytes_after_its_head_wherever_its_pieces_end(pieces):
    value = Framed(pieces)
    heads, tails = fit.cut({"0": value})
    assert bytes(heads["0"]) + tails["0"] == b"".join(pieces) and type(tails["0"]) is bytes


def test_a_head_is_framed_on_the_wire_as_the_first_bytes_of_its_row():
    from broker.connection.framing import pack

    payload = memoryview(bytes(range(256)) * 200)
    head = Framed((b"ab", payload), 20_000)
    wire = b"".join(bytes(chunk) for chunk in pack(["HSET", "k", "f", head], lambda v: v.encode()))
    assert wire == b"*4\r\n$4\r\nHSET\r\n$1\r\nk\r\n$1\r\nf\r\n$20000\r\n" + b"ab" + bytes(payload[:19_998]) + b"\r\n"
    assert bytes(head) == b"ab" + bytes(payload[:19_998])


# -- memory ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["real_url", "redis62_url"])
def test_memory_per_payload_byte_of_power_of_two_rows(server, request):
    """1024 rows of 8192 float32: stored whole they took 1.25 bytes per payload byte on jemalloc. Counted by
    MEMORY USAGE of the dock's data and tail hashes (every field), which sums the allocations' real sizes:
    the server's used_memory moves with its buffers too (docs/benchmark.md measures that one)."""
    url = request.getfixturevalue(server)
    client = redis.Redis.from_url(url)
    client.flushall()
    rows = 1024
    dock = TransferDock(url, "mem", rows, 1, ["x"], ["c"])
    x = torch.randn(rows, S)
    dock.put_experience({"x": x}, list(range(rows)))
    stored = sum(client.memory_usage(key, samples=0) or 0 for key in (dock.keys.data("x"), dock.keys.tail("x")))
    per_byte = stored / x.nbytes
    assert per_byte < 1.02, f"{per_byte:.3f} bytes per payload byte on {client.info('memory')['mem_allocator']}"
    assert torch.equal(dock.read_rows(["x"], list(range(rows)), stack=True)["x"], x)
    client.flushall()


def test_rows_are_stored_whole_on_an_allocator_without_such_classes(redis62_url):
    """The C allocator rounds to 16 bytes: a cut row would only cost its tail there."""
    client = redis.Redis.from_url(redis62_url)
    client.flushall()
    assert client.info("memory")["mem_allocator"] == "libc"
    dock = open_dock(redis62_url)
    want = batch(3)
    dock.put_experience(want, list(range(B)))
    assert not client.exists(dock.keys.tail("x"))
    check_rows(dock.read_rows(list(want), list(range(B)), stack=True), want, list(range(B)))


# -- reading -----------------------------------------------------------------------------------------------


def test_cut_rows_read_back_bit_exact_by_every_read(store_url):
    writer = open_dock(store_url)
    want = batch(1)
    rows = list(range(B))
    writer.put_experience(want, rows)
    assert writer.client.hlen(writer.keys.tail("x")) == B  # every row of x was cut
    assert 0 < writer.client.hlen(writer.keys.tail("rag")) < B
    assert writer.client.hlen(writer.keys.tail("small")) == 0
    # A reader that wrote nothing learns the columns from the heads it meets; the writer knows them.
    for dock in (open_dock(store_url), open_dock(store_url), writer):
        check_rows(dock.read_rows(list(want), rows, stack=True), want, rows)
        check_rows(dock.read_rows(list(want), rows[::-1]), want, rows[::-1])
    reader = open_dock(store_url)
    got, indexes = reader.get_experience("c", list(want), experience_count=B // 2, stack=True)
    check_rows(got, want, indexes)
    got, indexes = open_dock(store_url).get_experience("c", list(want), experience_count=B // 2)
    check_rows(got, want, indexes)


def test_a_row_rewritten_whole_or_cut_reads_as_written_last(store_url):
    dock = open_dock(store_url)
    dock.put_experience({"x": [torch.randn(S) for _ in range(4)]}, [0, 1, 2, 3])
    shorter = [torch.randn(S // 2 + 1) for _ in range(2)]  # stored whole: the old tails stay, ignored
    longer = [torch.randn(S) for _ in range(2)]
    dock.put_experience({"x": shorter}, [0, 1])
    dock.put_experience({"x": longer}, [2, 3])
    for reader in (dock, open_dock(store_url)):
        for stack in (False, True):
            got = reader.read_rows(["x"], [0, 1, 2, 3], stack=stack)["x"]
            assert all(same(g, w) for g, w in zip(got, shorter + longer))


def test_forgetting_rows_deletes_their_tails(store_url):
    dock = open_dock(store_url)
    dock.put_experience(batch(2), list(range(B)))
    tails = dock.keys.tail("x")
    dock.clear(list(range(0, B, 2)))
    assert dock.client.hlen(tails) == B // 2
    got, indexes = dock.get_experience("c", ["x"], experience_count=4)
    assert all(i % 2 for i in indexes)
    dock.clear()
    assert not dock.client.exists(tails)
    dock.put_experience(batch(3), list(range(B)))
    dock.delete()
    assert not dock.client.exists(tails, dock.keys.data("x"))


def test_a_fenced_put_writes_no_tail(real_url):
    redis.Redis.from_url(real_url).flushall()
    dock = open_dock(real_url)
    dock.put_experience({"small": [torch.tensor([0, j]) for j in range(B)]}, list(range(B)))
    _, rows = dock.get_experience("c", ["small"], experience_count=4, lease=30)
    dock.clear(list(rows))
    with pytest.raises(FencedError):
        dock.put_experience({"x": [torch.randn(S) for _ in rows]}, rows)  # a leased delivery: fenced
    assert dock.client.hlen(dock.keys.tail("x")) == 0 and dock.client.hlen(dock.keys.data("x")) == 0


def test_a_head_without_its_tail_is_a_corrupt_row_named(real_url):
    redis.Redis.from_url(real_url).flushall()
    dock = open_dock(real_url, dead_letter_after=2)
    dock.put_experience({"x": [torch.randn(S) for _ in range(B)]}, list(range(B)))
    dock.client.hdel(dock.keys.tail("x"), "5")
    dock.client.hset(dock.keys.tail("x"), "6", b"short")
    for reader in (dock, open_dock(real_url)):
        with pytest.raises(DecodeError, match=r"td:\{fit\}:data:x field 5: .*needs 32768 payload bytes"):
            reader.read_rows(["x"], [4, 5], stack=True)
        with pytest.raises(DecodeError, match=r"field 6"):
            reader.read_rows(["x"], [6])
    with pytest.raises(DecodeError, match=r"row 5"):
        dock.get_experience("c", ["x"], indexes=[4, 5, 6])


def test_tq_kv_round_trip_of_cut_rows(real_url):
    redis.Redis.from_url(real_url).flushall()
    from tensordict import TensorDict

    tq.init({"broker": {"url": real_url, "namespace": "fit"}})
    try:
        x = torch.randn(B, S)
        keys = [f"k{i}" for i in range(B)]
        tq.kv_batch_put(keys=keys, partition_id="p", fields=TensorDict({"x": x}, batch_size=[B]))
        assert torch.equal(dense(tq.kv_batch_get(keys=keys, partition_id="p")["x"]), x)
    finally:
        tq.close()


# -- concurrency -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", [True, False])
def test_a_reader_never_joins_one_puts_head_to_anothers_tail(real_url, stack):
    """Two rows rewritten in a tight loop with either of two values, read in a loop among many: every row
    read is one of the two, whole. Heads and tails are read in one transaction; read in two commands, a put
    landing between them gave rows made of both: a read of many rows reaches the server in several reads
    of its socket, between which it serves the writer."""
    redis.Redis.from_url(real_url).flushall()
    rows = list(range(3000))
    versions = [torch.full((2, 1024), float(v)) for v in (1, 2)]  # rows of 4 KiB: cut
    writer = TransferDock(real_url, "fit", len(rows), 1, ["x"], ["c"])
    writer.put_experience({"x": torch.zeros(len(rows), 1024)}, rows)
    writer.put_experience({"x": versions[0]}, [0, 1])
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            writer.put_experience({"x": versions[i % 2]}, [0, 1])
            i += 1

    thread = threading.Thread(target=rewrite, daemon=True)
    thread.start()
    reader = TransferDock(real_url, "fit", len(rows), 1, ["x"], ["c"])
    try:
        for _ in range(30):  # without the transaction, the first few reads already gave mixed rows
            got = reader.read_rows(["x"], rows, stack=stack)["x"]
            for row in got[:2]:
                assert row[0].item() in (1.0, 2.0) and torch.all(row == row[0]), "a row made of two puts"
    finally:
        stop.set()
        thread.join()
