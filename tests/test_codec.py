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


def test_decoded_tensors_are_writable_and_share_nothing_with_the_received_bytes():
    values = [bytes(encode(torch.arange(5, dtype=torch.int64) + 10 * i)) for i in range(3)]
    before = list(values)
    rows = decode_rows(values, where="k", fields=["0", "1", "2"])
    rows[1].add_(100)  # the user writes into one returned row
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3, 4], [110, 111, 112, 113, 114], [20, 21, 22, 23, 24]]
    assert values == before  # the received bytes are immutable and stay so
    one = decode(values[0])
    one.fill_(7)
    assert decode(values[0]).tolist() == [0, 1, 2, 3, 4]
    # A writable buffer is viewed, not copied: decode_rows reads each column from one such buffer.
    buffer = bytearray(values[2])
    view = decode(buffer)
    view[0] = -1
    assert decode(bytes(buffer))[0].item() == -1


@pytest.mark.parametrize("code, fails", [
    # The user's own frombuffer on bytes: torch's warning reaches them, as an error under -W error.
    ("torch.frombuffer(bytes(16), dtype=torch.uint8)", True),
    # The broker's decoders never raise it, and leave torch's one warning for the user's own call.
    ("from broker.codec import decode, decode_rows, encode\n"
     "data = bytes(encode(torch.arange(4)))\n"
     "decode(data); decode_rows([data, data], where='k', fields=['0', '1'])\n"
     "import warnings\n"
     "with warnings.catch_warnings(record=True) as seen:\n"
     "    warnings.simplefilter('always')\n"
     "    torch.frombuffer(bytes(16), dtype=torch.uint8)\n"
     "assert any('not writable' in str(w.message) for w in seen), seen", False),
])
def test_importing_the_broker_silences_no_warning_of_the_user(code, fails):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "error", "-c", f"import broker, torch\n{code}"],
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode != 0) == fails, run.stderr[-1500:]
    if fails:
        assert "The given buffer is not writable" in run.stderr


UNSTORABLE = {
    "meta": lambda: torch.empty(3, device="meta"),
    "sparse COO": lambda: torch.ones(3).to_sparse(),
    "sparse CSR": lambda: torch.ones(2, 2).to_sparse_csr(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "complex": lambda: torch.ones(3, dtype=torch.complex64),
    "numpy object": lambda: np.array([1, "a"], dtype=object),
    "numpy structured": lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
    "numpy datetime64": lambda: np.array(["2020-01-01"], dtype="datetime64[D]"),
    "numpy longdouble": lambda: np.ones(2, dtype=np.longdouble),
    "string": lambda: "abc",
}


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")  # making them
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unstorable_tensors_raise_invalid_experience_error(kind):
    from broker.codec import as_tensor

    for encode_it in (lambda v: encode(as_tensor(v)), lambda v: encode_rows([v]),
                      lambda v: encode_stacked(as_tensor(v))):
        with pytest.raises(InvalidExperienceError):
            encode_it(UNSTORABLE[kind]())


STORABLE_NUMPY = {
    "negative stride": lambda: np.arange(6, dtype=np.int32)[::-1],
    "negative stride 2-d": lambda: np.arange(12, dtype=np.float32).reshape(3, 4)[::-1, ::-2],
    "big-endian int32": lambda: np.arange(4, dtype=">i4"),
    "big-endian float64": lambda: np.linspace(0, 1, 5).astype(">f8"),
    "big-endian float16": lambda: np.arange(4, dtype=">f2"),
    "non-contiguous": lambda: np.arange(12).reshape(3, 4)[:, ::2],
    "read-only": lambda: np.frombuffer(np.arange(4, dtype=np.int16).tobytes(), dtype=np.int16),
    "0-d": lambda: np.array(5),
    "bool": lambda: np.array([True, False]),
}


@pytest.mark.parametrize("kind", sorted(STORABLE_NUMPY))
def test_numpy_arrays_torch_cannot_view_are_converted_and_stored(kind):
    from broker.codec import as_tensor

    array = STORABLE_NUMPY[kind]()
    expected = torch.from_numpy(np.array(array, dtype=array.dtype.newbyteorder("="), copy=True))
    for got in (decode(encode(as_tensor(array))), decode(encode_rows([array])[0])):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    if array.ndim:
        rows = encode_stacked(as_tensor(array))
        assert all(torch.equal(decode(r), e) for r, e in zip(rows, expected))


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
