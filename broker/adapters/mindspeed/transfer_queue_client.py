"""MindSpeed-RL's TransferQueue client (``mindspeed_rl/utils/transfer_queue/tq_client.py``): topics, each a
dock named ``tq.TOPIC`` on one Redis server (see the package docstring)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from broker.adapters.mindspeed.defaults import (
    DEFAULT_TOPIC,
    LENGTHS,
    RESPONSE_COLUMNS,
    ROLLOUT_CONSUMER,
)
from broker.adapters.mindspeed.docked import Docked
from broker.adapters.mindspeed.helpers import (
    bad,
    check_names,
    check_seconds,
    int_rows,
    mindspeed_batch,
    partial_rollout,
    pickled_url,
)
from broker.adapters.mindspeed.metric import Metric
from broker.api.balance import dp_padded
from broker.api.checks import is_int
from broker.api.delivery import reordered
from broker.api.dock import TransferDock
from broker.connection import Client, connect, default_url, disconnect
from broker.control.rollout import Rollout
from broker.control.status import dock_names
from broker.errors import (
    DockNotFoundError,
    InvalidExperienceError,
    RowIndexError,
    SchemaError,
    UnknownConsumerError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The topic's ``timeout`` (add_topic's), kept with its dock as a setting.
TIMEOUT_SETTING = "tq_timeout"


class TransferQueueClient(Docked):
    """MindSpeed-RL's TransferQueue client: topics, each a dock named ``tq.TOPIC`` on one Redis server."""

    def __init__(self, url: str | Client | None = None, *, prefix: str = "tq.", lease: float | None = None,
                 wait_replicas: int = 0, wait_timeout: float = 1.0) -> None:
        self._url: str | Client = url or default_url()
        self._prefix = prefix
        self._init_leases(lease)
        self._init_durability(wait_replicas, wait_timeout)
        self._docks: dict[str, TransferDock] = {}
        self._timeouts: dict[str, float] = {}
        self._timings: dict[str, float] = {"put": 0.0, "get": 0.0, "dispatch": 0.0}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        pickled_url("TransferQueueClient", self._url)
        return _tq_client, (self._url, self._prefix, self.lease, self._durability)

    def _dock(self, topic: str | None) -> TransferDock:
        topic = topic or DEFAULT_TOPIC
        dock = self._docks.get(topic)
        if dock is None:
            try:
                dock = TransferDock.attach(self._url, self._prefix + topic, policy="random", **self._durable())
            except DockNotFoundError:
                raise bad(f"Unknown topic '{topic}'") from None
            self._docks[topic] = dock
        return dock

    def _remade(self, topic: str) -> bool:
        """Whether ``topic`` was re-made (or deleted) by another client since this one cached its dock; if so the
        cache now holds it as it is (or nothing: the next call says the topic is unknown)."""
        cached = self._docks.get(topic)
        if cached is None:
            return False
        try:
            fresh = TransferDock.attach(self._url, self._prefix + topic, policy="random", **self._durable())
        except DockNotFoundError:
            fresh = None
        if fresh is not None and fresh.fingerprint == cached.fingerprint:
            fresh.close()
            return False
        self._timeouts.pop(cached.name, None)
        self._docks.pop(topic)
        cached.close()
        if fresh is not None:
            self._docks[topic] = fresh
        return True

    def _timeout(self, dock: TransferDock) -> float:
        """The topic's ``timeout`` (add_topic's), read once per topic: it does not change."""
        if dock.name not in self._timeouts:
            raw = dock.setting(TIMEOUT_SETTING)
            self._timeouts[dock.name] = float(raw) if raw else 5.0
        return self._timeouts[dock.name]

    # -- topics -------------------------------------------------------------------------------

    def add_topic(
        self, prompts_num: int, n_samples_per_prompt: int, experience_columns: Sequence[str],
        experience_consumers: Sequence[str], timeout: float = 5.0, metrics: Metric | None = None,
        topic: str = DEFAULT_TOPIC, max_age: int = 1, GBS_train: int = 0,  # noqa: N803
    ) -> None:
        if not topic:
            raise bad("Topic must be non-empty")
        if not is_int(max_age) or max_age < 1:
            raise bad(f"max_age must be a positive int, got {max_age!r}")
        # Checked before the topic is made: a topic made and then refused stayed, "already exists" on a retry.
        timeout = check_seconds("timeout", timeout)
        experience_columns = check_names("experience_columns", experience_columns)
        experience_consumers = check_names("experience_consumers", experience_consumers)
        lengths = [c for c in LENGTHS if c in experience_columns]
        rollout = partial_rollout(max_age, GBS_train)
        if rollout is not None:
            rollout = Rollout(consumer=ROLLOUT_CONSUMER, max_age=max_age, gbs_train=GBS_train,
                              response_columns=tuple(c for c in RESPONSE_COLUMNS if c in experience_columns))
        dock = TransferDock(self._url, self._prefix + topic, prompts_num, n_samples_per_prompt,
                            experience_columns, experience_consumers, policy="random", length_columns=lengths,
                            rollout=rollout, **self._durable())
        if not dock.created:
            dock.close()
            raise bad(f"Topic '{topic}' already exists")
        dock.set_setting(TIMEOUT_SETTING, str(float(timeout)))  # not schema: kept with the dock beside it
        self._docks[topic] = dock
        if metrics is not None and getattr(metrics, "metric", None):
            self._update_metrics(dock, "", dict(metrics.metric), False)

    def delete_topic(self, topic: str = DEFAULT_TOPIC) -> None:
        dock = self._dock(topic)
        dock.delete()
        self._timeouts.pop(dock.name, None)
        self._docks.pop(topic or DEFAULT_TOPIC).close()

    def clear_topic(self, topic: str = DEFAULT_TOPIC) -> None:
        self._dock(topic).clear()

    def clear_and_resize_topic(self, prompts_num: int, n_samples_per_prompt: int, topic: str = DEFAULT_TOPIC) -> None:
        old = self._dock(topic)
        columns, consumers, timeout = list(old.columns), list(old.consumers), self._timeout(old)
        rollout = old.rollout
        registered = {c: old.consumer_columns(c) for c in consumers if self._registered(old, c)}
        self.delete_topic(topic)
        self.add_topic(prompts_num, n_samples_per_prompt, columns, consumers, timeout, topic=topic,
                       max_age=rollout.max_age, GBS_train=rollout.gbs_train)
        if registered:
            self.register_consumer_columns_dict(registered, topic)

    @staticmethod
    def _registered(dock: TransferDock, consumer: str) -> bool:
        try:
            dock.consumer_columns(consumer)
        except InvalidExperienceError:  # none registered for it
            return False
        return True

    def register_consumer_columns_dict(self, columns_dict: Mapping[str, Sequence[str]],
                                       topic: str = DEFAULT_TOPIC) -> None:
        self._dock(topic).register_consumer_columns(columns_dict)

    def get_columns(self, consumer: str | None = None, topic: str = DEFAULT_TOPIC) -> list[str]:
        return self._dock(topic).consumer_columns(consumer)

    def get_max_len(self, topic: str = DEFAULT_TOPIC) -> int:
        dock = self._dock(topic)
        dock.refresh()  # one round trip: another client may have resized the topic since it was cached
        return dock.capacity

    def reset_all(self) -> None:
        """Delete every topic of this client's prefix on the server."""
        for key in self._dock_names():
            TransferDock.attach(self._url, key, **self._durable()).delete()
        self._docks.clear()
        self._timeouts.clear()
        self._timings = {"put": 0.0, "get": 0.0, "put_prompt": 0.0, "dispatch": 0.0}

    def _dock_names(self) -> list[str]:
        client, url = connect(self._url)
        try:
            return [n for n in dock_names(client) if n.startswith(self._prefix)]
        finally:
            if isinstance(self._url, str) and url is not None:
                disconnect(url)

    # -- data ---------------------------------------------------------------------------------

    def put_experience(self, data_dict: Any, indexes: Sequence[int] | None = None, unpad: bool = True,
                       topic: str = DEFAULT_TOPIC, data_status: str = "ready") -> None:
        """Write rows. On a partial-rollout topic, responses put with ``data_status="partial_ready"`` are
        unfinished and ``"ready"`` ones finished, unless the data carries ``rollout_completed``."""
        if data_status not in ("ready", "partial_ready"):
            raise bad(f"data_status must be 'ready' or 'partial_ready', got {data_status!r}")
        if indexes is None or (isinstance(indexes, Sequence) and len(indexes) == 0):
            raise bad("No indexes provided for put_experience")
        dock = self._dock(topic)
        if data_status == "partial_ready" and not dock.rollout.partial:
            raise bad(f"data_status='partial_ready' needs partial rollout (max_age > 1) on topic '{topic}'")
        start = time.perf_counter()
        self._put(dock, data_dict, indexes, unpad, is_prompt=None, finished=data_status == "ready")
        self._timings["put"] += time.perf_counter() - start

    def get_experience(
        self, consumer: str, experience_columns: list[str] | None = None, experience_count: int | None = None,
        indexes: list[int] | None = None, get_n_samples: bool = True, pad: bool = True, topic: str = DEFAULT_TOPIC,
        use_batch_seqlen_balance: bool = False, dp_size: int = 1, require_dp_padding: bool = False,
        allow_partial_ready_data: bool = False,
    ) -> tuple[Any, list[int]] | tuple[None, None]:
        dock = self._dock(topic)
        if allow_partial_ready_data and not (dock.rollout.partial and consumer == ROLLOUT_CONSUMER):
            raise bad(f"allow_partial_ready_data: only '{ROLLOUT_CONSUMER}' of a partial-rollout topic reads "
                      "unfinished rows here")
        if experience_columns is None:
            try:
                experience_columns = dock.consumer_columns(consumer)
            except (InvalidExperienceError, UnknownConsumerError):
                raise bad(
                    f"No experience_columns provided, and no experience columns registered for consumer "
                    f"'{consumer}' in topic '{topic}'."
                ) from None
        if experience_count is None and indexes is None:
            raise bad("Either experience_count or indexes must be provided for get_experience")
        columns, timeout = list(experience_columns), self._timeout(dock)
        start = time.perf_counter()
        # The dock checks names and counts before it touches Redis.
        batch, rows = self._named(dock, lambda: self._get(dock, consumer, columns, experience_count, indexes,
                                                          get_n_samples, use_batch_seqlen_balance, timeout),
                                  "get experience", consumer, columns)
        self._timings["get"] += time.perf_counter() - start
        if batch is None or rows is None:
            log.debug("Get none experience.")
            return None, None
        # The queue returns rows by index; under partial rollout oldest first, as the dock picked them.
        order = list(range(len(rows))) if dock.rollout.partial else sorted(range(len(rows)), key=rows.__getitem__)
        out, rows = reordered(batch, rows, order)
        if require_dp_padding and experience_count and 0 < len(rows) < experience_count:  # MindSpeed's rule
            out, rows = dp_padded(out, rows, dp_size)
        return (mindspeed_batch(out) if pad else out), rows

    def all_consumed(self, consumer: str, topic: str = DEFAULT_TOPIC, get_n_samples: bool = True) -> bool:
        dock = self._dock(topic)
        self._done(dock, consumer)
        return dock.all_consumed(consumer)

    def all_updated(self, column: str, topic: str = DEFAULT_TOPIC) -> bool:
        dock = self._dock(topic)
        try:
            ready = self._named(dock, lambda: dock.ready_rows([column]), "all_updated", columns=[column])
        except InvalidExperienceError:
            raise bad(f"Column '{column}' not recognized.") from None
        return bool(ready[column].all())

    def reset_consumer_status(self, consumer: str, topic: str = DEFAULT_TOPIC,
                              indexes: Sequence[int] | None = None) -> None:
        self._dock(topic).reset_consumer(consumer, list(indexes) if indexes else None)

    # -- shared state -------------------------------------------------------------------------

    def get_metrics(self, topic: str = DEFAULT_TOPIC) -> Metric:
        return self._metric(self._dock(topic))

    def update_metrics(self, key: str = "", value: Any = None, cumulate: bool = False,
                       topic: str = DEFAULT_TOPIC) -> None:
        self._update_metrics(self._dock(topic), key, value, cumulate)

    def prefetch_request_index(self, experience_num: int, topic: str = DEFAULT_TOPIC) -> list[int] | None:
        return self._dock(topic).prefetch_request_index(experience_num)

    def get_cur_index(self, topic: str = DEFAULT_TOPIC) -> int:
        return self._dock(topic).get_cur_index()

    # -- multimodal labels: a column of plain values -------------------------------------------

    def put_mm_labels(self, topic: str, labels: Sequence[Any], index: Sequence[int]) -> None:
        if not labels or not index:
            raise bad("Both mm_labels and index should be provided.")
        self._dock(topic).put_experience({"labels": list(labels)}, int_rows(index))

    def get_mm_labels(self, topic: str, index: Sequence[int]) -> list[Any] | None:
        if not index:
            return None
        return self._dock(topic).read_rows(["labels"], int_rows(index))["labels"]

    # -- partial rollout ----------------------------------------------------------------------

    def increment_ages(self, topic: str = DEFAULT_TOPIC) -> None:
        """Every group that has started generating grows one iteration older."""
        self._partial_dock(topic, "increment_ages").age_groups()

    def refine_topic_for_partial_rollout(self, topic: str = DEFAULT_TOPIC) -> None:
        """Forget the rows ``actor_train`` trained on; reset the cursor and metrics. Nothing moves:
        sampling goes oldest first by the age bitmaps (see docs/mindspeed.md)."""
        self._partial_dock(topic, "refine_topic_for_partial_rollout").clear(consumer="actor_train", age=False)

    def clear_data_status(self, columns: Sequence[str], indexes: Sequence[int], topic: str = DEFAULT_TOPIC) -> None:
        """Mark rows of columns not ready, keeping their data."""
        dock = self._dock(topic)
        rows = [r for r in int_rows(indexes) if r >= 0]
        self._named(dock, lambda: dock.unready(list(columns), rows), "clear_data_status", columns=list(columns))

    def get_partial_rollout_stop_signal(self, require_max_age_all_finished: bool = True,
                                        topic: str = DEFAULT_TOPIC) -> bool:
        """``GBS_train`` groups finished, and (if required) every group of age ``max_age - 1``."""
        dock = self._partial_dock(topic, "get_partial_rollout_stop_signal")
        return dock.get_update_ready(require_max_age_all_finished)

    def _partial_dock(self, topic: str | None, what: str) -> TransferDock:
        dock = self._dock(topic)
        if not dock.rollout.partial:
            raise bad(f"{what} needs partial rollout (max_age > 1) on topic '{topic or DEFAULT_TOPIC}'")
        return dock

    def get_incomplete_response_num(self, topic: str = DEFAULT_TOPIC) -> int:
        """Prompt rows written minus response rows written, as MindSpeed's queue counts them (under
        partial rollout: minus responses finished)."""
        dock = self._dock(topic)
        if dock.rollout.partial:
            return dock.get_incomplete_response_num()
        ready = {c: v["ready"] for c, v in dock.status()["columns"].items()}
        return int(ready.get("prompts", 0) - ready.get("responses", 0))

    # -- timings (kept in this client, as MindSpeed's are per client) ---------------------------

    def create_timing_item(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise bad("Timing item name must be a non-empty string")
        if name in self._timings:
            raise bad(f"Timing item '{name}' already exists")
        self._timings[name] = 0.0

    def accumulate_timing(self, name: str, seconds: float) -> None:
        if name not in self._timings:
            raise bad(f"Unknown timing name '{name}'")
        self._timings[name] += float(seconds)

    def get_timing(self, name: str) -> float:
        if name not in self._timings:
            raise bad(f"Unknown timing name '{name}'")
        return round(self._timings[name], 6)

    def get_timings(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self._timings.items()}

    def reset_timings(self) -> None:
        self._timings = dict.fromkeys(self._timings, 0.0)


def _follows_topic(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` run once more on its topic as the server has it now, when the call failed because another
    client re-made the topic (``clear_and_resize_topic``, or ``delete_topic`` then ``add_topic``) under this
    client's cached dock: its scripts refuse the other schema (SchemaError), its row checks the other size
    (RowIndexError), or the dock is gone (DockNotFoundError). Each of those fails before anything is
    written, so the second try is the call's only effect; a topic that was not re-made raises as it did."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def following(self: TransferQueueClient, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except (SchemaError, DockNotFoundError, RowIndexError):
            bound = signature.bind(self, *args, **kwargs)
            if not self._remade(bound.arguments.get("topic") or DEFAULT_TOPIC):
                raise
        return method(self, *args, **kwargs)

    return following


#: The client's methods on one topic (every one taking ``topic``), which follow it when it is re-made.
TOPIC_METHODS = (
    "delete_topic", "clear_topic", "clear_and_resize_topic", "register_consumer_columns_dict", "get_columns",
    "get_max_len", "put_experience", "get_experience", "all_consumed", "all_updated", "reset_consumer_status",
    "get_metrics", "update_metrics", "prefetch_request_index", "get_cur_index", "put_mm_labels", "get_mm_labels",
    "increment_ages", "refine_topic_for_partial_rollout", "clear_data_status", "get_partial_rollout_stop_signal",
    "get_incomplete_response_num",
)
for _name in TOPIC_METHODS:
    setattr(TransferQueueClient, _name, _follows_topic(getattr(TransferQueueClient, _name)))


def _tq_client(url: str | Client, prefix: str, lease: float | None = None,
               durability: tuple[int, float] = (0, 1.0)) -> TransferQueueClient:
    return TransferQueueClient(url, prefix=prefix, lease=lease, wait_replicas=durability[0],
                               wait_timeout=durability[1])


def get_transfer_queue_client(name: str | None = None, *, url: str | None = None) -> TransferQueueClient:
    """MindSpeed's factory; ``name`` (its manager actor's name) is accepted and unused: there is no manager."""
    return TransferQueueClient(url or os.environ.get("REDIS_URL"))

