"""The tensor wire format: bit-exact round trips and loud failures on bad bytes."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch

from broker import DecodeError, InvalidExperienceError
from broker.codec import DTYPES, decode, decode_rows, encode, encode_rows, encode_stacked

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (2, 3, 4)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random raw bits of ``dtype``: every bit pattern, NaNs and infinities included."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.tensor(shape).prod().item() if shape else 1)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(dtype, shape):
    t = random_tensor(dtype, shape)
    out = decode(bytes(encode(t)))
    assert out.dtype == dtype
    assert tuple(out.shape) == shape
    assert bits(out) == bits(t)


def test_non_contiguous_and_sliced_tensors_encode_their_values():
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    for t in (base.t(), base[:, ::2], base[1:3], base[0]):
        assert torch.equal(decode(bytes(encode(t))), t)


def test_decoded_tensor_is_a_view_on_the_received_bytes():
    data = bytes(encode(torch.arange(1000, dtype=torch.float32)))
    out = decode(data)
    # A view shares memory with the bytes object: no copy of the payload on the read path.
    assert out.untyped_storage().data_ptr() >= id(data)
    assert out.untyped_storage().data_ptr() < id(data) + len(data) + 64


def test_payload_is_aligned_for_every_dtype():
    for dtype in DTYPES.values():
        data = bytes(encode(random_tensor(dtype, (5,))))
        header_len = struct.unpack_from("<I", data, 4)[0]
        assert (len(data) - 5 * torch.empty((), dtype=dtype).element_size()) % 16 == 0
        assert header_len < 64


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn], ids=str)
def test_unsupported_dtype_is_refused_by_name(dtype):
    with pytest.raises(InvalidExperienceError, match="not supported"):
        encode(torch.zeros(3, dtype=dtype))


def test_non_tensor_is_refused():
    with pytest.raises(InvalidExperienceError, match="expected a torch.Tensor"):
        encode([1, 2, 3])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_batch_encoders_give_the_bytes_of_encode(dtype):
    rows = [random_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES * 2)]
    rows.append(random_tensor(dtype, (4, 6)).t())  # not contiguous: must take encode's path
    assert encode_rows(rows) == [encode(t) for t in rows]
    for stacked in (random_tensor(dtype, (5, 3)), random_tensor(dtype, (3, 5)).t(), random_tensor(dtype, (4,)),
                    random_tensor(dtype, (3, 0))):
        assert encode_stacked(stacked) == [encode(t) for t in stacked.unbind(0)]


def test_batch_encoder_takes_numpy_rows_and_names_the_bad_row():
    assert encode_rows([np.arange(3, dtype=np.int32)]) == [encode(torch.arange(3, dtype=torch.int32))]
    with pytest.raises(InvalidExperienceError, match="row 1: dtype torch.complex64 is not supported"):
        encode_rows([torch.zeros(2), torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(InvalidExperienceError, match="row 0: .*numpy array of dtype object"):
        encode_rows([np.array([object()])])
    with pytest.raises(InvalidExperienceError, match="row 2: expected a torch.Tensor, got str"):
        encode_rows([torch.zeros(1), torch.zeros(1), "junk"])


def test_decode_rows_agrees_with_decode_across_changing_prefixes():
    rows = [random_tensor(dtype, shape, seed=i) for i, (dtype, shape) in
            enumerate((d, s) for s in SHAPES for d in DTYPES.values())]
    values = [bytes(encode(t)) for t in rows] * 2  # the second pass runs on cached prefixes
    fields = [str(i) for i in range(len(values))]
    out = decode_rows(values, where="k", fields=fields)
    for got, value in zip(out, values):
        want = decode(value)
        assert got.dtype == want.dtype and got.shape == want.shape and bits(got) == bits(want)


def _frame(header_obj, payload: bytes = b"", *, magic=b"TD", version=1) -> bytes:
    header = msgpack.packb(header_obj)
    start = -(-(8 + len(header)) // 16) * 16
    out = bytearray(start)
    struct.pack_into("<2sBBI", out, 0, magic, version, 0, len(header))
    out[8 : 8 + len(header)] = header
    return bytes(out) + payload


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "too short"),
        (b"\x80\x04\x95garbage-pickle", "not an encoded tensor"),
        (_frame(["int32", [2]], magic=b"XX"), "not an encoded tensor"),
        (_frame(["int32", [2]], b"\0" * 8, version=9), "version 9"),
        (_frame(["complex", [2]], b"\0" * 8), "unknown dtype"),
        (_frame(["int32", [3]], b"\0" * 8), "needs 12 payload bytes, found 8"),
        (_frame(["int32", [2]], b"\0" * 9), "needs 8 payload bytes, found 9"),
        (_frame(["int32", [2**40, 2**40]], b"\0" * 8), "payload bytes"),
        (_frame(["int32", [-1]], b""), "invalid shape"),
        (_frame(["int32", ["a"]], b""), "invalid shape"),
        (_frame(["int32", [1] * 100], b"\0" * 4), "unreadable tensor header"),
        (_frame({"dtype": "int32"}, b""), "unreadable tensor header"),
        (_frame("int32", b""), "must be \\[dtype, shape\\]"),
        (_frame(["bool", [2]], b"\x01\x07"), "bool payload"),
        (b"TD\x01\x00\xff\xff\xff\x7f" + b"\0" * 8, "runs past"),
        (b"TD\x01\x00\x03\x00\x00\x00\xc1\xc1\xc1" + b"\0" * 5, "unreadable tensor header"),
    ],
)
def test_bad_bytes_raise_decode_error_naming_the_place(data, message):
    with pytest.raises(DecodeError, match=message) as info:
        decode(data, where="td:{x}:data:responses field 7")
    assert "td:{x}:data:responses field 7" in str(info.value)
    with pytest.raises(DecodeError, match=message) as info:
        decode_rows([data], where="td:{x}:data:responses", fields=["7"])
    assert "td:{x}:data:responses field 7" in str(info.value)


@pytest.mark.parametrize(
    "good, bad, message",
    [
        (_frame(["int32", [2]], b"\0" * 8), _frame(["int32", [2]], b"\0" * 9), "needs 8 payload bytes, found 9"),
        (_frame(["int32", [2]], b"\0" * 8), _frame(["int32", [2]], b"\0" * 4), "needs 8 payload bytes, found 4"),
        (_frame(["int32", [2]], b"\0" * 8), _frame(["int32", [2]])[:20], "runs past|payload bytes|too short"),
        (_frame(["bool", [2]], b"\x01\x00"), _frame(["bool", [2]], b"\x01\x07"), "bool payload"),
    ],
    ids=["long payload", "short payload", "cut short", "bool not 0 or 1"],
)
def test_decode_rows_checks_rows_whose_prefix_it_has_seen(good, bad, message):
    with pytest.raises(DecodeError, match=message) as info:
        decode_rows([good, good, bad], where="td:{x}:data:responses", fields=["1", "2", "3"])
    assert "td:{x}:data:responses field 3" in str(info.value)


def test_non_bytes_raise_decode_error():
    with pytest.raises(DecodeError, match="expected bytes"):
        decode(12, where="somewhere")  # type: ignore[arg-type]
