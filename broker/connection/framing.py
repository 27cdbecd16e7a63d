"""Commands framed around the caller's buffers: a large value goes from its tensor to the socket uncopied.

redis-py (with hiredis) packs a command by copying every argument into one new buffer; for a put of
0.3 GB that copy took as long as sending it. A ``Framed`` argument is a bulk string given in pieces (a
tensor row's small header, then a memoryview of the tensor's own storage): the connections opened here
(``sockets._Bounded``) frame it with the RESP length line around the pieces, keep the large pieces as
they are, and send the whole command with scatter-gather writes (``socket.sendmsg``, up to
``_IOV_MAX`` buffers per system call). Small pieces are copied into the framing: below ``LARGE`` bytes
a copy costs less than another buffer to gather.

Commands with no ``Framed`` argument and only plain ones (bytes, str, int, float) are packed by hiredis, one
C call per command (``packed_plain``): redis-py's own hiredis packing first looks at every argument in Python,
and a put's HSET or a read's HMGET has one or two per row.

What the caller keeps: the buffers must not change until the call returns (a resend after a lost
connection frames them again); nothing here holds them afterwards. A connection that does not frame
(fakeredis's, or one not opened by ``broker.connection``) gets ``bytes(value)``: the copy it always made.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterable, Sequence
from typing import Any

from hiredis import pack_command as _hiredis_pack

#: Pieces at least this long are sent from where they are; shorter ones are copied into the framing.
LARGE = 16 * 1024
#: Commands packed are joined up to this many bytes per buffer (redis-py's buffer cutoff); longer ones go alone.
_JOIN_UP_TO = 6000
#: The argument types hiredis packs as they are, as redis-py hands them to it.
_PLAIN = frozenset({bytes, str, int, float})
#: Buffers per sendmsg call (Linux's IOV_MAX is 1024).
_IOV_MAX = 1024
_CRLF = b"\r\n"


class Framed:
    """One bulk-string argument given in pieces, sent without joining them (see the module docstring).

    ``len()`` is its length in bytes, ``bytes()`` the joined value (a copy: for clients that do not frame).
    """

    __slots__ = ("pieces", "nbytes")

    def __init__(self, pieces: tuple[bytes | memoryview, ...], nbytes: int | None = None):
        """``pieces``: bytes and byte-format (``"B"``) memoryviews; ``nbytes``, their total length, if known,
        or less: the value is then the first ``nbytes`` of them (a row's head, data/fit.py, shares its row's
        pieces rather than making views of its own)."""
        self.pieces = pieces
        self.nbytes = sum(len(p) for p in pieces) if nbytes is None else nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        joined = b"".join(self.pieces)
        return joined if len(joined) == self.nbytes else joined[: self.nbytes]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Framed):
            other = bytes(other)
        return isinstance(other, (bytes, bytearray, memoryview)) and bytes(self) == other

    __hash__ = None  # type: ignore[assignment]  # mutable buffers inside: not a dict key

    def __repr__(self) -> str:
        return f"Framed({self.nbytes} bytes in {len(self.pieces)} pieces)"


def has_framed(args: Iterable[Any]) -> bool:
    """Whether any argument is ``Framed``. (``in`` over the types compares them in C: every command is asked,
    a put's HSET holds two arguments per row, and a generator's step per argument cost more than packing.)"""
    return Framed in map(type, args)


def pack(args: Sequence[Any], encode: Any, names: dict[str, bytes] | None = None) -> list[bytes | memoryview]:
    """RESP of one command whose arguments may be ``Framed``: small parts joined, large pieces left as they
    are. ``encode`` turns any other argument into bytes (the connection's encoder); ``names``, if given, keeps
    what it made of each string (a put names the same row fields in every column's HSET)."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    add = small.append
    for arg in args:
        kind = type(arg)
        if kind is Framed:
            add(b"$%d\r\n" % arg.nbytes)
            left = arg.nbytes
            for piece in arg.pieces:
                if len(piece) >= left:  # the last piece sent: the value may end inside it
                    if not left:
                        break
                    if len(piece) > left:
                        piece = memoryview(piece)[:left]
                left -= len(piece)
                if len(piece) < LARGE:
                    add(piece)
                else:
                    out.append(b"".join(small))
                    out.append(piece)
                    small = []
                    add = small.append
            add(_CRLF)
            continue
        if kind is bytes:
            value = arg
        elif kind is str and names is not None:
            value = names.get(arg)
            if value is None:
                value = names[arg] = encode(arg)
        else:
            value = encode(arg)
        add(b"$%d\r\n" % len(value))
        add(value)
        add(_CRLF)
    out.append(b"".join(small))
    return out


def pack_many(commands: Iterable[Sequence[Any]], encode: Any) -> list[bytes | memoryview]:
    """RESP of several commands, each as ``pack`` frames it (its small parts already joined)."""
    out: list[bytes | memoryview] = []
    names: dict[str, bytes] = {}
    for command in commands:
        out += pack(command, encode, names)
    return out


def packed_plain(commands: Sequence[Sequence[Any]]) -> list[bytes] | None:
    """RESP of ``commands``, each packed by hiredis in one C call, consecutive short ones joined; None where an
    argument is not plain (``_PLAIN``) or a command's name holds a space (redis-py splits those): redis-py
    packs those. The same bytes as redis-py's hiredis packing, without its Python step per argument (a put's
    HSET and a read's HMGET have one or two per row)."""
    out: list[bytes] = []
    small: list[bytes] = []
    size = 0
    for args in commands:
        name = args[0] if args else None
        if not (type(name) is str and " " not in name or type(name) is bytes and b" " not in name):
            return None
        if not _PLAIN.issuperset(map(type, args)):
            return None
        packed = _hiredis_pack(tuple(args))
        if len(packed) > _JOIN_UP_TO:
            if small:
                out.append(b"".join(small))
                small, size = [], 0
            out.append(packed)
            continue
        small.append(packed)
        size += len(packed)
        if size > _JOIN_UP_TO:
            out.append(b"".join(small))
            small, size = [], 0
    if small:
        out.append(b"".join(small))
    return out


def send_gathered(sock: socket.socket, chunks: Sequence[bytes | memoryview]) -> None:
    """Send every chunk in order, ``_IOV_MAX`` buffers per system call, resuming after partial writes.

    A TLS socket has no scatter-gather write: it sends chunk by chunk. Errors are the socket's own
    (``socket.timeout``, ``OSError``): the connection translates them as for any send.
    """
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for chunk in chunks:
            sock.sendall(chunk)
        return
    pending = list(chunks)  # byte strings and byte-format views: len() is their length in bytes
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + _IOV_MAX])
        # Skip what went out: whole buffers, then a cut into the first one not finished.
        while first < len(pending) and sent >= len(pending[first]):
            sent -= len(pending[first])
            first += 1
        if sent:
            pending[first] = memoryview(pending[first])[sent:]
