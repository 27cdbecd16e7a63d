"""Hostile and broken input: only the library's own errors come out, and the dock stays consistent."""

from __future__ import annotations

import json
import struct

import fakeredis
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import BrokerError, DecodeError, DockNotFoundError, SchemaError, TransferDock
from broker.cli import main as cli_main
from broker.control.keys import DockKeys
from broker.data.codec import decode, encode
from tests.helpers import data_cell, server_keys

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- the decoder ------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_decode_error(data):
    try:
        decode(data, where="k field 1")
    except DecodeError as exc:
        assert "k field 1" in str(exc)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)


@FUZZ
@given(header=json_like, payload=st.binary(max_size=64), declared=st.integers(0, 2**32 - 1))
def test_well_framed_hostile_headers_raise_decode_error(header, payload, declared):
    """The frame is right, the header is anything; also lie about the header's length."""
    packed = msgpack.packb(header, use_bin_type=True)
    for length in (len(packed), declared):
        frame = bytearray(-(-(8 + len(packed)) // 16) * 16)
        struct.pack_into("<2sBBI", frame, 0, b"TD", 1, 0, length)
        frame[8 : 8 + len(packed)] = packed
        try:
            out = decode(bytes(frame) + payload)
        except DecodeError:
            continue
        assert isinstance(out, torch.Tensor)  # only a header that truly matches the payload decodes


@FUZZ
@given(dims=st.lists(st.integers(0, 2**61), min_size=1, max_size=8), dtype=st.sampled_from(["int32", "bfloat16"]))
def test_huge_declared_shapes_are_refused_without_allocating(dims, dtype):
    header = msgpack.packb([dtype, dims])
    frame = bytearray(-(-(8 + len(header)) // 16) * 16)
    struct.pack_into("<2sBBI", frame, 0, b"TD", 1, 0, len(header))
    frame[8 : 8 + len(header)] = header
    try:
        out = decode(bytes(frame) + b"\0" * 16)
    except DecodeError:
        return
    assert out.numel() * out.element_size() == 16


@FUZZ
@given(st.data())
def test_a_flipped_byte_in_a_valid_tensor_decodes_to_same_size_or_raises(data):
    tensor = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    raw = bytearray(encode(tensor))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        out = decode(bytes(raw))
    except DecodeError:
        return
    assert out.numel() * out.element_size() == 24  # a payload flip changes values, never the size


# -- public calls with junk arguments -----------------------------------------------------------

junk = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.binary(max_size=8) | st.lists(st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=3), max_size=6)
    | st.builds(lambda n: torch.randn(n), st.integers(0, 4))
    | st.builds(lambda n: np.arange(n, dtype=np.float32), st.integers(0, 4))
    | st.dictionaries(st.text(max_size=8), st.integers(), max_size=2)
)


def _fresh_dock() -> TransferDock:
    dock = TransferDock(fakeredis.FakeRedis(), "fuzz", prompts_num=2, n_samples_per_prompt=2,
                        columns=["prompts", "responses"], consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    return dock


CALLS = {
    "put": lambda d, a, b: d.put_experience(a, b),
    "put_rows": lambda d, a, b: d.put_experience({"prompts": a}, b),
    "get": lambda d, a, b: d.get_experience(a, ["prompts"], b),
    "get_cols": lambda d, a, b: d.get_experience("train", a, b),
    "get_rows": lambda d, a, b: d.get_experience("train", ["prompts"], indexes=a, timeout=b),
    "get_opts": lambda d, a, b: d.get_experience("train", ["prompts"], 2, get_n_samples=a, lease=b),
    "clear": lambda d, a, b: d.clear(a),
    "ack": lambda d, a, b: d.ack(a, b),
    "ack_token": lambda d, a, b: d.ack("train", a, token=b),
    "all_consumed": lambda d, a, b: d.all_consumed(a),
    "create": lambda d, a, b: TransferDock(d.client, "fuzz", prompts_num=a, n_samples_per_prompt=b,
                                           columns=["prompts"], consumers=["train"]),
    "get_dp": lambda d, a, b: d.get_experience("train", ["prompts"], 2, dp_size=a, balance=b),
    "metrics": lambda d, a, b: d.update_metrics(a, b),
    "metrics_cumulate": lambda d, a, b: d.update_metrics("m", a, cumulate=b),
    "prefetch": lambda d, a, b: d.prefetch_request_index(a),
    "columns_of": lambda d, a, b: d.register_consumer_columns(a),
    "columns_of_train": lambda d, a, b: d.register_consumer_columns({"train": b}),
    "grow": lambda d, a, b: d.grow(a, b),
    "reset": lambda d, a, b: d.reset_consumer(a, b),
    "read_rows": lambda d, a, b: d.read_rows(a, b),
}


@settings(max_examples=400, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), a=junk, b=junk)
def test_junk_arguments_raise_only_broker_errors_and_change_nothing(call, a, b):
    dock = _fresh_dock()
    before = dock.status()
    try:
        CALLS[call](dock, a, b)
    except BrokerError:
        assert dock.status() == before, "a call that raised changed the dock"
        return
    # Junk that happens to be valid (say, clear(None) or get of a junk-but-legal count) is fine.
    json.dumps(dock.status())


# -- garbage written into a dock's keys, as with redis-cli ---------------------------------------

def _cell(client, keys: DockKeys, row: int) -> tuple[str, str]:
    """Where row ``row`` of column prompts keeps its bytes (in the dock's slot, or on a data shard)."""
    return data_cell(TransferDock.attach(client, keys.name), "prompts", row)


GARBAGE = {
    "meta field": lambda c, k: c.hset(k.meta, "columns", "not json"),
    "meta type": lambda c, k: (c.delete(k.meta), c.set(k.meta, "x")),
    "data bytes": lambda c, k: c.hset(*_cell(c, k, 1), b"\x80\x04\x95 pickle? no"),
    "data type": lambda c, k: (c.delete(_cell(c, k, 1)[0]), c.rpush(_cell(c, k, 1)[0], "x")),
    "ready type": lambda c, k: (c.delete(k.ready("prompts")), c.sadd(k.ready("prompts"), "x")),
    "gready type": lambda c, k: (c.delete(k.group_ready("prompts")), c.hset(k.group_ready("prompts"), "a", "b")),
    "consumed type": lambda c, k: c.hset(k.consumed("train"), "a", "b"),
    "gtaken type": lambda c, k: c.rpush(k.group_taken("train"), "a"),
    "gremnant type": lambda c, k: c.rpush(k.group_remnant("train"), "a"),
    "leases type": lambda c, k: c.set(k.leases("train"), "soon"),
    "leases junk member": lambda c, k: c.zadd(k.leases("train"), {"not-a-row": 0}),
    "redelivered junk": lambda c, k: c.set(k.redelivered("train"), "many"),
    "tokens type": lambda c, k: c.rpush(k.tokens("train"), "x"),
    "epoch type": lambda c, k: (c.delete(k.epoch), c.rpush(k.epoch, "x")),  # a list where the epoch was
    "gen type": lambda c, k: c.sadd(k.generations, "x"),
    "ready past capacity": lambda c, k: c.set(k.ready("prompts"), b"\xff" * 50),
    "gready past groups": lambda c, k: c.setbit(k.group_ready("prompts"), 9, 1),
    "meta edited": lambda c, k: c.hset(k.meta, "prompts_num", "8"),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_in_keys_is_reported_by_reads_and_status_not_crashed_on(client, kind, capsys):
    dock = TransferDock(client, "g", prompts_num=2, n_samples_per_prompt=2, columns=["prompts"], consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    GARBAGE[kind](client, DockKeys("g"))
    outcomes = []
    for op in (
        lambda: TransferDock.attach(client, "g").status(),
        lambda: dock.get_experience("train", ["prompts"], 2, lease=1),
        lambda: dock.get_experience("train", ["prompts"], indexes=[0, 1]),
        lambda: dock.put_experience({"prompts": [torch.ones(1)]}, indexes=[3]),
        lambda: dock.ack("train", [0], token="r1"),
        lambda: dock.all_consumed("train"),
        lambda: dock.clear(indexes=[2]),
    ):
        try:
            op()
            outcomes.append("ok")
        except BrokerError as exc:
            outcomes.append(type(exc).__name__)
            assert "g" in str(exc)
    assert any(o != "ok" for o in outcomes), outcomes


DEEP = "[" * 100_000  # JSON nested past Python's recursion limit


def test_json_nested_past_the_recursion_limit_is_a_decode_error_wherever_it_is_read(client):
    """A tenant may write anything into its own dock's keys; what the broker reads back as JSON (the meta's
    columns, the metrics, a consumer's registered columns) raised RecursionError, and crashed every reader."""
    dock = TransferDock(client, "deep", prompts_num=2, n_samples_per_prompt=2, columns=["prompts"],
                        consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    k = DockKeys("deep")
    client.hset(k.metrics, "loss", DEEP)
    with pytest.raises(DecodeError, match=r"td:\{deep\}:metrics"):
        dock.get_metrics()
    client.hset(k.consumer_columns, "train", DEEP)
    with pytest.raises(DecodeError, match=r"td:\{deep\}:columns_of"):
        dock.get_experience("train", None, 2)
    client.hset(k.meta, "columns", DEEP)
    with pytest.raises(DecodeError, match=r"td:\{deep\}:meta.*RecursionError"):
        TransferDock.attach(client, "deep")
    client.hset(k.meta, "columns", "[" + '"x",' * 300_000 + '"x"]')  # longer than any meta a broker writes
    with pytest.raises(DecodeError, match="more than"):
        TransferDock.attach(client, "deep")


@pytest.mark.real
@pytest.mark.parametrize(
    "kind", ["meta field", "data type", "consumed type", "redelivered junk", "ready past capacity"]
)
def test_broker_status_reports_garbage(real_url, kind, capsys):
    import redis

    client = redis.Redis.from_url(real_url)
    client.flushdb()
    dock = TransferDock(real_url, "g", prompts_num=2, n_samples_per_prompt=2, columns=["prompts"], consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    GARBAGE[kind](client, DockKeys("g"))
    code = cli_main(["status", "--url", real_url])
    out, err = capsys.readouterr()
    assert code in (0, 1)
    assert "Traceback" not in out + err
    if code == 1:
        assert "dock g: ERROR" in out


def _every_operation(dock: TransferDock) -> list:
    return [
        lambda: dock.put_experience({"prompts": [torch.ones(1)]}, indexes=[3]),
        lambda: dock.get_experience("train", ["prompts"], 2, lease=1),
        lambda: dock.get_experience("train", ["prompts"], 1, get_n_samples=False, timeout=0.1),
        lambda: dock.get_experience("train", ["prompts"], indexes=[0, 1]),
        lambda: dock.ack("train", [0], token="r1"),
        lambda: dock.all_consumed("train"),
        lambda: dock.status(),
        lambda: dock.clear(indexes=[2]),
        lambda: dock.clear(),
    ]


def test_a_dock_whose_keys_vanished_under_it_raises_and_writes_nothing(client):
    """FLUSHALL (or a Redis restarted without persistence) under a live dock object."""
    dock = TransferDock(client, "g", prompts_num=2, n_samples_per_prompt=2, columns=["prompts"], consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    client.flushall()
    for op in _every_operation(dock):
        with pytest.raises(DockNotFoundError, match=r"td:\{g\}:meta"):
            op()
    assert server_keys(client) == []  # not even the bytes of the refused put


def test_a_dock_whose_schema_was_edited_under_it_raises_and_changes_nothing(client):
    dock = TransferDock(client, "g", prompts_num=2, n_samples_per_prompt=2, columns=["prompts"], consumers=["train"])
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    client.hset(DockKeys("g").meta, "prompts_num", "8")
    before = {key: client.dump(key) for key in server_keys(client)}
    for op in _every_operation(dock)[1:]:  # a refused put takes its bytes back, but row 3's old ones with them
        with pytest.raises(SchemaError, match="no longer holds the schema"):
            op()
    assert {key: client.dump(key) for key in server_keys(client)} == before
    assert TransferDock.attach(client, "g").capacity == 16  # opening it again reads the schema now stored
