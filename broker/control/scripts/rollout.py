"""The rollout family: the state a rollout keeps beside the rows (the policy version, responses being
continued).

- lua/version.lua: set the dock's current policy version, which only grows (``version``);
- lua/unready.lua: mark rows of some columns not ready, keeping their bytes (``unready``).

The rollout's other scripts sit with what they do: reserve and prefetch hand out (``handout.py``),
discard forgets (``forget.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.control.scripts.base import ScriptsBase


class RolloutScripts(ScriptsBase):
    """Wrappers of the rollout's own scripts: version, unready."""

    def unready(self, columns: Sequence[str], rows: Sequence[int]) -> int:
        """Mark ``rows`` of ``columns`` not ready, keeping their bytes (lua/unready.lua)."""
        k = self._keys
        keys = [k.meta, *(key for c in columns for key in (k.ready(c), k.group_ready(c)))]
        return int(self._call("unready", keys, [self._expected, self._n, *rows]))

    def version(self, version: int) -> int:
        """Set the dock's current policy version (lua/version.lua); versions only grow."""
        return int(self._call("version", [self._keys.meta, self._keys.version], [self._expected, version]))
