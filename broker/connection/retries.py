"""Retries and the pauses between them: a backoff ending at the call's deadline (``_BACKOFF``, one for every
retry loop), the reconnect retry of clients opened from URLs (``default_retry``), which repeats a failure
once over and never a refused password, and the wait through another client's long script (``busy_retried``)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.retry import Retry

from broker.connection.deadlines import _expired, time_left

T = TypeVar("T")


class _BoundedBackoff(AbstractBackoff):
    """A backoff whose pauses end at the calling thread's deadline."""

    def __init__(self, backoff: AbstractBackoff):
        self._backoff = backoff

    def reset(self) -> None:
        self._backoff.reset()

    def compute(self, failures: int) -> float:
        pause = self._backoff.compute(failures)
        left = time_left()
        return pause if left is None else max(0.0, min(pause, left))


#: Attribute set on an error that a retry loop has given up on.
_RETRIED = "_broker_retried"


class _ReconnectRetry(Retry):
    """Retries connection failures once over, and never refused credentials: those will not get better.

    redis-py nests its retries: a command's retry (or the pool's hand-out retry below) wraps a
    reconnect whose own retry wraps opening the socket. Against a dead server the attempts multiply
    (9 x 9 sockets, over a minute instead of seconds). An error that has already been through one
    retry loop is marked, and the loops around it pass it on at once. Nothing is retried once the
    call's deadline has passed (see ``call_deadline``).
    """

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            if getattr(error, _RETRIED, False) or _expired():
                return False
            if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
                return False
            return is_retryable is None or is_retryable(error)

        try:
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        except Exception as error:
            setattr(error, _RETRIED, True)
            raise


#: The pause before a retry, by failures so far, for plain and cluster clients alike (EqualJitterBackoff
#: keeps no state, so one serves every retry loop), ending at the call's deadline if sooner.
_BACKOFF = _BoundedBackoff(EqualJitterBackoff(cap=2.0, base=0.05))


def default_retry() -> Retry:
    """Retry policy of clients opened from URLs: 8 reconnect attempts over about 4-7 s, then an error.

    Long enough to ride through a Redis restart or a failover, short enough that a dead server is
    reported while someone is still looking.

    Every broker call is safe to resend: puts, acks and clears are idempotent, and a sampling call
    carries a request id whose reply Redis keeps, so a resend after a lost reply gets the same rows.
    """
    return _ReconnectRetry(_BACKOFF, retries=8)


#: A BUSY reply, alone or quoted by redis-py as a pipeline's failed command ("... caused error: BUSY ...").
_BUSY = re.compile(r"(^|caused error: )BUSY\b")


#: Time a try after a BUSY reply or a moving slot must have left, or the error is raised: a try cut by the
#: deadline would be reported as a timeout of unknown outcome, while the error says what happened (nothing
#: was run).
_LAST_TRY = 0.2


def is_busy(error: Exception) -> bool:
    """Redis answered BUSY: a script (or function) of some client has run past the busy threshold, and the
    server runs nothing else until it ends or is killed. The command was not run."""
    return isinstance(error, redis.ResponseError) and _BUSY.search(str(error)) is not None


def is_slot_moving(error: Exception) -> bool:
    """A Redis Cluster is moving the slot of the call's keys (a resharding): some keys are on the old node,
    some on the new, and a command of several keys gets TRYAGAIN until the move ends; redis-py follows the
    redirects a few times, then gives up with "TTL exhausted". The command was not run."""
    if isinstance(error, redis.exceptions.TryAgainError):
        return True
    return isinstance(error, redis.exceptions.ClusterError) and "TTL exhausted" in str(error)


def busy_retried(call: Callable[[], T]) -> T:
    """``call``, run again while Redis answers BUSY or a cluster moves the call's slot, until the calling
    thread's deadline.

    BUSY means another client's script holds the server (a legitimate long one, or a hostile one an
    administrator must SCRIPT KILL); a moving slot refuses commands of several keys until the move ends. In
    both the call was refused whole, so running it again is safe, and it should wait out a short stall as it
    waits out a reconnect. Past the deadline the error is raised.
    """
    failures = 0
    while True:
        try:
            return call()
        except (redis.ResponseError, redis.exceptions.ClusterError) as error:
            if not (is_busy(error) or is_slot_moving(error)) or _expired():
                raise
            failures += 1
            pause = _BACKOFF.compute(failures)
            left = time_left()
            if pause <= 0 or (left is not None and left - pause < _LAST_TRY):
                raise  # no time for another try: say why, not that the deadline passed mid-request
            time.sleep(pause)
