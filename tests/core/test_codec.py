"""The tensor wire format: bit-exact round trips and loud failures on bad bytes."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch

from broker import DecodeError, InvalidExperienceError
from broker.data.codec import decode, decode_rows, encode, encode_rows, encode_stacked
from broker.data.row_header import DTYPES
from tests.helpers import bits, random_tensor

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (2, 3, 4)]


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
    ("from broker.data.codec import decode, decode_rows, encode\n"
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
    "complex32": lambda: torch.zeros(3, dtype=torch.complex32),
    "float8 fnuz": lambda: torch.zeros(3, dtype=torch.float8_e4m3fnuz),
    "float8 negated view": lambda: torch._neg_view(torch.ones(3).to(torch.float8_e5m2)),  # torch cannot negate it
    "numpy object": lambda: np.array([1, "a"], dtype=object),
    "numpy structured": lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
    "numpy datetime64": lambda: np.array(["2020-01-01"], dtype="datetime64[D]"),
    "numpy longdouble": lambda: np.ones(2, dtype=np.longdouble),
    "numpy clongdouble": lambda: np.ones(2, dtype=np.clongdouble),
    "string": lambda: "abc",
    "numpy unicode": lambda: np.array(["ab", "c"]),
    "numpy scalar": lambda: np.float32(1.5),
    "python int": lambda: 3,
    "python float": lambda: 1.5,
    "python bool": lambda: True,
    "bytes": lambda: b"abc",
    "None": lambda: None,
    "freed storage": lambda: _freed(torch.full((2, 3), 7.0)),
    "storage shrunk under a view": lambda: _freed(torch.arange(16.0).reshape(4, 4)[1:], keep_bytes=16),
    "fake tensor": lambda: _fake(torch.ones(2, 3)),
}
if torch.backends.mkldnn.is_available():
    UNSTORABLE["mkldnn"] = lambda: torch.ones(2, 3).to_mkldnn()


def _freed(tensor: torch.Tensor, keep_bytes: int = 0) -> torch.Tensor:
    """``tensor`` after its storage was shrunk under it, as FSDP does to free a sharded parameter."""
    tensor.untyped_storage().resize_(keep_bytes)
    return tensor


def _fake(tensor: torch.Tensor) -> torch.Tensor:
    """A FakeTensor (torch.compile's tracing tensors): a shape and a dtype, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(tensor)


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")  # making them
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # torch's, should anything ask
def test_unstorable_tensors_raise_invalid_experience_error(kind):
    from broker.data.codec import as_tensor

    as_rows = (lambda v: encode_rows([v]), lambda v: encode_rows([torch.zeros(1), v]))
    as_tensors = (lambda v: encode(as_tensor(v)), lambda v: encode_stacked(as_tensor(v)))
    for encode_it in as_tensors if kind in AS_VALUES else as_tensors + as_rows:
        with pytest.raises(InvalidExperienceError):
            encode_it(UNSTORABLE[kind]())


#: Not tensors, but plain values: a list of rows stores them as values (msgpack), which read back equal.
AS_VALUES = {
    "string": "abc", "numpy scalar": 1.5, "python int": 3, "python float": 1.5, "python bool": True,
    "bytes": b"abc", "None": None, "numpy object": [1, "a"], "numpy unicode": ["ab", "c"],
}


@pytest.mark.parametrize("kind", sorted(AS_VALUES))
def test_rows_that_are_not_tensors_are_stored_as_values(kind):
    rows = encode_rows([torch.zeros(2), UNSTORABLE[kind]()])
    back = decode_rows(rows, where="k", fields=["0", "1"])
    assert torch.equal(back[0], torch.zeros(2))
    assert back[1] == AS_VALUES[kind] and type(back[1]) is type(AS_VALUES[kind])


REFUSALS = {  # what a refusal must name, for each entry point
    "meta": "meta device",
    "sparse COO": "sparse_coo",
    "sparse CSR": "sparse_csr",
    "nested": "nested tensor",
    "quantized": "torch.qint8 is not supported",
    "complex32": "torch.complex32 is not supported",
    "float8 fnuz": "torch.float8_e4m3fnuz is not supported",
    "float8 negated view": "not implemented for 'Float8_e5m2'",
    "numpy object": "numpy array of dtype object cannot be stored; use one of bool, uint8",
    "numpy structured": r"numpy array of dtype \[\('a', '<i4'\), \('b', '<f4'\)\] cannot be stored",
    "numpy datetime64": r"numpy array of dtype datetime64\[D\] cannot be stored",
    "numpy longdouble": "numpy array of dtype float128 cannot be stored",
    "numpy clongdouble": "numpy array of dtype complex256 cannot be stored",
    "numpy unicode": "numpy array of dtype <U2 cannot be stored",
    "numpy scalar": "expected a torch.Tensor, got numpy.float32",
    "python int": "expected a torch.Tensor, got int",
    "None": "expected a torch.Tensor, got NoneType",
    "freed storage": "storage holds 0 bytes, its shape needs 24",
    "storage shrunk under a view": "storage holds 16 bytes, its shape needs 64",
    "fake tensor": "FakeTensor",
    "mkldnn": "_mkldnn",
}


@pytest.mark.parametrize("kind", sorted(k for k in REFUSALS if k in UNSTORABLE))
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_refusals_name_what_is_wrong_and_which_row(kind):
    from broker.data.codec import as_tensor

    message = REFUSALS[kind]
    with pytest.raises(InvalidExperienceError, match=message):
        encode(as_tensor(UNSTORABLE[kind]()))
    if kind not in AS_VALUES:
        with pytest.raises(InvalidExperienceError, match=f"^row 2: .*{message}"):
            encode_rows([torch.zeros(2), np.zeros(2, dtype=np.float32), UNSTORABLE[kind]()])
    if kind not in ("numpy scalar", "python int", "None"):  # a stacked column is one tensor or array
        with pytest.raises(InvalidExperienceError, match=message):
            encode_stacked(as_tensor(UNSTORABLE[kind]()))


def test_freed_storage_is_never_read():
    """A tensor whose storage was freed under it: torch's own .numpy() reads whatever memory lies there."""
    t = _freed(torch.full((1 << 16,), 7.0))
    with pytest.raises(InvalidExperienceError, match="storage"):
        encode_rows([t])
    base = torch.arange(32.0)
    row, stacked = base[8:24], base[8:24].view(4, 4)  # start inside what is left of the storage, end past it
    _freed(base, keep_bytes=64)
    with pytest.raises(InvalidExperienceError, match="row 0: .*storage holds 64 bytes, its shape needs 96"):
        encode_rows([row])
    with pytest.raises(InvalidExperienceError, match="storage holds 64 bytes, its shape needs 96"):
        encode_stacked(stacked)


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
    "negative stride axis 1": lambda: np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::-1],
    "big-endian, reversed, strided": lambda: np.arange(24, dtype=">i8").reshape(4, 6)[::-1, ::3],
    "read-only big-endian": lambda: np.frombuffer(np.arange(4, dtype=">i4").tobytes(), dtype=">i4"),
    "read-only 2-d": lambda: _read_only(np.arange(6.0).reshape(2, 3)),
    "broadcast (stride 0)": lambda: np.broadcast_to(np.arange(3, dtype=np.int16), (4, 3)),
    "unaligned": lambda: np.frombuffer(bytearray(range(17)), dtype=np.int32, offset=1, count=4),
    "fortran order": lambda: np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "complex64": lambda: (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex64).reshape(2, 3),
    "big-endian complex64": lambda: (np.arange(4) - 0.5j).astype(">c8"),
    "complex128 strided": lambda: (np.arange(12) * 1j).reshape(3, 4)[:, ::-2],
    "uint16": lambda: np.array([0, 1, 65535, 40000], dtype=np.uint16).reshape(2, 2),
    "big-endian uint16, reversed": lambda: np.array([1, 2, 65535], dtype=">u2")[::-1],
    "uint32 past the signed range": lambda: np.array([[2**32 - 1, 2**31]], dtype=np.uint32),
    "uint64 past the signed range": lambda: np.array([2**64 - 1, 2**63, 0], dtype=np.uint64),
}


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@pytest.mark.parametrize("kind", sorted(STORABLE_NUMPY))
def test_numpy_arrays_torch_cannot_view_are_converted_and_stored(kind):
    from broker.data.codec import as_tensor

    array = STORABLE_NUMPY[kind]()
    expected = torch.from_numpy(np.array(array, dtype=array.dtype.newbyteorder("="), copy=True))
    for got in (decode(encode(as_tensor(array))), decode(encode_rows([array])[0])):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    if array.ndim:
        rows = encode_stacked(as_tensor(array))
        assert len(rows) == len(expected) and all(torch.equal(decode(r), e) for r, e in zip(rows, expected))
    if array.ndim > 1:  # a list of numpy rows, as put_experience passes it on
        rows = encode_rows(list(array))
        assert len(rows) == len(expected) and all(torch.equal(decode(r), e) for r, e in zip(rows, expected))


@pytest.mark.parametrize("make", [
    lambda: torch._neg_view(torch.arange(6.0).reshape(2, 3)),  # the lazy negation bit
    lambda: torch.arange(6.0).reshape(2, 3).conj(),  # a no-op on real tensors
    lambda: torch.ones(2, 3, requires_grad=True) * 2,
    lambda: torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)),
    lambda: torch.arange(3).expand(2, 3),
    lambda: torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).t(),
    lambda: (torch.arange(6.0) + 1j).reshape(2, 3).conj(),  # the lazy conjugation bit: numpy cannot view it
    lambda: torch._neg_view((torch.arange(6.0) - 2j).reshape(2, 3).conj()),  # both bits
    lambda: (torch.arange(6.0) + 1j).reshape(2, 3).conj().imag,  # a negated view of a complex tensor's part
    lambda: torch.arange(24.0).reshape(4, 6).to(torch.float8_e4m3fn).t(),
    lambda: torch.arange(24, dtype=torch.int32).reshape(4, 6).to(torch.uint16)[:, ::2],
], ids=["neg view", "conj of real", "requires grad", "parameter", "expanded", "bfloat16 transposed",
        "conj of complex", "neg and conj of complex", "imag of a conj", "float8 transposed",
        "uint16 strided"])
def test_lazy_and_strided_tensors_store_their_values(make):
    want = make().detach().resolve_conj().resolve_neg().contiguous()
    for got in (decode(encode(make())), decode(encode_rows([make()])[0])):
        assert got.dtype == want.dtype and bits(got) == bits(want)
    for rows in (encode_stacked(make()), encode_rows(list(make().unbind(0)))):
        assert bits(torch.stack([decode(r) for r in rows])) == bits(want)


def test_payload_is_aligned_for_every_dtype():
    for dtype in DTYPES.values():
        data = bytes(encode(random_tensor(dtype, (5,))))
        header_len = struct.unpack_from("<I", data, 4)[0]
        assert (len(data) - 5 * torch.empty((), dtype=dtype).element_size()) % 16 == 0
        assert header_len < 64


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=str)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_is_refused_by_name(dtype):
    for encode_it in (encode, lambda t: encode_rows([t]), encode_stacked):
        with pytest.raises(InvalidExperienceError, match=f"dtype {dtype} is not supported"):
            encode_it(torch.zeros(3, dtype=dtype))


#: Dtypes TransferQueue 0.1.11 stores beyond the first ten the broker took (tests/adapters/test_tq_differential.py puts
#: complex64, uint16 and float8_e4m3fn rows through both); their wider and sibling dtypes come with them.
TRANSFER_QUEUE_DTYPES = ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128")
#: numpy has no bfloat16 and no float8: numpy arrays of the others go in as they are.
NUMPY_HAS = [d for d in DTYPES.values() if d not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)]


def test_the_dtypes_transfer_queue_stores_are_supported():
    """The parametrised tests above run over DTYPES: a dtype falling out of it would silently drop its tests."""
    assert set(TRANSFER_QUEUE_DTYPES) <= set(DTYPES)


@pytest.mark.parametrize("name, payload, want", [
    ("uint16", struct.pack("<3H", 0, 1, 65535), torch.tensor([0, 1, 65535], dtype=torch.int32)),
    ("uint32", struct.pack("<2I", 2**32 - 1, 7), torch.tensor([2**32 - 1, 7], dtype=torch.int64)),
    ("uint64", struct.pack("<2Q", 2**64 - 1, 2**63), None),
    ("float8_e4m3fn", bytes([0x38, 0x40, 0xB8, 0x7E]), torch.tensor([1.0, 2.0, -1.0, 448.0])),
    ("float8_e5m2", bytes([0x3C, 0x40, 0xBC, 0x7B]), torch.tensor([1.0, 2.0, -1.0, 57344.0])),
    ("complex64", struct.pack("<4f", 1.5, -2.0, 0.0, 3.0), torch.tensor([1.5 - 2j, 3j], dtype=torch.complex64)),
    ("complex128", struct.pack("<2d", -0.25, 1e300), torch.tensor([-0.25 + 1e300j], dtype=torch.complex128)),
])
def test_the_newer_dtypes_have_our_wire_names_and_little_endian_payloads(name, payload, want):
    """Bytes written by hand, as another implementation of the format would write them."""
    got = decode(_frame([name, [len(payload) // torch.empty((), dtype=DTYPES[name]).element_size()]], payload))
    assert got.dtype == DTYPES[name] and bytes(bits(got)) == payload
    if want is not None:  # compared in a dtype every torch op takes (float8 has no torch.equal)
        assert torch.equal(got.to(torch.complex128 if got.is_complex() else torch.float64), want.to(torch.complex128
                           if want.is_complex() else torch.float64))
    else:
        assert got.view(torch.int64).tolist() == [-1, -(2**63)]
    assert encode(got) == _frame([name, list(got.shape)], payload)


@pytest.mark.parametrize("value", [
    {"x": np.ones(2, dtype=np.complex64)}, [np.complex128(1 + 2j)], np.complex64(1j),
], ids=["array in a dict", "scalar in a list", "scalar"])
def test_complex_numbers_in_a_value_are_refused_by_name(value):
    """msgpack has no complex numbers: a complex array is a row of its own, never part of a value."""
    with pytest.raises(InvalidExperienceError, match=r"of dtype complex(64|128) cannot be stored in a value"):
        encode_rows([value])


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
    with pytest.raises(InvalidExperienceError, match="row 1: dtype torch.float8_e4m3fnuz is not supported"):
        encode_rows([torch.zeros(2), torch.zeros(2, dtype=torch.float8_e4m3fnuz)])
    with pytest.raises(InvalidExperienceError, match="row 0: a object cannot be stored in a value"):
        encode_rows([np.array([object()])])
    with pytest.raises(InvalidExperienceError, match="row 2: a set cannot be stored in a value"):
        encode_rows([torch.zeros(1), torch.zeros(1), {"junk"}])


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


def test_decode_reads_any_memoryview_as_its_bytes():
    data = encode(torch.arange(10, dtype=torch.int32))
    want = torch.arange(10, dtype=torch.int32)
    interleaved = np.frombuffer(bytes(b for x in data for b in (x, 0xFF)), dtype=np.uint8)
    views = {
        "non-contiguous": memoryview(interleaved[::2]),
        "cast to u32": memoryview(bytearray(data)).cast("I").toreadonly(),
        "2-d": memoryview(np.frombuffer(data, dtype=np.uint8).reshape(len(data) // 8, 8)),
        "read-only": memoryview(data),
    }
    assert len(data) % 4 == 0 and len(data) % 8 == 0
    for name, view in views.items():
        got = decode(view, where=name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        got.fill_(-1)  # writable, and the caller's bytes are not
        assert bytes(view.cast("B") if view.c_contiguous else view.tobytes()) == data, name
    writable = bytearray(data)
    decode(memoryview(writable).cast("I"))[0] = 99  # a writable memoryview is viewed, as a bytearray is
    assert decode(bytes(writable))[0].item() == 99
    with pytest.raises(DecodeError, match="too short"):
        decode(memoryview(interleaved[:12:2]))


def test_writing_into_decoded_rows_changes_nothing_else():
    values = [encode(t) for t in (
        torch.arange(5, dtype=torch.int64), torch.arange(5, dtype=torch.int64) + 10,
        torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([True, False]), torch.zeros(0),
        torch.arange(7, dtype=torch.int16).reshape(7, 1), torch.arange(5, dtype=torch.int64) + 20,
    )]
    values = values + values  # the second half runs on cached prefixes
    before = [bytes(v) for v in values]
    rows = decode_rows(values, where="k", fields=[str(i) for i in range(len(values))])
    want = [decode(v).clone() for v in values]
    for i, row in enumerate(rows):
        assert row.is_contiguous() and not row.is_inference()
        row.view(-1).view(torch.uint8).fill_(1 if row.dtype is torch.bool else 0xAB)
        want[i] = row.clone()
        assert all(torch.equal(r, w) for r, w in zip(rows, want)), f"writing row {i} changed another row"
    assert [bytes(v) for v in values] == before
    assert all(torch.equal(decode(v), decode(b)) for v, b in zip(values, before))


# -- through a dock, on every backend ----------------------------------------------------------------------


@pytest.mark.parametrize("stack", [False, True], ids=["lists", "stacked"])
@pytest.mark.parametrize("name", TRANSFER_QUEUE_DTYPES)
def test_the_newer_dtypes_round_trip_through_a_dock(make_dock, name, stack):
    dtype = DTYPES[name]
    put = {
        "whole": random_tensor(dtype, (4, 2, 3), seed=1),  # one tensor, split along dim 0 (encode_stacked)
        "rows": [random_tensor(dtype, (5,), seed=10 + i) for i in range(4)],  # a list of rows (encode_rows)
        "ragged": [random_tensor(dtype, (n, 2), seed=20 + n) for n in (3, 0, 1, 2)],  # jagged when stacked
        "scalars": random_tensor(dtype, (4,), seed=30),  # a 0-d tensor per row
    }
    want: dict[str, list[torch.Tensor]] = {column: list(rows) for column, rows in put.items()}
    if dtype in NUMPY_HAS:  # numpy arrays: a big-endian copy (converted first), and a list of numpy rows
        array = random_tensor(dtype, (4, 3), seed=40).numpy()
        put["numpy"], want["numpy"] = array.astype(array.dtype.newbyteorder(">")), list(torch.from_numpy(array))
        put["numpy rows"], want["numpy rows"] = list(array), list(torch.from_numpy(array))
    dock = make_dock(prompts_num=2, n=2, columns=[c.replace(" ", "_") for c in put])
    dock.put_experience({c.replace(" ", "_"): v for c, v in put.items()}, indexes=[0, 1, 2, 3])

    columns = [c.replace(" ", "_") for c in put]
    batch, got = dock.get_experience("actor_train", columns, 4, stack=stack)
    read = dock.read_rows(columns, [3, 1, 0, 2], stack=stack)
    for order, out in ((got, batch), ([3, 1, 0, 2], read)):
        assert sorted(order) == [0, 1, 2, 3]
        for column, rows in want.items():
            value = out[column.replace(" ", "_")]
            if not stack:
                assert isinstance(value, list)
            elif column == "ragged":
                assert value.is_nested and value.layout == torch.jagged and value.dtype == dtype
                value = value.unbind()
            else:
                assert isinstance(value, torch.Tensor) and not value.is_nested
                assert value.dtype == dtype and value.shape == (4, *rows[0].shape)
            assert len(value) == 4, column
            for i, row in zip(order, value):
                assert row.dtype == dtype and row.shape == rows[i].shape and bits(row) == bits(rows[i]), (column, i)
