"""The leases family: what becomes of rows after they were handed out.

- lua/fence.lua: the epoch and generations of rows, which say whether a clear took them away since they
  were handed out (``fence`` after a read, ``fence_holds`` to judge it; ``fence_now`` for a sharded put);
- lua/ack.lua: end a lease, the consumer done with its rows (``ack``);
- lua/release.lua: give back rows a call could not deliver, and count failed deliveries (``release``);
- lua/reclaim.lua: give back expired leases (``reclaim``);
- lua/reset.lua: make rows available to a consumer again (``reset``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.client import Pipeline

from broker.control.scripts.base import ScriptsBase
from broker.control.scripts.loader import REPLY_TTL_MS
from broker.control.scripts.results import Handout, Released, numbers_of


class LeaseScripts(ScriptsBase):
    """Wrappers of the scripts that follow a hand-out: fence, ack, release, reclaim, reset."""

    def fence(self, pipe: Pipeline, runs: Sequence[int]) -> None:
        """Queue the read of the epoch and generations of ``runs``, after the reads of their bytes.

        ``fence_holds`` judges the reply. Epoch and generations only ever grow, so if they are unchanged
        after the bytes were read, no clear touched the rows from the handout until then: the check need
        not share a MULTI with the reads (Redis refuses every MULTI on a full server; plain reads pass).
        """
        self._queue(pipe, "fence", *self._fence_args(runs))

    def fence_command(self, runs: Sequence[int]) -> tuple[Any, ...]:
        """The command ``fence`` queues, for a caller that sends its commands itself (connection/replies.py)."""
        keys, args = self._fence_args(runs)
        return self._command("fence", keys, args)

    def fence_now(self, runs: Sequence[int]) -> tuple[int, bytes]:
        """The epoch and generations of ``runs`` now (4 bytes per row, in run order): what a put on a
        sharded dock writes its bytes under."""
        epoch, generations = self._call("fence", *self._fence_args(runs))
        return int(epoch), bytes(generations)

    def _fence_args(self, runs: Sequence[int]) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of lua/fence.lua for ``runs``."""
        k = self._keys
        return [k.meta, k.epoch, k.generations], [self._expected, *runs]

    @staticmethod
    def fence_holds(reply: Any, handout: Handout) -> bool:
        """Whether no clear touched the handout's rows between handing them out and the fence's read."""
        return int(reply[0]) == handout.epoch and reply[1] == handout.generations

    def release(
        self, consumer: str, handout: Handout, token: str, request_id: str, *, groups: bool = False,
        unreadable: Mapping[int, str] | None = None,
    ) -> Released:
        """Give back the rows a call (``request_id``) handed out but could not deliver; count a failed
        delivery of each ``unreadable`` row (row -> why), and make a dead letter of one that failed as
        often as the dock allows (its whole group if ``groups``: see lua/release.lua)."""
        k = self._keys
        keys = [k.meta, *self._consumer_keys(consumer), k.epoch, k.generations, k.reply(request_id),
                k.failures(consumer), k.dead(consumer), k.group_remnant(consumer)]
        bad = [x for row, why in (unreadable or {}).items() for x in (row, why)]
        args = [self._expected, self._n, handout.epoch, handout.generations, token, REPLY_TTL_MS,
                "groups" if groups else "rows", len(bad) // 2, *bad, *handout.runs]
        reply = self._call("release", keys, args)
        return Released(int(reply[0]), numbers_of(reply[1]), numbers_of(reply[2]))

    def ack(self, consumer: str, token: str, rows: Sequence[int]) -> int:
        """Release rows of ``consumer`` leased under ``token``; returns how many were."""
        k = self._keys
        return int(self._once("ack", [k.meta, k.leases(consumer), k.tokens(consumer)], [self._expected, token, *rows]))

    def reclaim(self, consumer: str, all_leases: bool = False) -> tuple[int, int]:
        """Give back ``consumer``'s expired leases (every lease with ``all_leases``); returns (rows consumed,
        rows still leased)."""
        keys = [self._keys.meta, *self._consumer_keys(consumer), self._keys.redelivered(consumer),
                self._keys.group_remnant(consumer)]
        consumed, leased = self._call("reclaim", keys, [self._expected, self._n, *(["all"] if all_leases else [])])
        return int(consumed), int(leased)

    def reset(self, consumer: str, rows: Sequence[int]) -> int:
        """Make ``rows`` (all when empty) available to ``consumer`` again; returns how many were handed out."""
        keys = [self._keys.meta, *self._consumer_keys(consumer), self._keys.group_remnant(consumer)]
        return int(self._once("reset", keys, [self._expected, self._n, *rows]))
