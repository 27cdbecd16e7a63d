"""Docks' key names, for the tools that work beside the docks on their server: an operator's redis-cli
(docs/operations.md), and the benchmark measuring the memory a dock holds and deleting what a run left.

An open dock's own names are ``TransferDock.keys``; these need no dock. Both are built by
``broker/control/keys.py``, the one place that builds key names.
"""

from __future__ import annotations

from broker.control.keys import DockKeys, scan_pattern, shard_pattern

__all__ = ["dock_patterns", "meta_key"]


def dock_patterns(docks: str = "*") -> tuple[str, str]:
    """SCAN patterns of every key of the docks whose names match the glob ``docks``: the keys in each dock's
    own slot (``td:{NAME}:*``), and those on its data shards (``td:{NAME~S}:*``).

    >>> dock_patterns("bench-*")
    ('td:{bench-*}:*', 'td:{bench-*~*}:*')
    """
    return scan_pattern(docks), shard_pattern(docks)


def meta_key(dock: str) -> str:
    """The key of dock ``dock``'s schema and settings (``td:{NAME}:meta``): the dock exists while it does, and
    on a Redis Cluster the node holding it holds every control key of the dock."""
    return DockKeys(dock).meta
