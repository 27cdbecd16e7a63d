"""What every family of wrappers stands on: the scripts of one dock loaded on one client, the schema they
check, and the ways to run a script (now, keeping its reply for resends, or queued in a pipeline).

Each family (``handout.py``, ``leases.py``, ...) is a subclass of ``ScriptsBase`` holding the wrappers of
its scripts, and ``DockScripts`` is all of them at once. A wrapper is the single place that knows its
script's contract: it builds the KEYS and ARGV in the order the script's header gives, and turns the reply
into Python values (``results.py``).
"""

from __future__ import annotations

import threading
from typing import Any

from redis.client import Pipeline

from broker.connection import Client
from broker.control.keys import DockKeys
from broker.control.schema import Schema
from broker.control.scripts.functions import function_name, uses_functions
from broker.control.scripts.loader import (
    ALLOW_OOM,
    REPLY_TTL_MS,
    SCRIPT_FILES,
    SHARED,
    new_request_id,
    script_text,
)
from broker.control.scripts.runner import load_scripts, resent_once
from broker.control.scripts.status import StatusScript


class ScriptsBase:
    """The scripts of one dock on one client, and how to run them; the families add the wrappers.

    ``schema`` must be set (``bind``) before any script but ``create`` runs: every script checks that
    the dock still holds the schema this client knows.
    """

    def __init__(self, client: Client, keys: DockKeys, *, allow_oom: bool, publish: str = "PUBLISH"):
        prefix = ALLOW_OOM if allow_oom else ""
        self._client = client
        self._keys = keys
        #: How puts announce themselves: PUBLISH, or on a Redis 7 cluster SPUBLISH, which stays on the
        #: shard of the dock's slot instead of being broadcast to every node (see put_listener.py).
        self.publish = publish
        self._scripts = {
            name: client.register_script(prefix + script_text(name))
            for name in SCRIPT_FILES if name not in SHARED
        }
        #: The schema bound and its fingerprint, one tuple: threads share these wrappers, and a wrapper whose
        #: KEYS come from the schema must send the fingerprint of that same schema (``_pair``), though another
        #: thread may bind a grown one meanwhile (a fingerprint of the grown one with the keys of the old would
        #: pass the script's check and miss the new columns' keys).
        self._binding: tuple[Schema, str] | None = None
        #: Per thread, the reply key of the last call whose reply it received (see ``_once``).
        self._received = threading.local()

    def bind(self, schema: Schema, fingerprint: str) -> None:
        """Use ``schema``; ``fingerprint`` (``schema.fingerprint`` of the stored meta) is what scripts check."""
        self._binding = (schema, fingerprint)

    @property
    def functions(self) -> bool:
        """Whether the scripts run as the loaded function library (see ``functions.py``), not by EVALSHA."""
        return uses_functions(self._client)

    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run script ``name`` now: FCALL or EVALSHA, the script (or the library) loaded again and the call
        resent where the server lost it (``runner.py``: it did not run)."""
        command = self._command(name, keys, args)
        return resent_once(lambda: self._client.execute_command(*command),  # type: ignore[no-untyped-call]
                           lambda: load_scripts(self._client, [self._scripts[name].script]))

    def _once(self, name: str, keys: list[str], args: list[Any], request_id: str | None = None) -> Any:
        """Run a script that keeps its reply for resends of the call (lua/include/once.lua): the reply key
        goes last in KEYS and the time to keep it last in ARGV. The reply this thread received last from this
        dock's scripts is deleted by the same script: this thread never asks for it again."""
        reply = self._keys.reply(request_id or new_request_id())
        received = getattr(self._received, "key", None)
        done = [received] if received and received != reply else []
        result = self._call(name, [*keys, *done, reply], [*args, len(done), REPLY_TTL_MS])
        self._received.key = reply
        return result

    def _queue_once(self, pipe: Pipeline, name: str, keys: list[str], args: list[Any], request_id: str) -> None:
        # Queued: the reply is received with the pipeline's, later; it is left to expire.
        self._queue(pipe, name, [*keys, self._keys.reply(request_id)], [*args, 0, REPLY_TTL_MS])

    def _command(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        """The command running script ``name``, to queue: FCALL of its function, or EVALSHA of its hash."""
        if self.functions:
            return ("FCALL", function_name(name), len(keys), *keys, *args)
        return ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    def _queue(self, pipe: Pipeline, name: str, keys: list[str], args: list[Any]) -> None:
        # EVALSHA sent as is rather than through Script(client=pipe), which costs a SCRIPT EXISTS round
        # trip per call; run_pipeline loads the scripts and repeats the pipeline where the server lost them.
        pipe.execute_command(*self._command(name, keys, args))

    def load_all(self, client: Client) -> None:
        """Load every script, or the function library, where the server lost them (the ``load`` of the
        pipelines of ``runner.py``)."""
        load_scripts(client, [*(script.script for script in self._scripts.values()), StatusScript.text])

    def _consumer_keys(self, consumer: str) -> list[str]:
        k = self._keys
        return [k.consumed(consumer), k.group_taken(consumer), k.leases(consumer), k.tokens(consumer)]

    @property
    def _pair(self) -> tuple[Schema, str]:
        """The schema bound and its fingerprint, read together (see ``_binding``)."""
        if self._binding is None:  # a programming error of the dock, not of its user
            raise RuntimeError("DockScripts.bind was not called before a script that needs the schema")
        return self._binding

    @property
    def _bound(self) -> Schema:
        """The schema bound: for what growth does not change (sizes, rollout); KEYS from its names go with
        the fingerprint of ``_pair``."""
        return self._pair[0]

    @property
    def _expected(self) -> str:
        """The fingerprint bound ("" before any): for scripts whose KEYS do not come from the schema's names."""
        return "" if self._binding is None else self._binding[1]

    @property
    def _n(self) -> int:
        return self._bound.n_samples_per_prompt
