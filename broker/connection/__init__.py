"""The connection layer, used by both planes: opening Redis clients from URLs, bounding every call by a deadline,
and turning redis-py errors into broker errors where they enter.

Each module holds one concern; each imports only those above it (no cycles):

- ``client.py``: ``Client``, what the broker talks to (one Redis server or a Redis Cluster).
- ``deadlines.py``: a call's bound, per thread: ``call_deadline``, ``extend_call``, ``waiting_call``,
  ``time_left``, ``slow_reply``, ``in_thread`` (a call's bound carried to a helper thread), and
  ``_DeadlinePassed``, the error of a call cut by it.
- ``sizes.py``: the largest value a server takes (``value_limit``), a put's values checked against it
  (``check_sizes``), and puts sent without knowing it (``sizes_unchecked``, ``unchecked_value``).
- ``framing.py``: ``Framed``, a large value sent from its own buffers (no copy into the command), and the
  scatter-gather send.
- ``replies.py``: replies read off a pooled connection by the caller, large values straight into its buffers
  (``exchange``, ``RespReader``).
- ``sockets.py``: the bounded connections (TCP, TLS and its handshake, unix socket), the errors they raise,
  and ``frames`` (whether a client's connections send ``Framed`` values uncopied).
- ``retries.py``: the backoff that ends at the deadline, and the reconnect retry (``default_retry``).
- ``pools.py``: a URL's pool (its hand-out retried, its wait bounded) and a cluster node's.
- ``urls.py``: a client's URL (``url_of``, its TLS query), what a URL cannot carry (``uncarried``), ``redact``.
- ``translate.py``: redis-py's errors as the broker's (``redis_errors``, ``bounded``), ``script_error``,
  ``elide_values``.
- ``cluster.py``: the paced cluster client and its opening (``CLUSTER_ATTEMPTS``); hash tags spread over the
  primaries (``spread_tags``).
- ``shared.py``: ``connect`` (the client shared per URL in a process), ``disconnect``, ``default_url``.
- ``fanout.py``: a batch of commands sent to every node of a cluster at once (the data plane's hot path).
- ``replication.py``: waiting for replicas to hold a call's writes.

The order, each line importing only from the lines above it::

    client
    deadlines
    framing
    sizes        <- client, deadlines, framing
    sockets      <- client, deadlines, sizes, framing
    retries      <- deadlines
    pools        <- deadlines, sockets
    urls         <- client, sockets
    translate    <- deadlines, sockets
    cluster      <- deadlines, sockets, retries, pools, urls, translate
    shared       <- client, deadlines, retries, pools, urls, translate, cluster
    fanout       <- client
    replies      <- deadlines
    replication  <- client, deadlines, fanout

This face re-exports what the rest of the broker imports from it; the package's own modules import from the
module that holds a name.
"""

from __future__ import annotations

from broker.connection.client import Client
from broker.connection.cluster import CLUSTER_ATTEMPTS, spread_tags
from broker.connection.deadlines import (
    DEFAULT_CALL_TIMEOUT,
    LAST_TRY_SECONDS,
    call_deadline,
    extend_call,
    time_left,
    waiting_call,
)
from broker.connection.framing import Framed
from broker.connection.retries import busy_retried, default_retry
from broker.connection.shared import connect, default_url, disconnect
from broker.connection.sizes import (
    MIN_VALUE_LIMIT,
    ValueLimit,
    check_sizes,
    sizes_unchecked,
    unchecked_value,
    value_limit,
)
from broker.connection.sockets import frames
from broker.connection.translate import bounded, elide_values, redis_errors, script_error
from broker.connection.urls import redact, uncarried

__all__ = [
    "CLUSTER_ATTEMPTS",
    "spread_tags",
    "DEFAULT_CALL_TIMEOUT",
    "LAST_TRY_SECONDS",
    "MIN_VALUE_LIMIT",
    "Client",
    "Framed",
    "ValueLimit",
    "bounded",
    "call_deadline",
    "connect",
    "busy_retried",
    "check_sizes",
    "default_retry",
    "default_url",
    "disconnect",
    "elide_values",
    "extend_call",
    "frames",
    "redact",
    "redis_errors",
    "script_error",
    "sizes_unchecked",
    "time_left",
    "unchecked_value",
    "uncarried",
    "value_limit",
    "waiting_call",
]
