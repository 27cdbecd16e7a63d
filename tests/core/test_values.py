"""Rows that are not tensors (labels, metadata) and tensors of 2 and more dimensions per row."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch

from broker import DecodeError, InvalidExperienceError
from broker.data.codec import decode, encode, encode_value
from broker.data.row_header import KIND_VALUE, KIND_VERSION, MAGIC, VERSION
from tests.helpers import held_rows

VALUES = [
    "a label", "", "汉字 and emoji \N{ROCKET}", b"\x00\xff raw", 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5,
    float("inf"), True, False, None, [], {}, [1, "two", 3.0, None, [b"x"]],
    {"image": "a.png", "boxes": [[1, 2, 3, 4]], "scores": {"cat": 0.9}}, {1: "int key", b"b": "bytes key"},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_read_back_equal_and_of_the_same_type(value):
    back = decode(encode_value(value))
    assert back == value and type(back) is type(value)


def test_nan_reads_back_as_nan():
    back = decode(encode_value([float("nan")]))
    assert back[0] != back[0]


@pytest.mark.parametrize("value, expected", [
    ((1, 2), [1, 2]),
    ({"t": (1, (2, 3))}, {"t": [1, [2, 3]]}),
    (np.int64(7), 7),
    (np.float32(0.5), 0.5),
    (np.str_("s"), "s"),
    ({"ids": np.arange(3)}, {"ids": [0, 1, 2]}),
])
def test_what_changes_on_the_way_is_what_the_docs_say(value, expected):
    back = decode(encode_value(value))
    assert back == expected and type(back) is type(expected)


@pytest.mark.parametrize("value, message", [
    ({1, 2}, "a set cannot be stored in a value"),
    (object(), "a object cannot be stored"),
    ({"t": torch.ones(2)}, "a tensor nested inside a value cannot be stored"),
    (2**64, "outside the 64-bit range"),
    (-(2**63) - 1, "outside the 64-bit range"),
    ({(1, 2): "tuple key"}, "would not read back"),
    ([np.datetime64("2020-01-01")], r"numpy array of dtype datetime64\[D\] cannot be stored"),
])
def test_values_that_cannot_be_stored_are_refused_by_name(value, message):
    with pytest.raises(InvalidExperienceError, match=message):
        encode_value(value)


def _value_bytes(payload: bytes, *, version: int = KIND_VERSION, kind: int = KIND_VALUE,
                 length: int | None = None) -> bytes:
    return struct.pack("<2sBBI", MAGIC, version, kind, len(payload) if length is None else length) + payload


@pytest.mark.parametrize("data, message", [
    (_value_bytes(msgpack.packb("x"), kind=7), "unknown kind 7"),
    (_value_bytes(msgpack.packb("x"), version=3), "format version 3"),
    (_value_bytes(msgpack.packb("abc"), length=99), "value of 99 bytes declared"),
    (_value_bytes(msgpack.packb("abc")[:-1]), "unreadable value"),
    (_value_bytes(b"\xa2\xff\xfe"), "unreadable value"),  # a str of invalid UTF-8
    (_value_bytes(msgpack.packb(msgpack.ExtType(5, b"x"))), "extension type 5"),
    # msgpack decodes its Timestamp (extension -1) without asking ext_hook: it was handed back as one.
    (_value_bytes(msgpack.packb(msgpack.Timestamp(1, 2))), "extension type -1, a Timestamp"),
    (_value_bytes(msgpack.packb({"at": [msgpack.Timestamp(1, 2)]})), "extension type -1, a Timestamp"),
    (_value_bytes(msgpack.packb(1) + msgpack.packb(2)), "unreadable value"),  # extra data
])
def test_corrupted_values_raise_decode_error_naming_the_place(data, message):
    with pytest.raises(DecodeError, match=message) as caught:
        decode(data, where="td:{d}:data:labels", field="3")
    assert "td:{d}:data:labels field 3" in str(caught.value)


def test_tensors_keep_the_version_older_brokers_read():
    data = encode(torch.arange(3))
    assert data[2] == VERSION == 1 and data[3] == 0
    assert encode_value("x")[2:4] == bytes([KIND_VERSION, KIND_VALUE])


# -- through a dock -------------------------------------------------------------------------------

def test_a_column_of_values_round_trips_through_the_dock(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts", "labels", "meta"))
    labels = np.array(["cat", "dog", None, "猫"], dtype=object)  # verl's non_tensor_batch
    meta = [{"source": "gsm8k", "id": i, "tags": ("a", "b")} for i in range(4)]
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2), "labels": labels, "meta": meta}, [0, 1, 2, 3])
    batch, rows = dock.get_experience("actor_train", ["labels", "meta", "prompts"], 4)
    assert rows == [0, 1, 2, 3]
    assert batch["labels"] == ["cat", "dog", None, "猫"]
    assert batch["meta"] == [{"source": "gsm8k", "id": i, "tags": ["a", "b"]} for i in range(4)]
    assert torch.equal(torch.stack(batch["prompts"]), torch.arange(8).reshape(4, 2))


def test_rows_of_one_column_may_mix_tensors_and_values(make_dock):
    dock = make_dock(prompts_num=1, n=3, columns=("x",))
    dock.put_experience({"x": [torch.ones(2), "text", np.arange(3, dtype=np.int16)]}, [0, 1, 2])
    batch, _ = dock.get_experience("actor_train", ["x"], 3)
    assert torch.equal(batch["x"][0], torch.ones(2)) and batch["x"][1] == "text"
    assert torch.equal(batch["x"][2], torch.arange(3, dtype=torch.int16))


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (1, 3, 2, 2), (3, 0)])
def test_tensors_of_two_and_more_dimensions_per_row_round_trip(make_dock, shape):
    dock = make_dock(prompts_num=1, n=2, columns=("pixel_values", "position_ids"))
    pixels = [torch.rand(*shape, dtype=torch.float32) for _ in range(2)]
    positions = torch.arange(2 * 3 * 7).reshape(2, 3, 7)  # stacked: each row a 3 x 7 tensor (mrope)
    dock.put_experience({"pixel_values": pixels, "position_ids": positions}, [0, 1])
    batch, _ = dock.get_experience("actor_train", ["pixel_values", "position_ids"], 2)
    for got, want in zip(batch["pixel_values"], pixels):
        assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(torch.stack(batch["position_ids"]), positions)


def test_a_bad_value_in_a_put_names_its_column_and_row_and_writes_nothing(make_dock, client):
    dock = make_dock(prompts_num=1, n=2, columns=("prompts", "labels"))
    with pytest.raises(InvalidExperienceError, match=r"column 'labels', row 1: a set cannot be stored"):
        dock.put_experience({"prompts": torch.ones(2, 2), "labels": ["fine", {1, 2}]}, [0, 1])
    assert dock.status()["columns"]["prompts"]["ready"] == 0
    assert held_rows(dock, "prompts") == 0


def test_a_zero_dimensional_object_array_is_refused(make_dock):
    dock = make_dock(prompts_num=1, n=1, columns=("labels",))
    with pytest.raises(InvalidExperienceError, match="0-d numpy array has no rows"):
        dock.put_experience({"labels": np.array("x", dtype=object)}, [0])


def test_a_msgpack_timestamp_is_refused_on_put():
    """docs/operations.md says extension types are refused: a Timestamp was accepted and handed back."""
    with pytest.raises(InvalidExperienceError, match="extension type -1, a Timestamp"):
        encode_value({"at": msgpack.Timestamp(1, 2)})
