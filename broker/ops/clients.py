"""The client of a URL as the docks of that URL share it, for the tools that work beside them on their server.

The benchmark reads the server's figures (memory, command counts) and runs its raw-Redis floor through this
client, so the floor pays the dock's client costs (its sockets, deadlines, retries and cluster pacing) and no
tool opens connections of its own beside the docks'.

- ``Client``: what a URL opens: one Redis server, or a Redis Cluster (any of whose nodes the URL may name).
- ``connect(url)``: ``(client, url)``, the client shared by everything of this process that names ``url``;
  given a client instead, ``(that client, None)``.
- ``disconnect(url)``: hand back what ``connect`` gave (the last one handed back closes it).
- ``redact(url)``: the URL with its password hidden, for logs and reports.
- ``send_gathered(sock, buffers)``: send buffers in order without joining them (``sendmsg``), as the broker's
  connections send a large value; the benchmark's bare RESP floor sends the same way, so it measures the
  wire and the server, not a slower send loop of its own.
"""

from __future__ import annotations

from broker.connection import Client, connect, disconnect, redact
from broker.connection.framing import send_gathered

__all__ = ["Client", "connect", "disconnect", "redact", "send_gathered"]
