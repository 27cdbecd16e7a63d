"""TransferQueue's field and task names as the dock's column and consumer names.

TransferQueue takes any str as a field or task name (the empty one, spaces, ``:``, non-ASCII, 300
characters); the dock's names are 1-128 letters, digits, ``_``, ``.``, ``-`` (they are parts of Redis keys
and of ACL patterns, and ``redis-cli`` users type them). A name that is already a valid dock name stays as
it is, so ``redis-cli`` shows ``td:{tq.NS}:ready:responses`` for the field ``responses``; any other name,
and any name beginning with the adapter's reserved ``tq.``, becomes ``tq.h.`` and 40 hex digits of its
SHA-256: one name per field, the same in every process, with no table to keep consistent. The partition's
field schema (``tq:fields:<partition>``) keeps the field's own name beside it, so the original is never lost.
"""

from __future__ import annotations

import hashlib

from broker.control.keys import NAME_RE

#: Names the adapter keeps for itself (its placeholder column and consumer, and the hashed names below).
RESERVED = "tq."
_HASHED = RESERVED + "h."


def dock_name_of(name: str) -> str:
    """The dock's column (for a field) or consumer (for a task) of a TransferQueue name: the name itself when
    the dock allows it, else a fixed digest of it (160 bits: two names never meet)."""
    if NAME_RE.fullmatch(name) and not name.startswith(RESERVED):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return _HASHED + digest
