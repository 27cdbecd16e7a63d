"""The admin family: the scripts that make a dock and keep what its workers share beside the rows.

- lua/create.lua: store a dock's schema unless one exists (``create``);
- lua/grow.lua: add columns or consumers, keeping the rows (``grow``);
- lua/metrics.lua: metrics every worker shares (``metrics``);
- lua/columns_of.lua: the columns each consumer reads by default (``columns_of``);
- lua/set_quota.lua: set or remove a dock's byte quota (``quota``).
"""

from __future__ import annotations

from broker.control.schema import Schema
from broker.control.scripts.base import ScriptsBase


class AdminScripts(ScriptsBase):
    """Wrappers of the scripts that make and describe a dock: create, grow, metrics, columns_of, quota."""

    def create(self, fields: dict[str, str]) -> dict[bytes, bytes] | None:
        """Store ``fields`` as the dock's meta unless a dock exists; None if stored, else the stored meta."""
        reply = self._once("create", [self._keys.meta, self._keys.epoch], [x for pair in fields.items() for x in pair])
        if reply[0] == 1:
            return None
        return dict(zip(reply[1::2], reply[2::2]))

    def metrics(self, values: dict[str, str], append: bool) -> int:
        """Store metrics (name -> JSON text); ``append`` extends stored lists (see lua/metrics.lua)."""
        args = [self._expected, "append" if append else "set", *(x for pair in values.items() for x in pair)]
        return int(self._once("metrics", [self._keys.meta, self._keys.metrics], args))

    def grow(self, grown: Schema) -> None:
        """Store the columns, consumers and group columns of ``grown`` if the dock still holds the schema bound now."""
        fields = grown.to_meta()
        self._call("grow", [self._keys.meta], [self._expected, fields["columns"], fields["consumers"],
                                               fields.get("group_columns", "")])

    def columns_of(self, columns: dict[str, str]) -> int:
        """Record the columns (a JSON list) each consumer reads by default."""
        args = [self._expected, *(x for pair in columns.items() for x in pair)]
        return int(self._call("columns_of", [self._keys.meta, self._keys.consumer_columns], args))

    def quota(self, nbytes: int | None) -> int:
        """Set the dock's byte quota (None: remove it), counting what it holds; the bytes it holds."""
        k, (schema, expected) = self._keys, self._pair
        keys = [k.meta, *(key for c in schema.columns for key in (k.data(c), k.tail(c)))]
        return int(self._call("set_quota", keys, [expected, "" if nbytes is None else nbytes]))
