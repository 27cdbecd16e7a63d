"""The control plane's scripts: the Lua files of ``lua/``, one per atomic operation, and one typed wrapper per
script. Everything they touch lives in the dock's own slot ``{NAME}`` (status bitmaps, leases, replies); the
row bytes are the data plane's (``broker.data.slot_store``, ``broker.data.sharded_store``), which a script
reaches only when the dock keeps them in its own slot too.

Each wrapper is the single place that knows its script's contract: it builds the KEYS and ARGV in the order
the script's header gives, and turns the reply into Python values. The dock calls only these, through one
``DockScripts`` made of one class per family:

==============  ======================================================  ===================
module          lua/ files                                              class
==============  ======================================================  ===================
``handout``     sample, take, prefetch, reserve, unreserve              ``HandOutScripts``
``leases``      fence, ack, release, reclaim, reset                     ``LeaseScripts``
``puts``        put, claim, unhold, mark; a plain bar around put        ``PutScripts``
``forget``      clear, discard (include/forget.lua)                     ``ForgetScripts``
``rollout``     version, unready                                        ``RolloutScripts``
``admin``       create, grow, metrics, columns_of                       ``AdminScripts``
``status``      status (for many docks at once, outside any dock)       ``StatusScript``
==============  ======================================================  ===================

Outside ``DockScripts``: ``snapshot`` (snapshot, restore: a dock's checkpoints, ``SnapshotScripts``, used by
``broker/api/snapshot.py``). A slice's scripts (the TransferQueue slice's, ``broker/transfer_queue/lua/``)
are its own, wrapped in the slice and registered with ``loader.register_scripts`` when it is imported.

Beside them: ``functions`` (on Redis 7 the scripts run as one function library: FCALL, which confined
workers are granted instead of EVAL; EVALSHA elsewhere), ``loader`` (which file each script is, where
``lua/`` is, includes, request ids, the slices' scripts), ``base`` (the loaded scripts and how a wrapper runs one),
``runner`` (the one owner of a server that lost the scripts: loaded again and resent only when the
script did not run; pipelines of scripts) and ``results`` (the values the wrappers
return, and row runs).
"""

from broker.control.scripts.dock_scripts import DockScripts
from broker.control.scripts.loader import (
    ALLOW_OOM,
    REPLY_TTL_MS,
    SCRIPT_FILES,
    IncludeError,
    expand_includes,
    lua_dir,
    new_request_id,
    script_text,
)
from broker.control.scripts.results import (
    AlreadyTaken,
    Fence,
    Finish,
    Forgot,
    Handout,
    Hold,
    Marked,
    Released,
    Reservation,
    Sampled,
    Selection,
    rows_of,
    runs_of,
)
from broker.control.scripts.runner import load_scripts, read_pipeline, resent_once, run_pipeline, scripts_lost
from broker.control.scripts.status import StatusScript

__all__ = [
    "ALLOW_OOM",
    "AlreadyTaken",
    "REPLY_TTL_MS",
    "SCRIPT_FILES",
    "DockScripts",
    "Fence",
    "Finish",
    "Forgot",
    "Handout",
    "IncludeError",
    "Hold",
    "Marked",
    "Released",
    "Reservation",
    "Sampled",
    "Selection",
    "StatusScript",
    "expand_includes",
    "load_scripts",
    "lua_dir",
    "new_request_id",
    "read_pipeline",
    "resent_once",
    "rows_of",
    "run_pipeline",
    "scripts_lost",
    "runs_of",
    "script_text",
]
