"""Replies read straight off the socket, large values into buffers the caller chose: a batch read at the wire's speed.

redis-py (with hiredis) turns every bulk reply into a new ``bytes`` object, and a reader that wants one
tensor per column copies each again: for a 0.3 GB read that was a third of the client's time twice over.
``exchange`` sends commands on one pooled connection of the caller's client and hands a ``RespReader``
to the caller, which reads the replies itself: small ones parsed as redis-py would (``reply``), a bulk
string's bytes received straight into a buffer the caller gives (``bulk_into``), e.g. its slice of a
freshly allocated tensor. Only for connections opened by ``broker.connection`` (``frames``) on one server;
anything else keeps the usual path.

A connection whose replies were not all read cannot serve another call: on any error it is closed
(``exchange``), and the error is redis-py's own (``ConnectionError``, ``TimeoutError``), so the caller's
usual retry and translation apply. Every socket read waits at most the call's time left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import (
    ExecAbortError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from broker.connection.deadlines import _expired, _passed, time_left

T = TypeVar("T")

_CHUNK = 1 << 16
#: Bytes read at a time for the small parts of replies (lines, short values).
_LINE = 1 << 16
#: How often (seconds) a read's socket timeout is set again to the call's time left.
_REBOUND = 0.05


class RespReader:
    """RESP2 replies from a socket, buffered for the small parts; large bulks received into given buffers."""

    def __init__(self, sock: Any, advance: Callable[[], None] = lambda: None):
        self._sock = sock
        self._advance = advance
        self._buf = bytearray(_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._bounded_at = -math.inf

    def advance(self) -> None:
        """The caller starts on the replies of the next unit of commands: send one more (see ``exchange``)."""
        self._advance()
        self._bounded_at = -math.inf  # the send restored the socket's own timeout: bound the next read again

    def _recv(self, into: memoryview) -> int:
        now = time.monotonic()
        if now - self._bounded_at > _REBOUND:  # a recv waits at most the time left, give or take _REBOUND
            left = time_left()
            if left is not None:
                if _expired():
                    raise _passed("reading a reply")
                self._sock.settimeout(left)
            self._bounded_at = now
        got: int = self._sock.recv_into(into)
        if not got:
            raise redis.ConnectionError("Connection closed by server.")
        return got

    def _fill(self) -> None:
        """At least one more byte in the buffer (the unread part moved to its front first)."""
        if self._start:
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        if self._end == len(self._buf):
            self._buf.extend(bytes(len(self._buf)))  # a line longer than the buffer: a long error message
            self._view = memoryview(self._buf)
        # A little at a time: what follows a bulk string's length line is its payload, which ``exactly``
        # receives straight into the caller's buffer; read here, it would be copied once more.
        self._end += self._recv(self._view[self._end : self._end + _LINE])

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._buf[self._start : at])
                self._start = at + 2
                return out
            self._fill()

    def exactly(self, into: memoryview) -> None:
        """Fill ``into`` with the next bytes: first from the buffer, then straight from the socket."""
        have = min(self._end - self._start, len(into))
        into[:have] = self._view[self._start : self._start + have]
        self._start += have
        at = have
        while at < len(into):
            at += self._recv(into[at:])

    def crlf(self) -> None:
        """The CRLF that ends a bulk string. Read through the buffer, with what follows it (the next reply's
        line, mostly): one system call for both, where receiving the two bytes alone cost one more per row."""
        while self._end - self._start < 2:
            self._fill()
        at = self._start
        self._start += 2
        if self._buf[at : at + 2] != b"\r\n":
            raise redis.ConnectionError(
                f"protocol error: expected CRLF after a bulk string, got {bytes(self._buf[at : at + 2])!r}")

    def array_length(self) -> int:
        """The length of the array reply that comes next; an error reply raises as redis-py's would."""
        head = self.line()
        if head[:1] in (b"*", b"~"):
            return int(head[1:])
        if head[:1] == b"-":
            raise _error(head[1:])
        raise redis.ConnectionError(f"protocol error: expected an array, got {head[:40]!r}")

    def bulk_length(self) -> int:
        """The length of the bulk string that comes next (-1: nil, in RESP2 or RESP3)."""
        head = self.line()
        if head[:1] == b"_":
            return -1
        if head[:1] != b"$":
            raise redis.ConnectionError(f"protocol error: expected a bulk string, got {head[:40]!r}")
        return int(head[1:])

    def reply(self) -> Any:
        """The next reply in full, as redis-py returns it undecoded; an error reply as its exception object.
        RESP2 and RESP3 (which the broker's clients speak where the server does)."""
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"+":
            return rest
        if kind in (b"-", b"!"):
            return _error(rest if kind == b"-" else self._bulk(int(rest)))
        if kind in (b":", b"("):
            return int(rest)
        if kind == b"_":
            return None
        if kind == b",":
            return float(rest)
        if kind == b"#":
            return rest == b"t"
        if kind in (b"$", b"="):
            size = int(rest)
            return None if size < 0 else self._bulk(size)[4 if kind == b"=" else 0 :]
        if kind in (b"*", b"~", b">"):
            size = int(rest)
            return None if size < 0 else [self.reply() for _ in range(size)]
        if kind == b"%":
            return {self.reply(): self.reply() for _ in range(int(rest))}
        if kind == b"|":  # attributes precede the reply they describe: skipped
            for _ in range(2 * int(rest)):
                self.reply()
            return self.reply()
        raise redis.ConnectionError(f"protocol error: unknown reply type {head[:40]!r}")

    def executed(self) -> Any:
        """The reply of an EXEC: the array of its commands' replies (errors as their exception objects), or the
        error saying the transaction did not run (EXECABORT), as an exception object."""
        return self.reply()

    def _bulk(self, size: int) -> bytes:
        out = bytearray(size)
        self.exactly(memoryview(out))
        self.crlf()
        return bytes(out)


def transaction(reader: RespReader, queued: int) -> int:
    """Read the replies of MULTI and of the ``queued`` commands it queued, up to the length of EXEC's array,
    whose ``queued`` replies follow; an error queuing a command (the transaction then not run) raises."""
    first: ResponseError | None = None
    for _ in range(queued + 1):
        reply = reader.reply()
        if isinstance(reply, ResponseError) and first is None:
            first = reply
    if first is not None:
        raise first
    return reader.array_length()


#: Error replies by their first word, as the classes redis-py's own parser makes of them: the broker's translation
#: (``translate.py``) tells an out-of-memory refusal (StoreFullError), a lost script and a denied command apart by
#: class, whichever reader read the reply.
_ERRORS: dict[str, type[ResponseError]] = {
    "NOSCRIPT": NoScriptError, "OOM": OutOfMemoryError, "NOPERM": NoPermissionError, "READONLY": ReadOnlyError,
    "EXECABORT": ExecAbortError,
}


def _error(message: bytes) -> ResponseError:
    text = message.decode("utf-8", "replace")
    return _ERRORS.get(text.split(" ", 1)[0], ResponseError)(text)


def exchange(client: redis.Redis, units: Sequence[Sequence[Sequence[Any]]], read: Callable[[RespReader], T]) -> T:
    """Send ``units`` (each a few commands) on one pooled connection of ``client`` (one server, connections
    opened here) and return what ``read`` makes of their replies, which it must read, all of them, from
    the reader, calling ``RespReader.advance`` as it starts on each unit's replies.

    The first unit is sent at once, then one more at each ``advance``: unit k+1 is sent as the caller starts
    on unit k's replies, and the server makes the next column of a get while the client receives this one.
    Sent all at once, every command of a large read reached the server in one read of its socket and it
    made every reply before the first was sent: the client waited, then the server did. A 0.3 GiB get of 10
    columns took 0.36 s so against 0.45 s (7.0.15; 0.34 against 0.43 s on 6.2); two units in flight gave
    0.43 / 0.36 s: more only make the server compete with the client for the cores.

    A unit is packed as it is sent, not before: a put in slices (data/slot_store.py) sends its first
    slice's bytes while the others are still to frame, and ``units`` may build each unit as it is asked
    for it.

    The units must be safe to send again (reads: a get's HMGETs and its fence; the slices of a put, whose
    kept replies say which landed): a connection lost or timed out before every reply was read is closed
    and the whole exchange made again on a new one, with the client's retry policy and within the call's
    deadline, as redis-py retries a pipeline; ``read`` must start over each time (a stacked get of rows
    already marked handed out would otherwise lose them)."""
    pool = client.connection_pool
    conn: Any = pool.get_connection()
    done = False

    def attempt() -> T:
        sent = 0

        def send_next() -> None:
            nonlocal sent
            if sent < len(units):
                conn.send_packed_command(conn.pack_commands(units[sent]), check_health=sent == 0)
                sent += 1

        send_next()
        sock = conn._sock
        try:
            return read(RespReader(sock, send_next))
        except TimeoutError as exc:  # socket.timeout: the call's time, or the socket's own, ran out
            if _expired():
                raise _passed(f"reading a reply ({exc})") from exc
            raise redis.TimeoutError("Timeout reading from socket") from exc
        except redis.ConnectionError as exc:
            if getattr(conn, "_sent_unchecked", 0):  # as the connection's own read_response (sockets.py)
                conn._refused(exc)
            raise
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from exc
        finally:
            if conn._sock is sock:
                sock.settimeout(conn.socket_timeout)

    try:
        # Replies may be left unread on a failed try's connection: closed, the next try opens a new one.
        out: T = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        done = True
        return out
    finally:
        if not done:
            conn.disconnect()
        pool.release(conn)
