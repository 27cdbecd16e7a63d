"""redis-py's errors turned into the broker's where they enter (``redis_errors``; ``bounded`` for a tool's reads),
the broker error a script's error reply stands for (``script_error``), and error texts without the values of the
commands they quote (``elide_values``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import redis

from broker.connection.deadlines import DEFAULT_CALL_TIMEOUT, _cut_by_deadline, _DeadlinePassed, call_deadline
from broker.connection.retries import is_busy, is_slot_moving
from broker.connection.sockets import _CUT, _Hopeless, _TooLarge
from broker.errors import (
    BrokerConnectionError,
    BrokerError,
    BrokerTimeoutError,
    ClusterError,
    DataLostError,
    DecodeError,
    DockNotFoundError,
    ExperienceTooLargeError,
    FencedError,
    InvalidExperienceError,
    QuotaExceededError,
    RedisCommandError,
    SchemaError,
    StoreFullError,
    VersionError,
)


@contextlib.contextmanager
def bounded(where: str, seconds: float = DEFAULT_CALL_TIMEOUT, *, reads: bool = False) -> Iterator[None]:
    """Calls bounded like a dock's, their Redis errors turned into broker errors naming ``where``: a tool's
    reads (``broker status``, its live view, the exporter's scrape: ``reads``, so a call given up says it
    changed nothing) or an adapter's calls."""
    with call_deadline(seconds), redis_errors(where, reads=reads):
        yield


@contextlib.contextmanager
def redis_errors(where: str, *, reads: bool = False) -> Iterator[None]:
    """Re-raise redis-py errors as broker errors; ``where`` names the server for the message, ``reads`` says
    the calls only read (a call given up at its deadline then changed nothing, rather than maybe something)."""
    try:
        yield
    except _DeadlinePassed as exc:
        raise _timeout_error(where, exc, reads, _outcome(exc)) from exc
    except redis.AuthenticationError as exc:
        raise BrokerConnectionError(f"Redis at {where} refused the credentials: {exc}") from exc
    except redis.exceptions.AskError as exc:  # MovedError too: redis-py keeps only "SLOT HOST:PORT" of it
        kind = "MOVED" if isinstance(exc, redis.exceptions.MovedError) else "ASK"
        raise ClusterError(
            f"Redis at {where} is a Redis Cluster node and redirected the call ({kind} {exc}: slot {exc.slot_id} "
            f"is served by {exc.host}:{exc.port}); the redirects did not settle. Open the dock from a URL so the "
            "broker uses a cluster client, or pass a redis.cluster.RedisCluster client (from a URL, a user not "
            "granted INFO cannot be told it is on a cluster: grant +info, as broker acl --cluster does)"
        ) from exc
    except redis.exceptions.ClusterDownError as exc:
        raise ClusterError(
            f"Redis Cluster at {where} is down ({_short(exc)}): a primary failed and no replica took over in time"
        ) from exc
    except redis.exceptions.TryAgainError as exc:
        raise ClusterError(f"Redis Cluster at {where} is moving the slot of this call's keys: {_short(exc)}") from exc
    except redis.exceptions.ClusterCrossSlotError as exc:
        raise ClusterError(
            f"Redis Cluster at {where} refused keys of several slots in one command: {_short(exc)}"
        ) from exc
    except redis.exceptions.ClusterError as exc:
        if is_slot_moving(exc):  # redis-py's "TTL exhausted": see retries.busy_retried, which waited
            raise ClusterError(
                f"Redis Cluster at {where} is moving the slot of this call's keys to another node (a resharding) "
                f"and did not finish within the call's deadline; nothing of the call was run: try again once the "
                f"move ends ({_short(exc)})") from exc
        raise ClusterError(f"Redis Cluster at {where}: {_short(exc)}") from exc
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: cross-slot MULTI, uncovered slot
        cut = _cut_by_deadline(exc)  # a slot map reload that found no node answering in time
        if cut is not None:
            raise _timeout_error(where, cut, reads) from exc
        raise ClusterError(f"Redis Cluster at {where} refused the call: {_short(exc)}") from exc
    except _Hopeless as exc:
        raise BrokerConnectionError(f"Redis at {where}: {exc}") from exc
    except _TooLarge as exc:
        raise ExperienceTooLargeError(f"Redis at {where} {exc}") from exc
    except _CUT as exc:
        cut = _cut_by_deadline(exc)  # a retry loop that stopped at the deadline
        if cut is not None:
            raise _timeout_error(where, cut, reads, _outcome(exc)) from exc
        said = _outcome(exc)
        raise BrokerConnectionError(f"Redis at {where}: {_short(exc)}{f' ({said})' if said else ''}") from exc
    except redis.exceptions.OutOfMemoryError as exc:
        applied = _outcome(exc) or "nothing of this call was applied"
        raise StoreFullError(
            f"Redis at {where} is out of memory (maxmemory reached); {applied}: {_short(exc)}") from exc
    except redis.exceptions.NoPermissionError as exc:
        raise RedisCommandError(f"Redis at {where} denied this user a command or key: {_short(exc)}") from exc
    except redis.ResponseError as exc:
        if is_busy(exc):  # see retries.busy_retried, which waited until the deadline
            raise RedisCommandError(
                f"Redis at {where} stayed busy running another client's script until the call's deadline (the "
                f"commands it refused were not run); an administrator ends a runaway script with SCRIPT KILL or "
                f"FUNCTION KILL: {_short(exc)}") from exc
        # Our scripts flag keys holding foreign data with a CORRUPT error before writing anything, and
        # a dock whose schema vanished or changed under them with NODOCK or SCHEMA.
        error = script_error(exc)
        if error is not None:
            raise type(error)(f"Redis at {where}: {error}") from None
        raise RedisCommandError(f"Redis at {where} refused a command: {_short(exc)}") from exc
    except redis.RedisError as exc:
        raise RedisCommandError(f"Redis at {where} refused a command: {_short(exc)}") from exc


def _outcome(exc: BaseException) -> str | None:
    """What a call cut short or refused part way had applied, where it knows (``outcome``, set by the call: a
    put in slices names the rows that landed), else None."""
    said = getattr(exc, "outcome", None)
    return said if isinstance(said, str) else None


def _timeout_error(
    where: str, cut: _DeadlinePassed, reads: bool = False, outcome: str | None = None,
) -> BrokerTimeoutError:
    applied = ("it only read, so nothing was changed" if reads else
               f"of what it applied: {outcome}" if outcome else "it may or may not have been applied")
    return BrokerTimeoutError(
        f"Redis at {where} did not answer within the call's bound of {cut.bound}; the call was given up, and "
        f"{applied} ({_short(Exception(cut.detail))})"
    )


#: Error prefixes of the Lua scripts, and the broker error each stands for.
_SCRIPT_ERRORS = {"CORRUPT ": DecodeError, "NODOCK ": DockNotFoundError, "SCHEMA ": SchemaError,
                  "VERSION ": VersionError, "FENCED ": FencedError, "LOST ": DataLostError,
                  "QUOTA ": QuotaExceededError, "GROUP ": InvalidExperienceError}


def script_error(exc: redis.ResponseError) -> BrokerError | None:
    """The broker error a script's error reply stands for (CORRUPT, NODOCK, SCHEMA, VERSION, FENCED, LOST,
    QUOTA, GROUP), or None."""
    text = str(exc)
    for prefix, error in _SCRIPT_ERRORS.items():
        if text.startswith(prefix):
            return error(text[len(prefix) :])
    return None


def _short(exc: Exception, limit: int = 300) -> str:
    """An error's text with the values of commands it quotes elided (see ``elide_values``), cut to ``limit``."""
    text = elide_values(str(exc))
    return text if len(text) <= limit else text[:limit] + "..."


#: How redis-py quotes the command of a pipeline whose reply was an error (its first 100 characters).
_PIPELINE_COMMAND = re.compile(r"(Command # \d+ \()(.*)(\) of pipeline caused error: )", re.DOTALL)
#: How Redis quotes the arguments of a command it does not know (renamed, say): the first ones, 128 bytes.
_ECHOED_ARGS = re.compile(r"(with args beginning with: )(.*)", re.DOTALL)
#: Commands whose first arguments up to the first key are not values: the script (or function), numkeys.
_SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
#: What a byte that is no text looks like once redis-py decoded it (a control character, or U+FFFD).
_NOT_TEXT = re.compile(r"\S*[\x00-\x08\x0b-\x1f\x7f\ufffd]\S*")
_ELIDED = "<values elided>"


def elide_values(text: str) -> str:
    """``text`` without the values of the commands it quotes (a row's encoded tensor, raw bytes).

    redis-py quotes a pipeline's failed command, and Redis the first arguments of a command it does not
    know: with a put's HSET, that is the start of a tensor's bytes. The command's name and its key stay
    (for a script call, up to its first key); the rest becomes ``<values elided>``. Bytes that are no
    text anywhere else are elided too.
    """
    text = _PIPELINE_COMMAND.sub(lambda m: m.group(1) + _command_and_key(m.group(2)) + m.group(3), text)
    text = _ECHOED_ARGS.sub(lambda m: m.group(1) + _first_word(m.group(2)), text)
    return _NOT_TEXT.sub("<bytes elided>", text)


def _command_and_key(command: str) -> str:
    words = command.split(" ")
    kept = 4 if words[0].upper() in _SCRIPT_CALLS else 2
    return command if len(words) <= kept else " ".join(words[:kept] + [_ELIDED])


def _first_word(args: str) -> str:
    first, _, rest = args.partition(" ")
    return f"{first} {_ELIDED}" if rest.strip() else args
