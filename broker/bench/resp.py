"""A bare RESP2 connection for the large mode's Redis floor: commands framed around views of the arrays.

The fastest client path Python has: each command's framing (``*N``, ``$len`` lines) is built as small
bytes objects, the values go out as memoryviews of the tensors' own storage through ``socket.sendmsg``
(scatter-gather, no copy of payload in the client), and bulk replies are received straight into the
caller's buffers (``recv_into``). No retries, no pooling, no RESP3: a benchmark's yardstick, not a client.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from broker.ops.clients import send_gathered

CRLF = b"\r\n"

Value = bytes | memoryview


class RespError(RuntimeError):
    """The server answered a command with an error reply."""


def command_parts(args: Sequence[Value]) -> list[Value]:
    """A command's wire form as buffers: framing joined into small bytes, payload views passed through.

    Each value's ``$len`` line is joined with the previous value's trailing CRLF, so a row costs two
    buffers: its framing and its view.
    """
    parts: list[Value] = []
    head = b"*%d\r\n" % len(args)
    for arg in args:
        size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
        if size < 4096:  # small values (keys, field names) ride along in the framing
            head += b"$%d\r\n" % size + bytes(arg) + CRLF
            continue
        parts.append(head + b"$%d\r\n" % size)
        parts.append(arg)
        head = CRLF
    parts.append(head)
    return parts


class RespConnection:
    """One socket to the server of a ``redis://`` or ``unix://`` URL (password and db honoured)."""

    def __init__(self, url: str, timeout: float = 300.0):
        u = urlparse(url)
        if u.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(u.path)
        elif u.scheme == "redis":
            self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            raise ValueError(f"the raw floor speaks redis:// and unix:// only, not {u.scheme}://")
        self.sock.settimeout(timeout)
        self._buf = bytearray(1 << 18)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        if u.password:
            user = [unquote(u.username)] if u.username else []
            self.call([b"AUTH", *(s.encode() for s in user), unquote(u.password).encode()])
        db = (u.path or "/").strip("/") if u.scheme == "redis" else dict(
            p.split("=", 1) for p in u.query.split("&") if "=" in p).get("db", "")
        if db and db != "0":
            self.call([b"SELECT", db.encode()])

    def send(self, parts: list[Value]) -> None:
        """Send every buffer, in order, without joining them (scatter-gather, as the broker's connections do)."""
        send_gathered(self.sock, [memoryview(p).cast("B") for p in parts if len(p)])

    def call(self, args: Sequence[Value]) -> Any:
        self.send(command_parts(args))
        return self.reply()

    # -- replies ------------------------------------------------------------------------------------

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        # A little at a time: what follows a bulk's length line is its payload, which _read_into receives
        # straight into its destination; read here, it would be copied once more.
        got = self.sock.recv_into(self._view[self._end : self._end + 512])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        """``len(dest)`` payload bytes into ``dest`` (what is buffered, then straight from the socket)."""
        size = dest.nbytes
        take = min(size, self._end - self._start)
        dest[:take] = self._view[self._start : self._start + take]
        self._start += take
        while take < size:
            got = self.sock.recv_into(dest[take:])
            if not got:
                raise ConnectionError("the server closed the connection")
            take += got
        while self._end - self._start < 2:
            self._fill()
        self._start += 2  # the bulk's CRLF

    def reply(self, into: Callable[[int, int], memoryview | None] | None = None) -> Any:
        """One reply. For an array of bulks, ``into(i, size)`` may return the buffer element i goes to
        (None: a new bytearray); bulks outside arrays always get a new bytearray."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return int(rest) if kind == b":" else rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b"$":
            return self._bulk(int(rest), None)
        if kind == b"*":
            return [self._element(i, into) for i in range(int(rest))]
        raise RespError(f"unexpected reply {line[:40]!r}")

    def _element(self, i: int, into: Callable[[int, int], memoryview | None] | None) -> Any:
        line = self._line()
        if line[:1] != b"$":
            raise RespError(f"expected a bulk string in the array, got {line[:40]!r}")
        size = int(line[1:])
        return self._bulk(size, into(i, size) if into and size >= 0 else None)

    def _bulk(self, size: int, dest: memoryview | None) -> Any:
        if size < 0:
            return None
        if dest is None:
            out = bytearray(size)
            self._read_into(memoryview(out))
            return out
        self._read_into(dest)
        return dest

    def close(self) -> None:
        self.sock.close()
