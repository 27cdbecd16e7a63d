"""The largest value a server takes in one command argument (``value_limit``, read once per client), and the
puts sent without knowing it (``sizes_unchecked``), whose commands the bounded connections (sockets.py) watch;
a put's encoded values checked against it before anything is sent (``check_sizes``, ``unchecked_value``)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import redis

from broker.connection.client import Client
from broker.connection.deadlines import _bounds
from broker.connection.framing import Framed
from broker.errors import ExperienceTooLargeError

#: Redis's defaults for the two limits on one value sent to it, used where CONFIG GET is refused
#: (ACL users confined to a dock are not granted CONFIG: it would show them the server's settings).
DEFAULT_VALUE_LIMITS = {"proto-max-bulk-len": 512 * 1024 * 1024, "client-query-buffer-limit": 1024 * 1024 * 1024}

#: The least either limit may be set to (Redis refuses lower ones): a value this long fits on any server.
MIN_VALUE_LIMIT = 1024 * 1024 - 2


class ValueLimit(NamedTuple):
    """The largest value (bytes) a server takes in one command argument, and the setting that says so."""

    bytes: int
    setting: str
    read: bool  #: whether the server's settings were read; else Redis's defaults stand in for them


_value_limits: weakref.WeakKeyDictionary[Client, ValueLimit] = weakref.WeakKeyDictionary()


def value_limit(client: Client) -> ValueLimit:
    """The largest value the server takes in one command argument, and the setting that says so.

    Redis refuses a bulk longer than ``proto-max-bulk-len`` and closes a connection whose query buffer
    passes ``client-query-buffer-limit``; a big argument is read into the buffer whole, with its
    CRLF, so it must stay 2 bytes under that. Either way the request fails only after it was sent,
    and the client's retries send it again: so puts check sizes first. Read once per client. Where
    CONFIG GET is refused, Redis's defaults stand in (``read`` False), and a put's values longer than
    ``MIN_VALUE_LIMIT`` are sent under ``sizes_unchecked``.
    """
    known = _value_limits.get(client)
    if known is None:
        limits = dict(DEFAULT_VALUE_LIMITS)
        read = True
        for name in limits:
            try:
                reply: Any = client.config_get(name)
                limits[name] = int(reply[name])
            except (redis.ResponseError, ValueError, TypeError, KeyError):  # refused, unknown command, odd reply
                read = False
        limits["client-query-buffer-limit"] -= 2
        setting = min(limits, key=lambda name: limits[name])
        known = _value_limits[client] = ValueLimit(limits[setting], setting, read)
    return known


def check_sizes(encoded: Mapping[str, Mapping[str, bytes | Framed]], limit: int, setting: str) -> None:
    """Every encoded value of a put fits in one Redis value (``limit`` bytes, from server ``setting``)."""
    for col, values in encoded.items():
        for field, value in values.items():
            if len(value) > limit:
                raise ExperienceTooLargeError(
                    f"column {col!r}, row {field}: {len(value):,} bytes encoded, more than the {limit:,} "
                    f"the Redis server takes in one value ({setting}); nothing was written. Split the row, "
                    f"or raise {setting} on the server"
                )


def unchecked_value(encoded: Mapping[str, Mapping[str, bytes | Framed]], limit: ValueLimit) -> str | None:
    """The largest value of a put if the server might refuse its size unseen (its limits could not be read,
    and it is longer than any server must take), described for an error message; else None."""
    if limit.read:
        return None
    values = ((len(v), c, f) for c, by_field in encoded.items() for f, v in by_field.items())
    size, col, field = max(values, default=(0, "", ""))
    return f"column {col!r}, row {field}: {size:,} bytes encoded" if size > MIN_VALUE_LIMIT else None


@contextlib.contextmanager
def sizes_unchecked(largest: str | None) -> Iterator[None]:
    """Send the block's commands knowing that a value of theirs may be over a limit of the server that could
    not be read (``largest`` describes the largest value; None: nothing unchecked, nothing changes).

    A command longer than ``MIN_VALUE_LIMIT`` whose connection the server closes while it is sent, or its
    replies read, is then not sent again if the server answers a new connection: the call raises
    ExperienceTooLargeError (see ``_Bounded._refused``). Clients passed in by the user are not watched.
    """
    saved = _bounds.unchecked
    _bounds.unchecked = largest
    try:
        yield
    finally:
        _bounds.unchecked = saved


def _unchecked_size(command: Any) -> int:
    """The length of a packed command sent under ``sizes_unchecked`` if over ``MIN_VALUE_LIMIT``, else 0."""
    if _bounds.unchecked is None:
        return 0
    size = len(command) if isinstance(command, (str, bytes)) else sum(len(chunk) for chunk in command)
    return size if size > MIN_VALUE_LIMIT else 0
