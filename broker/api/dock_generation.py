"""The dock's verbs of partial rollout, policy versions and discarding groups.

A part of ``TransferDock``'s face (see dock.py): each verb with its user documentation, delegating to
``Generation`` (generation.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.api.delivery import HandedRows
from broker.api.generation import Generation


class GenerationVerbs:
    """Partial rollout, versions, the staleness bound's groups, drops: a base of ``TransferDock``."""

    _generation: Generation

    def age_groups(self) -> None:
        """Make every group holding a response, or its placeholder, one iteration older (the queue's
        ``increment_ages``; ``clear(consumer=...)`` ages only groups that were generated)."""
        self._generation.age_groups()

    def unready(self, columns: Sequence[str], indexes: Sequence[int]) -> int:
        """Mark rows of columns not ready, keeping their bytes (the TransferQueue's
        ``clear_data_status``); returns how many cells were ready."""
        return self._generation.unready(columns, indexes)

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """The stop signal of a partial-rollout iteration (MindSpeed's): at least ``gbs_train`` groups
        finished, and with ``require_max_age_all_finished`` every group of age ``max_age - 1``
        finished too, so no response waits more than ``max_age`` iterations."""
        return self._generation.get_update_ready(require_max_age_all_finished)

    def get_incomplete_response_num(self) -> int:
        """Rows holding a prompt whose response is not finished (MindSpeed's count): rows with a
        response or its placeholder, less the finished ones."""
        return self._generation.get_incomplete_response_num()

    def set_version(self, version: int) -> None:
        """Set the current policy version (the trainer, after each update); versions only grow."""
        self._generation.set_version(version)

    def version(self) -> int:
        """The current policy version (0 until ``set_version``). DataLostError if it was set and the server
        lost it since (see lua/include/current_version.lua): 0 would let stale rows through."""
        return self._generation.version()

    def reserve_groups(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups for new prompts, lowest first (None, claiming nothing, if fewer
        are free): a group is free when it is neither claimed nor written in ``column``, and stays
        claimed until it is forgotten. Writers calling at once never get the same group. Under partial
        rollout this is where the next batch goes: rows never move here, so the groups freed by
        ``clear(consumer=...)`` are wherever the trained ones were."""
        return self._generation.reserve_groups(count, column)

    def drop_groups(self, consumer: str, groups: Sequence[int], *, delivery: HandedRows | None = None) -> int:
        """Discard whole groups ``consumer`` rejects (DAPO's dynamic sampling: all n rewards equal):
        their rows are forgotten and free for new prompts at once, and they are counted under the
        consumer in ``status()["discarded"]``. Returns how many groups were dropped; a resend of the
        call after a lost reply drops and counts nothing twice.

        ``delivery``: the rows ``get_experience`` handed the consumer, which hold these groups. The drop
        is then fenced by it as a put is (FencedError, nothing dropped): once a clear or another drop
        took the groups (the driver may have refilled them with new prompts), or the lease ran out and
        they went to another worker, a late filter must not drop what it never judged. Without it, the
        groups are dropped whatever they hold now.

        A worker still holding rows of a dropped group finds them gone at its read (the read fence), and
        its ack releases nothing.
        """
        return self._generation.drop_groups(consumer, groups, delivery=delivery)
