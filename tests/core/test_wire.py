"""Large puts: values framed from the tensors' own memory (connection/framing.py) and sent in slices of whole
groups (data/slices.py), on every kind of server and connection, with every guarantee of a put kept."""

from __future__ import annotations

import socket
import threading

import fakeredis
import pytest
import redis
import torch

from broker import TransferDock
from broker.connection import Framed, frames
from broker.connection.framing import LARGE, send_gathered
from broker.control.scripts import Fence, Finish, runs_of
from broker.control.scripts.functions import uses_functions
from broker.control.scripts.loader import SCRIPT_FILES, script_text
from broker.data import slices as slices_module
from broker.data.requests import PutRequest
from broker.data.slices import slices
from broker.errors import FencedError, QuotaExceededError
from tests.helpers import after_first_slice, bits, lose_next_reply, random_tensor, small_dock
from tests.ops.test_security import _certificates

SEQ = LARGE // 4 * 2  # float32 rows of 32 KiB: framed


def _batch(rows: int, columns=("a", "b"), seed: int = 0) -> dict[str, torch.Tensor]:
    return {c: random_tensor(torch.float32, (rows, SEQ), seed=seed + i) for i, c in enumerate(columns)}


def _same(dock: TransferDock, data: dict[str, torch.Tensor], rows: list[int]) -> None:
    got = dock.read_rows(list(data), rows)
    for col, tensor in data.items():
        for i, row in enumerate(rows):
            assert bits(got[col][i]) == bits(tensor[i]), (col, row)


@pytest.fixture(params=["real", "redis62", "cluster", "fake", "unix"])
def where(request, tmp_path):
    """A URL (the broker opens the client: framing on), or fakeredis (joined bytes), or a unix socket."""
    if request.param == "fake":
        return fakeredis.FakeRedis(server=fakeredis.FakeServer())
    if request.param == "unix":
        from broker.ops.local_redis import RedisServer

        server = RedisServer(unix=True)
        server.start(15)
        request.addfinalizer(lambda: (server.stop(), server.close()))
        return server.url
    if request.param == "cluster":
        request.getfixturevalue("cluster_admin")
        return request.getfixturevalue("cluster_url")
    return request.getfixturevalue("redis62_url" if request.param == "redis62" else "real_url")


@pytest.mark.real
def test_a_large_put_in_slices_reads_back_bit_for_bit(where, monkeypatch):
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 3 * 2 * 2 * SEQ * 4)  # three groups of 2 rows per slice
    with small_dock(where, "wire-roundtrip", prompts=8, n=2, columns=("a", "b", "c")) as dock:
        assert dock._session.frames == (not isinstance(where, fakeredis.FakeRedis))
        data = _batch(16)
        data["c"] = [torch.tensor([r]) for r in range(16)]  # small rows ride along, joined
        rows = list(range(15, -1, -1))  # out of order: slices follow the rows' order, not the call's
        dock.put_experience({k: v.flip(0) if isinstance(v, torch.Tensor) else v[::-1] for k, v in data.items()},
                            indexes=rows)
        _same(dock, {k: v for k, v in data.items() if k != "c"}, list(range(16)))
        batch, got = dock.get_experience("actor_train", ["a", "b", "c"], experience_count=16)
        assert sorted(got) == list(range(16))
        for i, row in enumerate(got):
            assert bits(batch["a"][i]) == bits(data["a"][row]) and batch["c"][i].item() == row
        dock.delete()


@pytest.mark.real
def test_framed_values_over_tls(tmp_path):
    """A TLS socket has no scatter-gather write: the framed command goes chunk by chunk."""
    from broker.ops.local_redis import RedisServer

    with RedisServer(tls=_certificates(tmp_path)) as server, small_dock(server.url, "wire-tls", 4, 2) as dock:
        assert dock._session.frames
        data = _batch(8, columns=("prompts",))
        dock.put_experience(data, indexes=list(range(8)))
        _same(dock, data, list(range(8)))


def test_a_client_made_elsewhere_gets_joined_bytes(real_url):
    """A user's own redis.Redis does not frame: the put joins the values, as it always did."""
    plain = redis.Redis.from_url(real_url)
    assert not frames(plain) and not frames(fakeredis.FakeRedis())
    with small_dock(plain, "wire-plain", 2, 2) as dock:
        assert not dock._session.frames
        data = _batch(4, columns=("prompts",))
        dock.put_experience(data, indexes=[0, 1, 2, 3])
        _same(dock, data, [0, 1, 2, 3])
        dock.delete()
    plain.close()


def test_slices_hold_whole_groups_and_split_what_the_scripts_record():
    n, rows = 4, list(range(4, 20))  # groups 1..4
    value = Framed((b"x" * 100,))
    put = PutRequest(
        {"a": {str(r): value for r in rows}}, runs_of(rows), {"len": list(rows)},
        Finish(tuple(r % 2 == 0 for r in rows), 7), Fence(3, b"".join(r.to_bytes(4, "big") for r in rows), "c", "t"),
        ack=True,
    )
    parts = slices(put, n, limit=2 * 4 * 100 + 50)  # two groups fit, not three
    assert [p.runs for p in parts] == [[4, 8], [12, 8]]
    assert [p.ack for p in parts] == [True, True]  # each slice ends the lease of its own rows
    assert parts[1].lengths == {"len": list(range(12, 20))}
    assert parts[1].finish == Finish(tuple(r % 2 == 0 for r in range(12, 20)), 7)
    assert parts[1].fence == Fence(3, b"".join(r.to_bytes(4, "big") for r in range(12, 20)), "c", "t")
    assert sorted(parts[1].encoded["a"], key=int) == [str(r) for r in range(12, 20)]
    assert slices(put, n, limit=10**9) == [put]
    # A group larger than the limit is a slice of its own; rows given out of their groups' order too.
    assert [p.runs for p in slices(put, n, limit=10)] == [[4, 4], [8, 4], [12, 4], [16, 4]]


@pytest.mark.real
def test_a_server_without_the_scripts_costs_one_slice_sent_twice(real_url, monkeypatch):
    """The first put of a dock on a server that lost the scripts (a restart, SCRIPT FLUSH; on Redis 7 the
    function library: FUNCTION FLUSH) was barred and sent again whole: 0.3 GB twice. Only its first slice is
    now. Lost between slices, the later ones are sent again with their request ids; before, a lost function
    library there was not recognised, and the put was run again whole with new ids (FencedError for a leased
    one whose first slice had landed and acked its rows)."""
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * 2 * SEQ * 4)  # one group (2 rows x 2 columns)
    admin = redis.Redis.from_url(real_url)
    functions = uses_functions(admin)

    def lose_scripts() -> None:
        admin.script_flush()
        if functions:
            admin.function_flush()

    with small_dock(real_url, "wire-noscript", prompts=6, n=2, columns=("a", "b")) as dock:
        data = _batch(12)

        def sent_by_put(flush: bool) -> int:
            dock.clear()
            if flush:
                lose_scripts()
            before = int(admin.info("stats")["total_net_input_bytes"])
            dock.put_experience(data, indexes=list(range(12)))
            return int(admin.info("stats")["total_net_input_bytes"]) - before

        texts = sum(len(script_text(name)) for name in SCRIPT_FILES)  # loaded again after the NOSCRIPT
        again = sent_by_put(flush=True) - sent_by_put(flush=False) - texts  # one slice (1/6), and a little
        assert again < 12 * 2 * SEQ * 4 / 2  # was: the whole put again
        _same(dock, data, list(range(12)))
        # Lost between slices: every later slice is barred, then sent again once.
        store = dock._session.store
        parts = slices(PutRequest({c: {str(r): v for r, v in zip(range(12), codec_rows(data[c]))} for c in data},
                                  runs_of(list(range(12))), {}), 2)
        lose_scripts()
        outcomes: list = [object()] * len(parts)
        store._put_slices(parts, [f"r{i}" for i in range(len(parts))], range(len(parts)), outcomes)
        assert outcomes == [None] * len(parts)
        dock.delete()
    admin.close()


def codec_rows(tensor: torch.Tensor) -> list:
    from broker.data import codec

    return codec.encode_stacked(tensor, framed=True)


@pytest.mark.real
def test_a_slice_refused_names_the_rows_that_landed(real_url, monkeypatch):
    """A delivery without a lease whose later rows were cleared since: the first slices land, the rest is
    refused, and the error says which rows are in."""
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)  # one group (2 rows x 1 column) per slice
    with small_dock(real_url, "wire-fenced", prompts=4, n=2, columns=("prompts", "out")) as dock:
        dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, indexes=list(range(8)))
        _, handed = dock.get_experience("actor_train", ["prompts"], experience_count=8)
        dock.clear(indexes=[6, 7])  # the last group: its slice is fenced off
        with pytest.raises(FencedError, match=r"rows \[0, 1, 2, 3, 4, 5\] of this put landed"):
            dock.put_experience({"out": _batch(8, columns=("out",))["out"]}, indexes=handed)
        assert dock.ready_rows(["out"])["out"].tolist() == [True] * 6 + [False] * 2
        dock.delete()


@pytest.mark.real
@pytest.mark.parametrize("sharded", [False, True], ids=["slices", "sharded"])
def test_a_leased_put_of_several_steps_gives_the_lease_its_own_deadline_back(real_url, monkeypatch, sharded):
    """claim.lua holds a leased put's lease to the put's time bound (call_timeout) while its steps run.
    Before: the deadline stayed there, so with ack=False, or when the put was refused (its first slice
    over the quota), a worker dying next had its rows back after 30 s, not the lease's own 5."""
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)
    with small_dock(real_url, "wire-hold", prompts=4, n=2, columns=("prompts", "out"),
                    shards=1 if sharded else 0) as dock:
        dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, indexes=list(range(8)))
        _, handed = dock.get_experience("actor_train", ["prompts"], experience_count=8, lease=5)
        leases = dock.client.zrange(dock.keys.leases("actor_train"), 0, -1, withscores=True)
        out = _batch(8, columns=("out",))
        dock.put_experience(out, indexes=handed, ack=False)
        assert dock.client.zrange(dock.keys.leases("actor_train"), 0, -1, withscores=True) == leases
        if not sharded:  # a sharded dock has no quota
            dock.set_quota(1)
            with pytest.raises(QuotaExceededError):
                dock.put_experience(out, indexes=handed, ack=False)
            assert dock.client.zrange(dock.keys.leases("actor_train"), 0, -1, withscores=True) == leases
        dock.delete()


@pytest.mark.real
def test_a_leased_put_in_slices_acks_every_row(real_url, monkeypatch):
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)
    with small_dock(real_url, "wire-leased", prompts=4, n=2, columns=("prompts", "out")) as dock:
        dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, indexes=list(range(8)))
        _, handed = dock.get_experience("actor_train", ["prompts"], experience_count=8, lease=30)
        out = _batch(8, columns=("out",))
        dock.put_experience(out, indexes=handed)  # each slice acks its rows
        _same(dock, out, list(handed))
        assert dock.status()["consumers"]["actor_train"]["leased"] == 0
        with pytest.raises(FencedError):  # acked: the delivery is over, a repeat is refused whole
            dock.put_experience(out, indexes=handed)
        dock.delete()


@pytest.mark.real
def test_a_slice_whose_reply_was_lost_is_not_written_twice(real_url, monkeypatch):
    """The reply of a slice's EXEC lost, another worker writes those rows, then the client resends every
    slice: the resend of the slice that landed keeps its hands off the other worker's bytes."""
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)
    with small_dock(real_url, "wire-lost", prompts=4, n=2, columns=("prompts",)) as dock, \
            small_dock(real_url, "wire-lost", prompts=4, n=2, columns=("prompts",)) as other:
        mine, theirs = _batch(8, columns=("prompts",)), _batch(8, columns=("prompts",), seed=9)

        def meanwhile() -> None:
            other.put_experience({"prompts": theirs["prompts"][2:4]}, indexes=[2, 3])

        with lose_next_reply("EXEC", between=meanwhile, every=2) as cuts:  # the third slice's (the first is a MULTI)
            dock.put_experience(mine, indexes=list(range(8)))
        assert cuts
        got = dock.read_rows(["prompts"], list(range(8)))["prompts"]
        assert bits(got[2]) == bits(theirs["prompts"][2]) and bits(got[3]) == bits(theirs["prompts"][3])
        assert all(bits(got[r]) == bits(mine["prompts"][r]) for r in (0, 1, 4, 5, 6, 7))
        dock.delete()


def test_send_gathered_resumes_after_partial_writes():
    """A small send buffer makes sendmsg write part of its buffers: what follows must resume exactly there."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = torch.randint(0, 256, (3_000_000,), dtype=torch.uint8).numpy()
    view = memoryview(payload)
    chunks = [b"head", *(view[i : i + 7001] for i in range(0, len(view), 7001)), b"", b"tail"]
    received = bytearray()

    def read() -> None:
        while len(received) < len(payload) + 8:
            received.extend(b.recv(65536))

    reader = threading.Thread(target=read)
    reader.start()
    send_gathered(a, chunks * 1)
    reader.join(30)
    a.close()
    b.close()
    assert bytes(received) == b"head" + payload.tobytes() + b"tail"


def test_framed_commands_are_the_bytes_redis_py_packs():
    """A put's pipeline framed here is byte for byte what redis-py would send of the joined values (field
    names encoded once for all commands, bytes, ints and floats as redis-py encodes them)."""
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer

    from broker.connection.framing import pack_many

    encoder = Encoder("utf-8", "strict", False)
    row = memoryview(bytes(range(256)) * 100)
    commands = [("HSET", f"k{c}", "0", Framed((b"p" * 32, row)), "1", b"small", "2", Framed((b"x" * 9,)), 3, 1.5)
                for c in range(3)]
    joined = [tuple(bytes(a) if isinstance(a, Framed) else a for a in command) for command in commands]
    theirs = b"".join(b"".join(PythonRespSerializer(1 << 16, encoder.encode).pack(*command)) for command in joined)
    assert b"".join(bytes(chunk) for chunk in pack_many(commands, encoder.encode)) == theirs


def test_plain_commands_are_packed_as_redis_py_packs_them():
    """Commands of plain arguments go to hiredis whole, one C call each: the bytes redis-py's own hiredis packing
    sends, short commands joined and long ones alone; anything else is left to redis-py (None)."""
    from redis.connection import Connection

    from broker.connection.framing import packed_plain

    redis_py = Connection()
    commands = [("HSET", "k", "0", b"p" * 7000, "1", b"small", 2, 1.5), ("HMGET", b"k", "0", "1", "2"),
                ("FCALL", "f", 1, "k", *(str(i) for i in range(300))), ("GET", "\u00e9t\u00e9")]
    for some in (commands, commands[:1], commands[1:2]):
        ours = packed_plain(some)
        assert ours is not None and b"".join(ours) == b"".join(redis_py.pack_commands(some))
    assert [len(chunk) > 6000 for chunk in packed_plain(commands)] == [True, False]  # the long HSET alone
    for other in (("SET", "k", bytearray(b"v")), ("SET", "k", memoryview(b"v")), ("CLIENT SETNAME", "x"),
                  (b"CONFIG GET", b"maxmemory"), ("SET", "k", None)):
        assert packed_plain([("GET", "k"), other]) is None


def test_framed_compares_and_joins_as_its_bytes():
    f = Framed((b"ab", memoryview(b"cd")))
    assert len(f) == 4 and bytes(f) == b"abcd" and f == b"abcd" and f == Framed((b"abcd",)) and f != b"abce"


def test_a_slice_carries_the_group_fields_of_its_groups():
    from broker.control.keys import group_field

    n, rows = 2, list(range(8))
    row_value, group_value = Framed((b"r" * 100,)), Framed((b"g" * 150,))
    encoded = {"out": {str(r): row_value for r in rows}, "image": {group_field(g): group_value for g in range(4)}}
    put = PutRequest(encoded, runs_of(rows), {})
    parts = slices(put, n, limit=2 * (2 * 100 + 150))  # two groups: their rows and their one image each
    assert [p.runs for p in parts] == [[0, 4], [4, 4]]
    assert [sorted(p.encoded["image"]) for p in parts] == [["g0", "g1"], ["g2", "g3"]]


@pytest.mark.real
def test_a_sliced_put_of_a_group_column_stores_one_field_per_group(real_url, monkeypatch):
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * 2 * SEQ * 4)  # about two groups per slice
    admin = redis.Redis.from_url(real_url)
    with small_dock(real_url, "wire-groups", prompts=6, n=2, columns=("image", "out"),
                    group_columns=["image"]) as dock:
        images = _batch(6, columns=("image",))["image"]
        rows = list(range(12))
        dock.put_experience({"image": [images[r // 2] for r in rows], "out": _batch(12, columns=("out",))["out"]},
                            indexes=rows)
        got = dock.read_rows(["image"], rows, stack=True)["image"]
        assert all(bits(got[r]) == bits(images[r // 2]) for r in rows)
        assert admin.hlen(dock.keys.data("image")) == 6
        dock.delete()
    admin.close()


@pytest.fixture(params=["real", "redis62"])
def server_url(request):
    return request.getfixturevalue("redis62_url" if request.param == "redis62" else "real_url")


@pytest.mark.real
def test_reads_receive_rows_straight_into_one_tensor(server_url, monkeypatch):
    """A stacked read on one server receives each column off the socket into one tensor (no reply bytes)."""
    from broker.data import stacking

    seen: list[int] = []
    original = stacking.receive_column
    monkeypatch.setattr(stacking, "receive_column", lambda *a, **k: seen.append(1) or original(*a, **k))
    with small_dock(server_url, "wire-receive", prompts=4, n=2, columns=("a", "b", "c")) as dock:
        data = _batch(8, columns=("a", "b"))
        data["c"] = [torch.tensor([r % 2 == 0, True]) for r in range(8)]  # bool: checked byte by byte, not received
        dock.put_experience(data, indexes=list(range(8)))
        got = dock.read_rows(["a", "b", "c"], list(range(8)), stack=True)
        assert seen and bits(got["a"]) == bits(data["a"]) and bits(got["b"]) == bits(data["b"])
        assert got["c"].tolist() == [[r % 2 == 0, True] for r in range(8)]
        batch, rows = dock.get_experience("actor_train", ["a", "c"], experience_count=8, stack=True)
        assert [bits(batch["a"][i]) for i in range(8)] == [bits(data["a"][r]) for r in rows]
        # A row of another length in the middle: the rows received so far go back to bytes, and the column
        # comes back as stack=True makes it of bytes: jagged; a row of another rank: the list.
        dock.put_experience({"b": [torch.ones(3)]}, indexes=[5])
        got = dock.read_rows(["b"], list(range(8)), stack=True)["b"].unbind()
        assert got[5].tolist() == [1.0, 1.0, 1.0]
        assert bits(got[4]) == bits(data["b"][4]) and bits(got[6]) == bits(data["b"][6])
        dock.put_experience({"b": [torch.ones(1, 3)]}, indexes=[5])
        got = dock.read_rows(["b"], list(range(8)), stack=True)["b"]
        assert isinstance(got, list) and got[5].tolist() == [[1.0, 1.0, 1.0]] and bits(got[0]) == bits(data["b"][0])
        # An unwritten row: the list, with None.
        dock.clear(indexes=[3])
        assert dock.read_rows(["a"], list(range(8)), stack=True)["a"][3] is None
        dock.delete()


@pytest.mark.real
def test_a_corrupt_row_received_is_given_back_as_in_the_list_form(real_url):
    from broker.errors import DecodeError

    admin = redis.Redis.from_url(real_url)
    with small_dock(real_url, "wire-corrupt", prompts=4, n=2, columns=("a",)) as dock:
        dock.put_experience(_batch(8, columns=("a",)), indexes=list(range(8)))
        admin.hset(dock.keys.data("a"), "6", b"TD\x01\x00" + b"\xff" * 40)
        with pytest.raises(DecodeError, match=r"field 6"):
            dock.get_experience("actor_train", ["a"], experience_count=8, stack=True)
        assert dock.status()["consumers"]["actor_train"]["consumed"] == 0  # every row given back
        admin.script_flush()  # the fence script lost: loaded again, and the read sent again (control/scripts/runner.py)
        admin.hset(dock.keys.data("a"), "6", admin.hget(dock.keys.data("a"), "7"))
        batch, rows = dock.get_experience("actor_train", ["a"], experience_count=8, stack=True)
        assert isinstance(batch["a"], torch.Tensor) and batch["a"].shape == (8, SEQ)
        dock.delete()
    admin.close()


def test_a_helper_thread_runs_under_the_calls_deadline():
    """The second lane of a put runs in a thread of its own: it must be cut at the call's deadline too."""
    from broker.connection import call_deadline, time_left
    from broker.connection.deadlines import in_thread

    seen: list[float | None] = []
    with call_deadline(5.0):
        work = in_thread(lambda: seen.append(time_left()))
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen[0] is not None and 0 < seen[0] <= 5.0
    plain = threading.Thread(target=lambda: seen.append(time_left()))
    plain.start()
    plain.join()
    assert seen[1] is None  # a thread's bounds are its own


@pytest.mark.real
def test_a_put_whose_first_slice_is_refused_sends_no_other(real_url, monkeypatch):
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)  # one group per slice
    admin = redis.Redis.from_url(real_url)
    with small_dock(real_url, "wire-first", prompts=4, n=2, columns=("prompts", "out")) as dock:
        dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, indexes=list(range(8)))
        _, handed = dock.get_experience("actor_train", ["prompts"], experience_count=8)
        dock.clear(indexes=[0, 1])
        admin.config_resetstat()
        with pytest.raises(FencedError, match="no slice of this put landed"):
            dock.put_experience({"out": _batch(8, columns=("out",))["out"]}, indexes=handed)
        assert int(admin.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)) == 1
        assert not dock.ready_rows(["out"])["out"].any()
        dock.delete()
    admin.close()


@pytest.mark.parametrize("leased", [True, False], ids=["leased", "producer"])
def test_a_put_in_slices_goes_on_from_the_slice_that_did_not_land_when_the_dock_grew(client, monkeypatch, leased):
    """Another process grows the dock between two slices: the later slices are refused (SCHEMA), and the
    session runs the put again under the grown schema. Before, whole, with new request ids: a leased put
    failed (FencedError "nothing was written") although its first slice had landed and acked its rows, and
    the rest were never written; a producer's first slice was applied twice (over another writer's bytes
    landed meanwhile). Now with the ids it had: the slices that landed are not written again."""
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * SEQ * 4)  # one group (2 rows x 1 column) per slice
    dock = small_dock(client, "wire-grown", prompts=4, n=2, columns=("prompts", "out"), shards=0)
    other = small_dock(client, "wire-grown", prompts=4, n=2, columns=("prompts", "out"), shards=0)
    mine, theirs = _batch(8, columns=("out",)), _batch(2, columns=("out",), seed=5)

    def meanwhile() -> None:
        other.put_experience({"out": theirs["out"]}, indexes=[0, 1])  # over what the first slice wrote
        other.grow(columns=["extra"])

    dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, indexes=list(range(8)))
    handed = dock.get_experience("actor_train", ["prompts"], experience_count=8, lease=30)[1] if leased else None
    after_first_slice(monkeypatch, dock, meanwhile)
    dock.put_experience(mine, indexes=handed if leased else list(range(8)))
    assert "extra" in dock.columns
    got = dock.read_rows(["out"], list(range(8)))["out"]
    assert [bits(t) for t in got[:2]] == [bits(t) for t in theirs["out"]]  # the first slice was not written again
    assert [bits(t) for t in got[2:]] == [bits(t) for t in mine["out"][2:]]
    if leased:
        assert dock.status()["consumers"]["actor_train"]["leased"] == 0
    dock.delete()
