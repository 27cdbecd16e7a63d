"""The bounded connections of the clients opened here (TCP, TLS, unix socket), and the errors they raise.

Each socket operation waits at most the call's time left (see deadlines.py); a TLS handshake is bounded by the
connect timeout, and its hopeless failures (a refused certificate, a port that does not speak TLS) are not
retried; a large command whose size the server refused is not sent again (see sizes.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection, HiredisRespSerializer
from redis.utils import SENTINEL

from broker.connection import framing
from broker.connection.client import Client
from broker.connection.deadlines import _DEADLINE_SLACK, _bounds, _expired, _passed
from broker.connection.sizes import _unchecked_size

#: The errors of a connection cut or timed out, as the cluster client's retry loops match them: by exact type.
_CUT = (redis.ConnectionError, redis.TimeoutError)


class _Hopeless(redis.RedisError):
    """A connection failure that trying again cannot mend: a certificate refused, a certificate file
    missing, TLS spoken to a port that does not speak it. Like ``_DeadlinePassed`` neither a redis-py
    ConnectionError nor a TimeoutError, so no retry loop repeats it; ``redis_errors`` reports it as a
    BrokerConnectionError at once."""


class _TooLarge(redis.RedisError):
    """The server closed the connection while a command too large to check was sent (see ``sizes_unchecked``),
    and answered on a new connection: it refused the size. Like ``_Hopeless``, no retry loop repeats it;
    ``redis_errors`` reports it as an ExperienceTooLargeError."""


class _Bounded(AbstractConnection):
    """Mixin of the connections of clients opened here: each socket operation bounded by the call's deadline.

    Under ``call_deadline`` a connect (TLS handshake included), a send, a read (the health-check PING's
    too) waits at most the time left, and one that finds none left, or times out at the deadline,
    closes the connection and raises ``_DeadlinePassed``. Under ``slow_reply`` the socket timeout grows
    by the allowance. Under ``sizes_unchecked`` a large command whose size the server refuses is not sent
    again (see ``_refused``). ``Framed`` arguments are sent from the caller's buffers (see framing.py).
    Otherwise each method is redis-py's own. (redis-py's methods are untyped: they are called through ``Any``.)
    """

    def pack_command(self, *args: Any) -> Any:
        conn: Any = self
        if framing.has_framed(args):
            return framing.pack(args, conn.encoder.encode)
        packed = framing.packed_plain((args,)) if isinstance(conn._command_packer, HiredisRespSerializer) else None
        if packed is not None:
            return packed
        base: Any = super()
        return base.pack_command(*args)

    def pack_commands(self, commands: Any) -> Any:
        commands = list(commands)
        conn: Any = self
        if any(framing.has_framed(command) for command in commands):
            return framing.pack_many(commands, conn.encoder.encode)
        packed = framing.packed_plain(commands) if isinstance(conn._command_packer, HiredisRespSerializer) else None
        if packed is not None:
            return packed
        base: Any = super()
        return base.pack_commands(commands)

    def _send_packed(self, command: Any, check_health: bool) -> None:
        """redis-py's ``send_packed_command`` (a ``sendall`` per chunk), but a command in many chunks (a framed
        one, or one with large values) goes as scatter-gather writes; socket errors translated as redis-py does."""
        base: Any = super()
        if isinstance(command, (str, bytes)) or len(command) <= 2:
            base.send_packed_command(command, check_health)
            return
        conn: Any = self
        if not conn._sock:
            self.connect_check_health(check_health=False)
        if check_health:
            conn.check_health()
        try:
            framing.send_gathered(conn._sock, command)
        except TimeoutError:  # socket.timeout
            conn.disconnect()
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            conn.disconnect()
            errno, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else exc.args[:2]
            raise redis.ConnectionError(f"Error {errno} while writing to socket. {message}.") from None
        except BaseException:
            conn.disconnect()  # part of the command may be sent: the connection cannot serve another
            raise

    def _op_timeout(self) -> float | None:
        """The next operation's socket timeout; None: the connection's own (no deadline, no allowance)."""
        deadlines, allowance = _bounds.deadlines, _bounds.allowance
        if not deadlines and not allowance:
            return None
        own = self._socket_timeout
        timeout = None if own is None else own + allowance
        if deadlines:
            left = deadlines[-1][0] - time.monotonic()
            if left <= _DEADLINE_SLACK:
                conn: Any = self
                conn.disconnect()  # a reply may be due on it: no later call must read it as its own
                raise _passed(f"no time left for a request to {conn._host_error()}")
            timeout = left if timeout is None else min(timeout, left)
        return timeout

    @contextlib.contextmanager
    def _cut_at_deadline(self) -> Iterator[None]:
        try:
            yield
        except _CUT as exc:
            if _expired():
                conn: Any = self
                conn.disconnect()
                raise _passed(f"{exc}") from exc
            raise

    def _connect(self) -> Any:
        base: Any = super()
        timeout = self._op_timeout()
        if timeout is None:
            return base._connect()
        # Opening the socket and a TLS handshake read these two; the parser reads the socket timeout only
        # after, so it keeps the connection's own.
        own, own_connect = self._socket_timeout, self._socket_connect_timeout
        self._socket_timeout = timeout
        self._socket_connect_timeout = timeout if own_connect is None else min(own_connect, timeout)
        try:
            sock = base._connect()
        finally:
            self._socket_timeout, self._socket_connect_timeout = own, own_connect
        sock.settimeout(own)  # as redis-py leaves it; every operation under a deadline sets its own
        return sock

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        conn: Any = self
        if conn._sock:  # connected: redis-py returns at once (asked at every command), no deadline to apply
            return
        base: Any = super()
        if self._op_timeout() is None:
            base.connect_check_health(check_health, retry_socket_connect)
            return
        with self._cut_at_deadline():
            base.connect_check_health(check_health, retry_socket_connect)

    #: Bytes of the last command sent, if it was one whose size could not be checked (see ``sizes_unchecked``).
    _sent_unchecked = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        conn: Any = self
        size = _unchecked_size(command)
        self._sent_unchecked = 0  # until the command itself is sent: the PING of a health check may come first
        if size:
            # A PING first, whenever it last answered: the server closing this connection while the command
            # is sent must mean it refused the command, not that it had dropped an idle connection.
            conn.next_health_check = -math.inf
        elif self._op_timeout() is None:
            self._send_packed(command, check_health)
            return
        with self._cut_at_deadline():  # without a deadline, it passes every error on
            # redis-py's own steps before the send (each bounded by its own operations), then the send.
            if not conn._sock:
                self.connect_check_health(check_health=False)
            if check_health:
                conn.check_health()
            sock, timeout = conn._sock, self._op_timeout()
            if timeout is not None:
                sock.settimeout(timeout)
            self._sent_unchecked = size
            try:
                self._send_packed(command, check_health=False)
            except redis.ConnectionError as exc:
                if size:
                    self._refused(exc)
                raise
            finally:
                if timeout is not None and conn._sock is sock:
                    sock.settimeout(self._socket_timeout)

    def read_response(self, disable_decoding: bool = False, *, timeout: Any = SENTINEL, **kwargs: Any) -> Any:
        base: Any = super()
        bound = self._op_timeout()
        if bound is not None and (timeout is SENTINEL or timeout is None or timeout > bound):
            timeout = bound  # the parser sets it on the socket for each read, then restores the own one
        try:  # what _cut_at_deadline does, inline: a pipeline reads a reply per command, on the hot path
            return base.read_response(disable_decoding, timeout=timeout, **kwargs)
        except _CUT as exc:
            if bound is not None and _expired():
                base.disconnect()
                raise _passed(f"{exc}") from exc
            if self._sent_unchecked and isinstance(exc, redis.ConnectionError):
                self._refused(exc)  # the server may close only once the command is in: its replies come first
            raise

    def _refused(self, exc: redis.ConnectionError) -> None:
        """After the connection failed while a command of unchecked size was sent, or its replies read: raise
        ``_TooLarge`` if the server answers a PING on a new connection; else return (the caller raises ``exc``).

        A server over a limit on one value (``proto-max-bulk-len``, ``client-query-buffer-limit``) closes the
        connection and goes on serving: sent again, the command would be refused again, each time only after
        all its bytes travelled. A server that is restarting, or unreachable, does not answer: the usual
        retries then go on (the command is safe to repeat). Only the socket is tried, once: no retries here.
        """
        size, self._sent_unchecked = self._sent_unchecked, 0
        conn: Any = self
        conn.disconnect()
        try:
            conn.connect_check_health(check_health=False, retry_socket_connect=False)
            conn.send_command("PING", check_health=False)
            conn.read_response()
        except redis.ResponseError:
            pass  # an answer all the same (a PING denied, say)
        except (redis.RedisError, OSError):  # not answering (or out of time): the failure was the connection's
            return
        finally:
            conn.disconnect()
        raise _TooLarge(
            f"closed the connection while a command of {size:,} bytes was sent, and answered on a new one: it "
            f"refused the size of {_bounds.unchecked}. A server closes the connection over a value longer than its "
            "proto-max-bulk-len, or a client's query buffer over its client-query-buffer-limit; the broker could not "
            "read them to check before sending (CONFIG GET is not granted to this user, or renamed). Nothing was "
            "marked ready, and the command was not sent again. Split the row, or raise the limit on the server"
        ) from exc


class _BoundedConnection(_Bounded, redis.Connection):
    """A TCP connection bounded by the call's deadline (see ``_Bounded``)."""


#: OpenSSL's reasons for a handshake answered by something that does not speak TLS.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "HTTP_REQUEST",
                      "UNKNOWN_PROTOCOL"})


class _BoundedSSLConnection(_Bounded, redis.SSLConnection):
    """A TLS connection bounded by the call's deadline (see ``_Bounded``), whose handshake is bounded by the
    connect timeout and whose hopeless failures (see ``_Hopeless``) are not retried.

    redis-py shakes hands under the socket timeout (60 s), and a plain Redis port answers a TLS hello
    with nothing (it waits for the rest of a command): each of the retries waited a minute. A refused
    certificate, or a certificate file that is not there, fails the same way every time.
    """

    def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
        conn: Any = self
        self._check_files()
        took = conn.socket_connect_timeout  # under a deadline, no longer than the time left (see _connect)
        sock.settimeout(took)
        try:
            wrapped = super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
        except ssl.SSLCertVerificationError as exc:
            raise _Hopeless(
                f"{self._where()} presented a certificate this client does not trust: {exc.verify_message}. "
                "Check ssl_ca_certs (the CA that signed the server's certificate) and the host name in the URL"
            ) from exc
        except TimeoutError as exc:  # the builtin: socket.timeout
            if _expired():
                raise _passed(f"TLS handshake with {self._where()}") from exc
            raise _Hopeless(
                f"{self._where()} did not complete a TLS handshake within {took} s (the connect timeout): is this "
                "port TLS? A server speaking plain Redis on it waits for the rest of a command (as a stalled one "
                "would); rediss:// needs the server's tls-port"
            ) from exc
        except ssl.SSLError as exc:
            if exc.library in ("PEM", "X509"):
                raise _Hopeless(f"the certificate files for {self._where()} could not be loaded: {exc}") from exc
            if exc.reason in _NOT_TLS:
                raise _Hopeless(f"{self._where()} did not answer in TLS ({exc.reason}): is this port TLS?") from exc
            raise
        wrapped.settimeout(conn.socket_timeout)
        return wrapped

    def _check_files(self) -> None:
        """Name a certificate file or folder that is not there (ssl only says "No such file or directory")."""
        conn: Any = self
        for setting, path in (("ssl_ca_certs", conn.ca_certs), ("ssl_ca_path", conn.ca_path),
                              ("ssl_certfile", conn.certfile), ("ssl_keyfile", conn.keyfile)):
            if isinstance(path, (str, os.PathLike)) and not os.path.exists(path):
                raise _Hopeless(f"{setting} {os.fspath(path)!r} for {self._where()}: no such file or folder")

    def _where(self) -> str:
        conn: Any = self
        return f"{conn.host}:{conn.port}"


class _BoundedUnixConnection(_Bounded, redis.UnixDomainSocketConnection):
    """A unix-socket connection bounded by the call's deadline (see ``_Bounded``)."""


#: redis-py's connection classes, and the bounded one that stands for each.
_BOUNDED: dict[type[Any], type[Any]] = {
    redis.Connection: _BoundedConnection,
    redis.SSLConnection: _BoundedSSLConnection,
    redis.UnixDomainSocketConnection: _BoundedUnixConnection,
}


def frames(client: Client) -> bool:
    """Whether ``client``'s connections send ``Framed`` arguments from their buffers (those opened by
    ``broker.connection``); a client made elsewhere (fakeredis, a user's own) needs joined bytes."""
    if isinstance(client, RedisCluster):
        pools = [node.redis_connection.connection_pool for node in client.get_nodes() if node.redis_connection]
        return bool(pools) and all(issubclass(pool.connection_class, _Bounded) for pool in pools)
    return issubclass(client.connection_pool.connection_class, _Bounded)
