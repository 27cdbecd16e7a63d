"""TransferQueue's module-level API on the broker: ``init`` / ``close``, the KV interface (``kv_put``,
``kv_batch_put``, ``kv_batch_get``, ``kv_batch_get_by_meta``, ``kv_list``, ``kv_clear`` and their ``async_``
twins) and ``get_client``.

Over 400 lines: TransferQueue's module-level API is one module there too (``init``, the twelve KV functions and
their checks); each function is short, and the work is in client.py and system.py.

``init`` finds Redis, in this order: the conf's ``broker.url``; ``$REDIS_URL``; the system an earlier
``init`` published (a Ray actor named ``TransferQueueController`` in namespace ``transfer_queue`` when Ray is
running, as TransferQueue's tutorials look it up; else a file in this machine's temporary folder); else it
starts a private redis-server (``broker.ops.local_redis``) that lives until this process calls ``close()``
or exits. The first ``init`` writes the conf to Redis; later ones, in other processes or on other machines,
attach and read it (their own conf is ignored then, as in TransferQueue), but for ``broker.partitions``: a
process naming another count than the stored one is refused (systems.py). The conf is stored before any
dock is made, with the names of the system's docks, so every process opens the docks the first one chose.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from broker.connection import connect, disconnect, redact, redis_errors
from broker.control.keys import partition_of_name
from broker.errors import BrokerError, FencedError, InvalidExperienceError, SampleNotFoundError, SchemaError
from broker.ops.local_redis import RedisServer
from broker.transfer_queue import sampler as samplers
from broker.transfer_queue import tensors
from broker.transfer_queue.client import TransferQueueClient, _keys, _partition
from broker.transfer_queue.config import capacity_of, merged, plain
from broker.transfer_queue.keys import SystemKeys
from broker.transfer_queue.metadata import KVBatchMeta
from broker.transfer_queue.sampler import BaseSampler
from broker.transfer_queue.system import System, delivery_of, dock_name
from broker.transfer_queue.systems import Systems, dock_names

log = logging.getLogger(__name__)

#: The Ray actor TransferQueue's tutorials look up for the conf (``ray.get_actor(NAME, namespace=...)``).
CONTROLLER_NAME, CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"


class _Process:
    """This process's attachment: the conf, the system, the client, and the server it started, if any."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conf: dict[str, Any] | None = None
        self.system: Systems | None = None
        self.client: TransferQueueClient | None = None
        self.server: RedisServer | None = None
        self.published: Path | None = None
        self.controller: Any = None
        self.metrics_server: Any = None


_P = _Process()


def init(conf: Any = None) -> Any:
    """Start the system, or attach to the one already running; returns the conf in effect."""
    with _P.lock:
        if _P.client is not None:
            return _as_given(_P.conf, conf)
        wanted = merged(conf)
        url, published = _find(wanted)
        namespace = wanted["broker"]["namespace"]
        wanted["broker"]["url"] = url
        effective, docks = _settled(url, namespace, wanted, _asked_partitions(conf))
        system = open_systems(url, namespace, effective, docks)
        _P.conf, _P.system = effective, system
        _P.client = TransferQueueClient(
            system, _sampler_of(conf, effective), polling_mode=bool(effective["controller"]["polling_mode"]),
            get_meta_timeout=float(effective["broker"]["get_meta_timeout"]), lease=effective["broker"]["lease"],
            stack_uniform=bool(effective["broker"].get("stack_uniform", False)))
        if not published:
            _publish(effective)
        if effective["metrics"].get("enabled"):
            _start_metrics(effective)
        return _as_given(effective, conf)


def close() -> None:
    """Detach this process; the process that started the private redis-server stops it (and its data)."""
    with _P.lock:
        if _P.system is not None:
            _P.system.close()
        if _P.controller is not None:
            try:
                import ray

                ray.kill(_P.controller)
            except Exception as exc:  # Ray already shut down: nothing left to stop
                log.debug("could not stop the %s actor: %s", CONTROLLER_NAME, exc)
        if _P.published is not None:
            _P.published.unlink(missing_ok=True)
        if _P.server is not None:
            _P.server.stop()
        if _P.metrics_server is not None:
            _P.metrics_server.shutdown()
        _P.__init__()  # type: ignore[misc]


def get_client() -> TransferQueueClient:
    """This process's client (``init`` first)."""
    if _P.client is None:
        raise BrokerError("broker.transfer_queue is not initialized in this process: call init() first")
    return _P.client


def get_metrics_endpoint() -> str | None:
    """``host:port`` of this process's /metrics endpoint, if ``metrics.enabled``."""
    conf = _P.conf or {}
    endpoint = conf.get("metrics", {}).get("endpoint")
    return str(endpoint) if endpoint else None


# -- the KV interface ---------------------------------------------------------------------------------------


def kv_put(key: str, partition_id: str, fields: Any = None, tag: Mapping[str, Any] | None = None,
           data_parser: Any = None) -> KVBatchMeta:
    """Put one sample (``fields``: a TensorDict of batch 1 or a dict of per-sample values) and/or its tag."""
    if fields is not None and not tensors.is_tensordict(fields):
        fields = tensors.batch_of_one(fields)
    return kv_batch_put([key], partition_id, fields, None if tag is None else [dict(tag)], data_parser)


def kv_batch_put(keys: list[str], partition_id: str, fields: Any = None, tags: list[dict[str, Any]] | None = None,
                 data_parser: Any = None) -> KVBatchMeta:
    """Put samples by key: ``fields`` (a TensorDict, one row per key) and/or ``tags`` (one dict per key).

    A key new to the partition gets a row; an existing key keeps its row, and new fields add columns to it.
    Tags are merged over the key's earlier tags.
    """
    client = get_client()
    keys = _keys(keys)
    partition = _partition(partition_id)
    if not keys:
        raise InvalidExperienceError("Received an empty list as keys.")
    if fields is None and tags is None:
        raise InvalidExperienceError("kv_batch_put needs fields, tags, or both")
    if fields is not None and tensors.batch_size_of(fields) != len(keys):
        raise InvalidExperienceError(f"{len(keys)} keys but fields hold {tensors.batch_size_of(fields)} rows")
    if tags is not None and (not isinstance(tags, (list, tuple)) or len(tags) != len(keys)):
        raise InvalidExperienceError(f"tags must be a list of one dict per key ({len(keys)}), got {tags!r:.80}")
    if len(set(keys)) != len(keys):
        raise InvalidExperienceError("keys must be distinct")
    if data_parser is not None:
        raise InvalidExperienceError("data_parser is a SimpleStorage hook; parse the data before the put here")
    system = client.systems.route(partition).system
    columns = tensors.put_columns(fields, len(keys)) if fields is not None else None  # checked before any row
    if tags is not None:
        system.check_tags(partition, keys, tags)
    with system.writing():  # rows, fields, tags: no checkpoint copies the put half done
        rows = _put_by_keys(system, client, partition, keys, columns, tags)
    after = system.snapshot(partition, tag_rows=rows)  # the tags and the fields now produced: one round trip
    return KVBatchMeta(keys=list(keys), tags=after.tags, partition_id=partition, fields=after.common_fields(rows))


#: How often a kv_batch_put looks its keys up again when a kv_clear ended one of them during its put.
PUT_RETRIES = 64


def _put_by_keys(system: System, client: TransferQueueClient, partition: str, keys: list[str],
                 columns: tensors.Columns | None, tags: list[dict[str, Any]] | None) -> list[int]:
    """Write ``columns`` and then ``tags`` into the rows of ``keys`` (new rows for new keys); the rows.

    Interleavings. A kv_clear of a key between its lookup and the writes ends the key and may give its row to
    another key at once: both writes name the rows as they were looked up (their generations, lua/tq_rows.lua),
    so they are refused then (FencedError, nothing written), and the keys are looked up again; the cleared key
    gets a new row, as if this put came after the clear. The tags go after the data: a reader that polls the
    tags (verl's replay buffer) finds the data there. A put that fails for another reason (the server, a
    quota, bytes it cannot encode) gives back the rows it made for new keys, unless a clear took them since,
    so it leaves no key listed without data. Two puts making the same new key at once share its row; if one
    fails after the other wrote, its give-back ends the key with the other's data (the one window left).
    """
    for _ in range(PUT_RETRIES):
        given = system.rows_for_keys(partition, keys)
        delivery = delivery_of(given)
        try:
            if columns is not None:
                client.write_columns(partition, given.rows, columns, delivery)
            if tags is not None:
                system.set_tags(partition, given.rows, tags, delivery=delivery)
            return given.rows
        except FencedError:
            continue  # a kv_clear ended a key since its row was looked up: look the keys up again
        except BaseException:
            system.give_back(partition, given)
            raise
    raise BrokerError(f"partition {partition!r}: keys {keys[:5]!r} were cleared while this put wrote them, "
                      f"{PUT_RETRIES} times in a row")


#: How often a kv_batch_get looks its keys up again when a clear ended one of them during its read.
READ_RETRIES = 64


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> Any:
    """The samples of ``keys`` as a TensorDict in their order (``select_fields``: these fields; None: all).

    As TransferQueue answers: keys the partition does not hold are left out (SampleNotFoundError, a ValueError,
    when none is held), a key asked for twice comes twice, and the fields are those every one of the keys has
    (of ``select_fields``, those every key has: none gives an empty TensorDict; keys sharing no field raise).

    It returns the keys' own bytes or raises, whatever clears and puts run meanwhile: the rows are looked up
    with their generations in one step, and the read of their bytes is fenced by them. A kv_clear between
    the two (after which the row may be another key's) fails the read, and the keys are looked up again."""
    client = get_client()
    keys = _keys(keys)
    partition = _partition(partition_id)
    wanted = None if select_fields is None else [select_fields] if isinstance(select_fields, str) else \
        list(select_fields)
    system = client.systems.route(partition).system
    for _ in range(READ_RETRIES):
        state = system.snapshot(partition, keys=keys)  # rows, schemas and ready bits: one round trip
        rows = [r for r in state.found_rows() if r is not None]
        if not rows:
            raise SampleNotFoundError(f"keys or partition were not found! (partition {partition!r}, keys "
                                      f"{keys[:5]!r}{'...' if len(keys) > 5 else ''})")
        common = state.common_fields(rows)
        if wanted is None and not common:  # TransferQueue: keys sharing no field (or holding tags only) raise
            raise SampleNotFoundError(f"Some fields are not ready in all the requested keys! (partition "
                                      f"{partition!r}, keys {keys[:5]!r}{'...' if len(keys) > 5 else ''})")
        fields = common if wanted is None else [f for f in wanted if f in common]
        if not fields:
            return tensors.assemble({}, 0, {})  # TransferQueue's get_data of a meta naming no field
        try:
            return client.read(partition, rows, fields, state)
        except FencedError:
            continue  # a clear took a row between the lookup and the read: look the keys up again
    raise SampleNotFoundError(f"partition {partition!r}: keys {keys[:5]!r} were cleared while they were being read, "
                              f"{READ_RETRIES} times in a row")


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    """``kv_batch_get`` of a KVBatchMeta's keys and partition (its fields unless ``select_fields``)."""
    if meta.partition_id is None:
        raise InvalidExperienceError("the KVBatchMeta names no partition_id")
    fields: Any = select_fields
    if fields is None:
        fields = list(meta.fields or [])
    elif meta.fields is not None:
        wanted = [fields] if isinstance(fields, str) else list(fields)
        unknown = [f for f in wanted if f not in meta.fields]
        if unknown:
            raise InvalidExperienceError(f"select_fields {unknown} are not among the meta's fields {meta.fields}")
    if not fields:
        return kv_batch_get(list(meta.keys), meta.partition_id, None)
    return kv_batch_get(list(meta.keys), meta.partition_id, fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tags}}`` of one partition, or of all."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """End the samples of ``keys``: their data, status and tags; their rows go to new samples."""
    client = get_client()
    partition = _partition(partition_id)
    keys = _keys(keys)
    system = client.systems.route(partition).system
    got = system.read(lambda: system.client.hmget(system.keys.tq_keys(partition), keys))
    rows = [int(r) for r in got if r is not None]  # a key cleared already is not an error, as in TransferQueue
    if rows:
        system.release(partition, rows)


async def async_kv_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, *args, **kwargs)


async def async_kv_batch_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, *args, **kwargs)


async def async_kv_batch_get(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get, *args, **kwargs)


async def async_kv_batch_get_by_meta(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get_by_meta, *args, **kwargs)


async def async_kv_list(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, *args, **kwargs)


async def async_kv_clear(*args: Any, **kwargs: Any) -> None:
    await asyncio.to_thread(kv_clear, *args, **kwargs)


# -- finding Redis --------------------------------------------------------------------------------------------


def _find(conf: dict[str, Any]) -> tuple[str, bool]:
    """The Redis URL to use, and whether it was found published by another process (True) or not."""
    if conf["broker"]["url"]:
        return str(conf["broker"]["url"]), False
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"], False
    namespace = conf["broker"]["namespace"]
    from_ray = _ray_conf()
    if from_ray is not None:
        return str(from_ray["broker"]["url"]), True
    path = _publish_path(namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes starting at once: one server
        url = _published_url(path)
        if url is not None:
            return url, True
        server = RedisServer()
        server.start()
        _P.server = server
        path.write_text(server.url)
        _P.published = path
        log.info("broker.transfer_queue started a private redis-server at %s (it stops with close())", server.url)
        return server.url, False


#: Names the folder where the first ``init`` publishes the URL of the redis-server it started.
PUBLISH_DIR_ENV = "BROKER_TQ_DIR"


def _publish_path(namespace: str) -> Path:
    folder = os.environ.get(PUBLISH_DIR_ENV) or Path(tempfile.gettempdir()) / f"broker-tq-{os.getuid()}"
    return Path(folder).absolute() / f"{dock_name(namespace)}.url"  # relative: to where this process stands


def _published_url(path: Path) -> str | None:
    """The URL another process published, if its server still answers."""
    try:
        url = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        redis.Redis.from_url(url, socket_timeout=1).ping()
    except (redis.RedisError, OSError):
        return None
    return url


def _ray_conf() -> dict[str, Any] | None:
    """The conf the ``TransferQueueController`` actor holds, when Ray runs here and it exists."""
    ray = sys.modules.get("ray")  # not imported: not running here either (and importing it takes seconds)
    if ray is None or not ray.is_initialized():
        return None
    try:
        actor = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None
    conf = ray.get(actor.get_config.remote())
    return conf if isinstance(conf, dict) else None


def _publish(conf: dict[str, Any]) -> None:
    """Make the conf findable by other processes: a Ray actor when Ray runs (its tutorials read its conf)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return

    @ray.remote(num_cpus=0)
    class TransferQueueController:
        """Holds the conf (with the Redis URL) for other processes' ``init``; no data passes through it."""

        def __init__(self, conf: dict[str, Any]):
            self.conf = conf

        def get_config(self) -> dict[str, Any]:
            return self.conf

    plain = json.loads(_conf_json(conf))  # a sampler by its name, as in Redis: a StreamingDataset's conf names it
    try:
        _P.controller = TransferQueueController.options(  # type: ignore[attr-defined]
            name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE).remote(plain)
    except ValueError:  # another process published it first
        pass


#: Where the stored conf names the docks of a system cut into sub-systems (beside TransferQueue's own keys; taken
#: out of the conf as it is read, so the conf ``init`` returns is as it was given).
DOCKS = "broker_docks"


def _stored(url: str, namespace: str) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """The conf the system's first ``init`` stored and the system's docks, if the system exists."""
    client, _ = connect(url)
    try:
        with redis_errors(redact(url)):
            raw = client.get(SystemKeys(dock_name(namespace)).tq_conf)
    finally:
        disconnect(url)
    if raw is None:
        return None
    try:
        conf = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the limit, by another client
        raise SchemaError(f"the stored conf of TransferQueue system {namespace!r} is not JSON: "
                          f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    docks = conf.pop(DOCKS, None) if isinstance(conf, dict) else None
    effective = merged(conf)
    count = effective["broker"]["partitions"]
    if docks is None and count == 1:
        docks = [dock_name(namespace)]
    root = dock_name(namespace)
    if not isinstance(docks, list) or len(docks) != count or not all(
            isinstance(d, str) and (d == root if count == 1 else partition_of_name(d) == root) for d in docks):
        raise SchemaError(f"the stored conf of TransferQueue system {namespace!r} names {docks!r:.200} as its "
                          f"docks, not {count} (broker.partitions)")
    return effective, tuple(docks)


def _settled(url: str, namespace: str, wanted: dict[str, Any], asked: int | None
             ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The conf in effect and the system's docks: those stored, else ``wanted`` and docks chosen now, stored
    (SET NX) before any dock is made, so that two processes starting the system at once open the same docks.
    SchemaError if this process asked for another partition count (``asked``) than the stored one."""
    stored = _stored(url, namespace)
    if stored is None:
        docks = _chosen_docks(url, namespace, wanted)
        text = _conf_json(wanted, docks if len(docks) > 1 else None)
        client, _ = connect(url)
        try:
            with redis_errors(redact(url)):
                won = client.set(SystemKeys(dock_name(namespace)).tq_conf, text, nx=True)
        finally:
            disconnect(url)
        if won:  # ours is the stored conf: in effect as given, a sampler instance in it the caller's own object
            return wanted, docks
        stored = _stored(url, namespace)  # that of a process that stored its conf first
        if stored is None:
            raise SchemaError(f"TransferQueue system {namespace!r}: its conf vanished as it was stored (deleted "
                              "by another process?)")
    effective, docks = stored
    effective["broker"]["url"] = url
    count = effective["broker"]["partitions"]
    if asked is not None and asked != count:
        raise SchemaError(f"TransferQueue system {namespace!r} exists with broker.partitions {count}; this "
                          f"process asked for {asked}: init with partitions {count} (or without the setting), or "
                          "use another namespace")
    return effective, docks


def _chosen_docks(url: str, namespace: str, conf: dict[str, Any]) -> tuple[str, ...]:
    """The docks a system of ``conf``'s ``broker.partitions`` made now at ``url`` would have (systems.py)."""
    client, _ = connect(url)
    try:
        with redis_errors(redact(url)):
            return dock_names(client, namespace, int(conf["broker"]["partitions"]))
    finally:
        disconnect(url)


def _asked_partitions(conf: Any) -> int | None:
    """``broker.partitions`` if the conf given to ``init`` names it (checked by ``merged``), else None."""
    given = (plain(conf).get("broker") or {}) if conf is not None else {}
    value = given.get("partitions") if isinstance(given, dict) else None
    return None if value is None else int(value)


def open_systems(url: str, namespace: str, conf: dict[str, Any], docks: tuple[str, ...]) -> Systems:
    """The system ``conf`` (as stored) describes, on its ``docks``."""
    return Systems(url, namespace, capacity_of(conf), float(conf["broker"]["call_timeout"]), docks)


def _conf_json(conf: dict[str, Any], docks: Sequence[str] | None = None) -> str:
    """The conf as JSON: a sampler (an instance or a class) by its class's name, anything else as its str;
    with the system's ``docks`` when it is cut into several."""
    document = conf if docks is None else {**conf, DOCKS: list(docks)}
    return json.dumps(document, default=lambda o: o.__class__.__name__ if isinstance(o, BaseSampler) else
                      o.__name__ if isinstance(o, type) else str(o))


def _sampler_of(given: Any, conf: dict[str, Any]) -> BaseSampler:
    """The sampler of ``controller.sampler``: an instance, a class, or a name of ours. Samplers run in each
    caller's process: the caller's own conf names it; without one, the conf in effect (the stored one)."""
    own = merged(given)["controller"]["sampler"] if given is not None else None
    chosen = own if own is not None else conf["controller"]["sampler"]
    if isinstance(chosen, BaseSampler):
        return chosen
    if isinstance(chosen, type) and issubclass(chosen, BaseSampler):
        return chosen()
    if isinstance(chosen, str) and isinstance(getattr(samplers, chosen, None), type):
        made = getattr(samplers, chosen)()
        if isinstance(made, BaseSampler):
            return made
    raise SchemaError(f"controller.sampler {chosen!r} is not a sampler: name one of {samplers.__all__}, or pass a "
                      "BaseSampler subclass or instance")


def _start_metrics(conf: dict[str, Any]) -> None:
    """Serve this process's dock calls (the broker's call metrics: seconds, rows, bytes per operation of the
    system's dock) on ``metrics.port``; the dock's own counts are the exporter's (``broker exporter``)."""
    from broker.api import metrics

    port = int(conf["metrics"].get("port") or 0)
    server = metrics.start_http_server(port, addr="127.0.0.1")
    _P.metrics_server = server
    conf["metrics"]["endpoint"] = f"127.0.0.1:{server.server_port}"


def _as_given(conf: dict[str, Any] | None, given: Any) -> Any:
    """The conf, as an OmegaConf DictConfig when the caller passed one (TransferQueue returns one)."""
    if conf is None:
        return None
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return conf
    if given is None or OmegaConf.is_config(given):
        return OmegaConf.create(conf, flags={"allow_objects": True})
    return conf
