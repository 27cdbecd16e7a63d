"""Running scripts inside a pipeline, where redis-py does not load a script the server lost.

Outside a pipeline a ``Script`` object loads its text again when the server answers NOSCRIPT (after a
restart or ``SCRIPT FLUSH``). The wrappers queue scripts into pipelines by hash alone (``base.py``), so
these helpers run the pipeline, load the scripts when any EVALSHA of it answered NOSCRIPT, and run it
again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline

from broker.connection import Client
from broker.control.scripts.functions import library_lost


def run_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *,
    transaction: bool,
) -> list[Any]:
    """Run the pipeline (a MULTI/EXEC if ``transaction``) that ``build`` queues; its replies, errors included.

    A server that lost the scripts fails only their EVALSHAs (everything else applies), so ``load``
    loads them and the whole pipeline, which must be idempotent, runs again; likewise the FCALLs of a server
    that lost the function library.
    """
    for attempt in range(2):
        pipe = client.pipeline(transaction=transaction)
        build(pipe)
        replies = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(scripts_lost(r) for r in replies):
            load(client)
            continue
        return replies
    raise AssertionError("unreachable")


def read_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *, transaction: bool = False,
) -> list[Any]:
    """The replies of the read pipeline ``build`` queues (see ``run_pipeline``); an error reply raises."""
    replies = run_pipeline(client, load, build, transaction=transaction)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def scripts_lost(reply: Any) -> bool:
    """The server lost the scripts (NOSCRIPT: a restart, SCRIPT FLUSH) or the function library (FUNCTION
    FLUSH, a new node): ``load`` puts them back."""
    return isinstance(reply, redis.exceptions.NoScriptError) or library_lost(reply)
