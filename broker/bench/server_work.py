"""What one Redis server did during a pass: the commands it ran, the scripts among them, its CPU seconds.

The pipeline's wall times move by a tenth between runs of the same code on a shared 2-core machine; the
commands a pass makes do not move at all, and the server's CPU far less than the wall. So each pass also
reads ``INFO commandstats`` and ``INFO cpu`` before and after it (outside its timing), and the report gives
the medians per system beside the times: a change that saves commands or server time shows there even where
the wall times cannot tell it from noise.

``commands`` counts what commandstats counts: the commands a script calls and those a MULTI queued each
count too, beside the script call or the EXEC itself. ``INFO`` (the readings themselves) is left out. On a
server other clients use, their commands are counted as well: the figures are exact on the benchmark's own
private server. A cluster is not read here (``broker bench --cluster`` accounts per primary).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from broker.ops.clients import Client

#: What the client sends that commandstats charges once: the scripts (their inner commands included). SCRIPT
#: LOAD, which a client sends to every primary on first use, is setup, not work per batch: left out.
SCRIPT_COMMANDS = ("evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro")


def server_cpu(client: Client) -> float:
    """The server process's CPU seconds so far, user and system, every thread (``INFO cpu``)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


@dataclass(frozen=True)
class Reading:
    """Commandstats calls by command, and the server's CPU seconds, at one moment."""

    calls: dict[str, int]
    cpu_seconds: float


@dataclass(frozen=True)
class Work:
    """What the server did between two readings."""

    commands: int
    scripts: int
    cpu_seconds: float


class ServerWork:
    """Readings of one standalone server (``reading``), and the work between two (``between``)."""

    def __init__(self, client: redis.Redis | None):
        self._client = client

    @classmethod
    def of(cls, url: str) -> ServerWork:
        """The server at ``url``; one that cannot be read this way (a cluster, no INFO granted) reads as None."""
        try:
            client = redis.Redis.from_url(url)
            if str(client.info("cluster").get("cluster_enabled", 0)) == "1":
                client.close()
                return cls(None)
        except (redis.RedisError, ValueError):
            return cls(None)
        return cls(client)

    def reading(self) -> Reading | None:
        if self._client is None:
            return None
        stats = self._client.info("commandstats")
        calls = {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()}
        return Reading(calls, server_cpu(self._client))

    @staticmethod
    def between(before: Reading | None, after: Reading | None) -> Work | None:
        if before is None or after is None:
            return None
        done = {name: calls - before.calls.get(name, 0) for name, calls in after.calls.items() if name != "info"}
        return Work(sum(done.values()), sum(n for name, n in done.items() if name in SCRIPT_COMMANDS),
                    after.cpu_seconds - before.cpu_seconds)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def medians(works: Sequence[Work | None]) -> dict[str, Any] | None:
    """Per pass, the median of each figure; None if the server was not read."""
    known = [w for w in works if w is not None]
    if not known:
        return None
    return {"commands": statistics.median(w.commands for w in known),
            "scripts": statistics.median(w.scripts for w in known),
            "cpu_seconds": statistics.median(w.cpu_seconds for w in known)}
