"""The admin family: the scripts that make a dock and keep what its workers share beside the rows.

- lua/create.lua: store a dock's schema unless one exists (``create``);
- lua/partition.lua: record a partitioned dock's partitions unless a dock of its name exists (``partition``);
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

    def create(self, fields: dict[str, str]) -> dict[bytes, bytes] | bytes | None:
        """Store ``fields`` as the dock's meta unless a dock exists; None if stored, else the stored meta, or the
        record of the partitioned dock of this name (bytes: no dock of one partition may be made under it)."""
        k = self._keys
        reply = self._once("create", [k.meta, k.epoch, k.partitions], [x for pair in fields.items() for x in pair])
        if reply[0] == 1:
            return None
        if reply[0] == 2:
            return bytes(reply[1])
        return dict(zip(reply[1::2], reply[2::2]))

    def partition(self, record: str) -> bytes | None:
        """Record a partitioned dock's partitions (``record``, JSON) unless a dock of its name exists: None if
        stored, else the record stored before; SchemaError-worthy ``b""`` when a dock of one partition has the
        name (see lua/partition.lua)."""
        reply = self._call("partition", [self._keys.meta, self._keys.partitions], [record])
        if reply[0] == 1:
            return None
        return b"" if reply[0] == 2 else bytes(reply[1])

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
