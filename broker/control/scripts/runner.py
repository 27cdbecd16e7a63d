"""The one owner of "the server lost the scripts": every script the broker sends goes through here.

A server loses the broker's scripts on a restart or a failover to a node that never had them, on SCRIPT
FLUSH (EVALSHA answers NOSCRIPT), and on FUNCTION FLUSH or a new primary without the function library
(FCALL answers that the function is not found; see ``functions.py``). Either answer means the script did
not run: nothing it would have done happened. So the scripts are loaded again (``load_scripts``) and the
same request is sent once more (``resent_once``), whatever the script does; a second loss in a row is the
call's error. Anything else a script answers (it ran, or may have) is never resent here.

The paths that send scripts, each through ``resent_once``:

- one script now (``ScriptsBase._call``);
- a pipeline of scripts and plain commands, which must be idempotent (``run_pipeline``, ``read_pipeline``:
  reads, the status of many docks, a put on one slot);
- the slices of a large put sent back to back (``Lanes._lane``, data/lanes.py): only the slices whose script was not
  run are sent again;
- the read fence after columns received straight into tensors (``SlotStore.received``).

A confined worker (``broker acl``) may run the function library but not load it: ``load_scripts`` then
raises ServerConfigError, and the call changed nothing (a put's bytes stay barred: lua/put.lua).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.client import Pipeline

from broker.connection import Client
from broker.control.scripts.functions import library_lost, load_library, uses_functions

R = TypeVar("R")


def scripts_lost(reply: Any) -> bool:
    """Whether ``reply`` (a reply or an error) says the server lost the scripts (NOSCRIPT: a restart, SCRIPT
    FLUSH) or the function library (FUNCTION FLUSH, a new node): the script did not run."""
    return isinstance(reply, redis.exceptions.NoScriptError) or library_lost(reply)


def load_scripts(client: Client, texts: Iterable[str | bytes | memoryview]) -> None:
    """Put back what the server lost: the function library where ``client`` calls functions (on every primary;
    ServerConfigError where this user may not load it), else each script of ``texts`` (SCRIPT LOAD)."""
    if uses_functions(client):
        load_library(client)
        return
    for text in texts:
        client.script_load(text)


def _never(result: Any) -> bool:
    return False


def resent_once(send: Callable[[], R], load: Callable[[], None], lost: Callable[[R], bool] = _never) -> R:
    """``send()``; where the server lost the scripts (``send`` raised an error saying so, or ``lost`` finds it in
    what ``send`` returned, say a pipeline's replies), ``load()`` and ``send()`` once more, and return that.

    Only a script that did not run is sent again: ``send`` must send again exactly what was not run (a pipeline
    whose other commands are idempotent, or only the lost parts: ``send`` may keep state between its calls)."""
    try:
        result = send()
    except redis.ResponseError as exc:
        if not scripts_lost(exc):
            raise
    else:
        if not lost(result):
            return result
    load()
    return send()


def run_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *,
    transaction: bool,
) -> list[Any]:
    """Run the pipeline (a MULTI/EXEC if ``transaction``) that ``build`` queues; its replies, errors included.

    A server that lost the scripts fails only their EVALSHAs or FCALLs (everything else applies), so ``load``
    loads them and the whole pipeline, which must be idempotent, runs again (``resent_once``).
    """
    def send() -> list[Any]:
        pipe = client.pipeline(transaction=transaction)
        build(pipe)
        return list(pipe.execute(raise_on_error=False))

    return resent_once(send, lambda: load(client), lost=lambda replies: any(scripts_lost(r) for r in replies))


def read_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *, transaction: bool = False,
) -> list[Any]:
    """The replies of the read pipeline ``build`` queues (see ``run_pipeline``); an error reply raises."""
    replies = run_pipeline(client, load, build, transaction=transaction)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
