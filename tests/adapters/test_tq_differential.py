"""broker.transfer_queue side by side with the real transferqueue 0.1.11: the same calls on both, the answers
compared (values, dtypes, layouts nested or regular, metadata, statuses, and the built-in base of each error).

Real TransferQueue needs Ray: one session for the module (its controller and storage units claim a CPU each),
and the drop-in on the suite's Redis. Marked ``once`` (a minute of Ray and both systems): .ci/run runs it
once, apart from the README's test command.

Each case is a function of the module under test (``transfer_queue`` or ``broker.transfer_queue``) and a
partition name of its own. What is compared (``seen``): a TensorDict field by field (a nested tensor by its
layout, dtype and rows), a meta by its size, fields and production status, a status by its values (global
indexes are each system's own numbering), an error by the built-in exceptions it derives from (the drop-in's
carry TransferQueue's bases and the broker's own). Cases the drop-in does not answer as TransferQueue yet are
``KNOWN`` (each saying how it differs, and why, as docs/transfer_queue.md does), so one that starts to agree
fails until it is moved.
"""

from __future__ import annotations

import fractions
import logging
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.once, pytest.mark.slow, pytest.mark.real]

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as ours  # noqa: E402

#: Built-in exceptions an error is compared by.
BASES = (KeyError, ValueError, TypeError, RuntimeError, TimeoutError, IndexError, AttributeError)


@pytest.fixture(scope="module")
def both(real_url, tmp_path_factory):
    """(TransferQueue, the drop-in), each initialized; Ray for the module."""
    real = pytest.importorskip("transfer_queue")
    ray = pytest.importorskip("ray")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Its controller and 2 storage units claim a whole CPU each: on num_cpus=2 its init waits forever.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    try:
        real.init()
        ours.init({"broker": {"url": real_url, "namespace": "diff" + uuid.uuid4().hex[:8], "get_meta_timeout": 0.5}})
        try:
            yield real, ours
        finally:
            ours.get_client().system.delete()
            ours.close()
            real.close()
    finally:
        ray.shutdown()
        mp.undo()


def seen(x: Any) -> Any:
    """What is compared of an answer (see the module docstring)."""
    if isinstance(x, BaseException):
        return ("raises", sorted(b.__name__ for b in BASES if isinstance(x, b)))
    if isinstance(x, TensorDict):
        return {"batch_size": list(x.batch_size), **{k: seen(v) for k, v in sorted(x.items())}}
    if isinstance(x, torch.Tensor):
        if x.is_nested:
            return ("nested", str(x.layout), str(x.dtype), [seen(t) for t in x.unbind()])
        return ("tensor", str(x.dtype), list(x.shape), x.to(torch.float64).tolist() if x.dtype.is_floating_point
                else x.tolist() if not x.is_complex() else [str(v) for v in x.flatten().tolist()])
    if type(x).__name__ in ("NonTensorStack", "LinkedList", "NonTensorData"):
        return ("non-tensor", seen(x.tolist()))
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.tolist())
    if isinstance(x, (list, tuple)):
        return [seen(v) for v in x]
    if isinstance(x, dict):
        return {k: seen(v) for k, v in x.items()}
    if hasattr(x, "global_indexes") and hasattr(x, "field_names"):
        return ("BatchMeta", x.size, list(x.field_names), seen(x.production_status), seen(list(x.custom_meta)))
    if hasattr(x, "keys") and hasattr(x, "tags") and hasattr(x, "partition_id"):
        return ("KVBatchMeta", list(x.keys), seen(x.tags), sorted(x.fields or []))
    return x


def status(got: tuple[Any, Any]) -> Any:
    """A status without the global indexes, each system's own numbering."""
    indexes, values = got
    return None if indexes is None else (len(indexes), values)


def two(tq: Any, p: str) -> None:
    """Keys a (fields x, y) and b (x) in partition p."""
    tq.kv_put("a", p, {"x": torch.ones(2), "y": torch.zeros(2)})
    tq.kv_put("b", p, {"x": torch.ones(2) * 2})


def td(**fields: Any) -> TensorDict:
    size = len(next(iter(fields.values())))
    return TensorDict(fields, batch_size=size)


Case = Callable[[Any, str], Any]

CASES: dict[str, Case] = {
    # layouts: every field of tensor rows jagged, rows of one shape included; scalars stacked
    "layouts of a batch put": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(reg=torch.ones(2, 4), score=torch.tensor([1.0, 2.0]),
                                          rag=torch.nested.nested_tensor([torch.arange(3), torch.arange(5)],
                                                                         layout=torch.jagged))),
        tq.kv_batch_get(["a", "b"], p))[1],
    "layouts of samples put one by one": lambda tq, p: (
        tq.kv_put("c", p, {"r": torch.arange(4)}), tq.kv_put("d", p, {"r": torch.arange(4) + 1}),
        tq.kv_batch_get(["c", "d"], p))[2],
    "shapes that differ later": lambda tq, p: (
        tq.kv_put("a", p, {"v": torch.ones(2)}), tq.kv_put("b", p, {"v": torch.ones(3)}),
        tq.kv_batch_get(["a", "b"], p))[2],
    "plain values": lambda tq, p: (tq.kv_put("a", p, {"n": 3, "s": "str", "t": torch.tensor(1.5)}),
                                   tq.kv_batch_get(["a"], p))[1],
    # partial gets
    "select a field one key lacks": lambda tq, p: (two(tq, p), tq.kv_batch_get(["a", "b"], p, select_fields="y"))[1],
    "fields every key has": lambda tq, p: (two(tq, p), tq.kv_batch_get(["a", "b"], p))[1],
    "keys sharing no field": lambda tq, p: (
        tq.kv_put("a", p, {"x": torch.ones(2)}), tq.kv_put("b", p, {"y": torch.ones(2)}),
        tq.kv_batch_get(["a", "b"], p))[2],
    "a key holding tags only": lambda tq, p: (
        tq.kv_put("k", p, tag={"status": "pending"}), tq.kv_batch_get(["k"], p))[1],
    "select a known and an unknown field": lambda tq, p: (
        two(tq, p), tq.kv_batch_get(["a", "b"], p, select_fields=["x", "zz"]))[1],
    "select an unknown field": lambda tq, p: (two(tq, p), tq.kv_batch_get(["a", "b"], p, select_fields=["zz"]))[1],
    "a missing key among others": lambda tq, p: (two(tq, p), tq.kv_batch_get(["zz", "b", "a"], p))[1],
    "every key missing": lambda tq, p: (two(tq, p), tq.kv_batch_get(["zz"], p))[1],
    "an unknown partition": lambda tq, p: tq.kv_batch_get(["a"], p),
    "a key twice": lambda tq, p: (two(tq, p), tq.kv_batch_get(["a", "a", "b"], p, "x"))[1],
    "the meta of a missing key and a held one": lambda tq, p: (
        two(tq, p), tq.get_client().kv_retrieve_meta(["a", "zz"], p))[1],
    "the meta of unknown keys": lambda tq, p: tq.get_client().kv_retrieve_meta(["k"], p, create=False),
    # puts
    "no keys": lambda tq, p: tq.kv_batch_put([], p, td(x=torch.ones(0, 2))),
    "no keys, tags": lambda tq, p: tq.kv_batch_put([], p, tags=[]),
    "keys and rows of other counts": lambda tq, p: tq.kv_batch_put(["a", "b"], p, td(x=torch.ones(1, 2))),
    "a key twice in a put": lambda tq, p: tq.kv_batch_put(["a", "a"], p, td(x=torch.ones(2, 2))),
    "neither fields nor tags": lambda tq, p: tq.kv_batch_put(["a"], p),
    "a key that is not a str": lambda tq, p: tq.kv_batch_put([1], p, td(x=torch.ones(1, 2))),
    "the empty key": lambda tq, p: (tq.kv_put("", p, {"v": torch.ones(2)}), tq.kv_batch_get([""], p))[1],
    "a key with spaces and accents": lambda tq, p: (tq.kv_put("a b é/:*", p, {"v": torch.ones(2)}),
                                                    tq.kv_list(p))[1],
    "a long key": lambda tq, p: (tq.kv_put("k" * 500, p, {"v": torch.ones(2)}), tq.kv_list(p))[1],
    "tags alone": lambda tq, p: (tq.kv_batch_put(["a"], p, tags=[{"t": 1}]), tq.kv_list(p))[1],
    "tags merged": lambda tq, p: (tq.kv_batch_put(["a"], p, tags=[{"t": 1}]),
                                  tq.kv_batch_put(["a"], p, tags=[{"u": 2}]), tq.kv_list(p))[2],
    "a put's meta": lambda tq, p: tq.kv_batch_put(["a", "b"], p, td(x=torch.ones(2, 2)), [{"t": 1}, {"t": 2}]),
    # listing and clearing
    "listing an unknown partition": lambda tq, p: tq.kv_list(p),
    "listing after every key was cleared": lambda tq, p: (two(tq, p), tq.kv_clear(["a", "b"], p), tq.kv_list(p))[2],
    "clearing a missing key": lambda tq, p: tq.kv_clear(["nope"], p),
    # orders: keys as first given rows, partitions as made (dicts compare without order: lists compared here)
    "keys listed in the order they were first put": lambda tq, p: (  # on rows freed last first
        tq.kv_batch_put(["f", "g", "h"], p, td(x=torch.ones(3, 2))), tq.kv_clear(["h"], p), tq.kv_clear(["g"], p),
        tq.kv_batch_put(["z", "y"], p, td(x=torch.ones(2, 2))), tq.kv_put("m", p, {"x": torch.ones(2)}),
        tq.kv_batch_put(["a", "z", "b"], p, tags=[{}, {"t": 1}, {}]), list(tq.kv_list(p)[p]))[6],
    "a key cleared and put again is listed last": lambda tq, p: (
        tq.kv_batch_put(["c", "b", "a"], p, td(x=torch.ones(3, 2))), tq.kv_clear(["c", "b"], p),
        tq.kv_put("c", p, {"x": torch.ones(2)}), tq.kv_put("d", p, {"x": torch.ones(2)}),
        list(tq.kv_list(p)[p]))[4],
    "keys given rows by a meta and by puts": lambda tq, p: (
        tq.kv_batch_put(["b", "c", "d"], p, td(x=torch.ones(3, 2))), tq.kv_clear(["d"], p), tq.kv_clear(["c"], p),
        tq.get_client().kv_retrieve_meta(["q", "b", "a"], p, create=True),
        tq.kv_put("0", p, {"x": torch.ones(2)}), list(tq.kv_list(p)[p]))[5],
    "partitions listed in the order they were made": lambda tq, p: (
        tq.kv_put("a", p + "-2", {"x": torch.ones(2)}), tq.kv_put("a", p + "-1", {"x": torch.ones(2)}),
        tq.kv_put("a", p + "-3", {"x": torch.ones(2)}), tq.get_client().clear_partition(p + "-2"),
        tq.kv_put("a", p + "-2", {"x": torch.ones(2)}),
        [q for q in tq.kv_list() if q.startswith(p)],
        [q for q in tq.get_client().get_partition_list() if q.startswith(p)])[5:],
    # the low-level client
    "an insert's meta": lambda tq, p: tq.get_client().get_meta(["a", "b"], 2, p, mode="insert"),
    "a put into an insert's meta": lambda tq, p: (
        lambda c, m: (c.put(td(a=torch.ones(2, 3)), metadata=m) is m, m))(
        tq.get_client(), tq.get_client().get_meta(["a", "b"], 2, p, mode="insert")),
    "get_data of a meta with no field": lambda tq, p: tq.get_client().get_data(
        tq.get_client().kv_retrieve_meta(["x", "y"], p, create=True)),
    "fetch and get_data": lambda tq, p: (
        tq.get_client().put(td(x=torch.ones(2, 3), y=torch.arange(2)), partition_id=p),
        tq.get_client().get_data(tq.get_client().get_meta(["x", "y"], 2, p, task_name="t")))[1],
    "get_meta with a bad mode": lambda tq, p: tq.get_client().get_meta(["x"], 1, p, mode="nope", task_name="t"),
    "get_meta without a task": lambda tq, p: (two(tq, p), tq.get_client().get_meta(["x"], 1, p))[1],
    "get_meta of too many rows": lambda tq, p: (two(tq, p), tq.get_client().get_meta(["x"], 5, p, task_name="t"))[1],
    "force_fetch naming no field": lambda tq, p: (
        two(tq, p), tq.get_client().get_meta([], 1, p, mode="force_fetch"))[1],
    "force_fetch of an unknown partition": lambda tq, p: tq.get_client().get_meta(["a"], 1, p, mode="force_fetch"),
    # statuses
    "production status": lambda tq, p: (two(tq, p), status(tq.get_client().get_production_status(["x", "y"], p)))[1],
    "production status of an unknown field": lambda tq, p: (
        two(tq, p), tq.get_client().get_production_status(["x", "zz"], p))[1],
    "production status of an unknown partition": lambda tq, p: tq.get_client().get_production_status(["a"], p),
    "check production": lambda tq, p: (two(tq, p), tq.get_client().check_production_status(["x", "y"], p))[1],
    "consumption status": lambda tq, p: (
        two(tq, p), tq.get_client().get_meta(["x"], 1, p, task_name="t"),
        status(tq.get_client().get_consumption_status("t", p)))[2],
    "consumption status of an unknown task": lambda tq, p: (
        two(tq, p), status(tq.get_client().get_consumption_status("nobody", p)))[1],
    "consumption status of an unknown partition": lambda tq, p: tq.get_client().get_consumption_status("t", p),
    "check consumption of an unknown partition": lambda tq, p: tq.get_client().check_consumption_status("t", p),
    # values that are not tensors
    "numpy object arrays of strings": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(s=np.array(["x", "yy"], dtype=object))), tq.kv_batch_get(["a", "b"], p))[1],
    "numpy object arrays of nested values": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(s=np.array([{"k": [1, 2]}, None], dtype=object))),
        tq.kv_batch_get(["a", "b"], p))[1],
    "numpy object arrays of bytes and numbers": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(s=np.array([b"x", 3.5], dtype=object))), tq.kv_batch_get(["a", "b"], p))[1],
    "a 2-d numpy object array": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(s=np.array([["x", "y"], ["z", None]], dtype=object))),
        tq.kv_batch_get(["a", "b"], p))[1],
    "a numpy array of str": lambda tq, p: (
        tq.kv_batch_put(["a", "b"], p, td(s=np.array(["x", "yy"]))), tq.kv_batch_get(["a", "b"], p))[1],
    "a numpy object array in one sample": lambda tq, p: (
        tq.kv_put("a", p, {"s": np.array(["x", {"k": 1}], dtype=object)}), tq.kv_batch_get(["a"], p))[1],
    "a list in one sample": lambda tq, p: (tq.kv_put("a", p, {"s": [1, "y", None]}), tq.kv_batch_get(["a"], p))[1],
    # dtypes
    "complex64 rows": lambda tq, p: (
        tq.kv_batch_put(["a"], p, td(c=torch.ones(1, 2, dtype=torch.complex64))), tq.kv_batch_get(["a"], p))[1],
    "uint16 rows": lambda tq, p: (
        tq.kv_batch_put(["a"], p, td(c=torch.ones(1, 2, dtype=torch.uint16))), tq.kv_batch_get(["a"], p))[1],
    "float8_e4m3fn rows": lambda tq, p: (
        tq.kv_batch_put(["a"], p, td(c=torch.ones(1, 2).to(torch.float8_e4m3fn))),
        (lambda c: (str(c.dtype), c.is_nested, [r.float().tolist() for r in c.unbind()]))(
            tq.kv_batch_get(["a"], p)["c"]))[1],
    # names
    "a field name with spaces and accents": lambda tq, p: (
        tq.kv_put("a", p, {"my field é": torch.ones(2)}), tq.kv_batch_get(["a"], p))[1],
    "the empty field name": lambda tq, p: (tq.kv_put("a", p, {"": torch.ones(2)}), tq.kv_batch_get(["a"], p))[1],
    "a field name of 300 characters": lambda tq, p: (
        tq.kv_put("a", p, {"f" * 300: torch.ones(2)}), tq.kv_batch_get(["a"], p))[1],
    "a field name of the adapter's own": lambda tq, p: (
        tq.kv_put("a", p, {"tq.sample": torch.ones(2), "a:b{c}*": torch.zeros(1)}), tq.kv_batch_get(["a"], p))[1],
    "the empty partition": lambda tq, p: (tq.kv_put("a", "", {"v": torch.ones(2)}), tq.kv_list(""),
                                          tq.kv_clear(["a"], ""))[1],
    "a partition with spaces, braces and accents": lambda tq, p: (
        tq.kv_put("a", p + " é:{x}", {"v": torch.ones(2)}), tq.kv_batch_get(["a"], p + " é:{x}"))[1],
    "a task name with spaces and accents": lambda tq, p: (
        tq.kv_put("a", p, {"v": torch.ones(2)}), tq.get_client().get_meta(["v"], 1, p, task_name="t é {x}:*"),
        status(tq.get_client().get_consumption_status("t é {x}:*", p)))[2],
    "statuses of a field with an odd name": lambda tq, p: (
        tq.kv_put("a", p, {"odd é": torch.ones(2)}),
        tq.kv_put("b", p, {"odd é": torch.ones(2), "odd 2": torch.ones(2)}),
        status(tq.get_client().get_production_status(["odd 2", "odd é", "odd 2"], p)))[2],
}

#: Where the drop-in answers otherwise on purpose, and why (docs/transfer_queue.md, "Where we differ").
KNOWN: dict[str, tuple[str, Case]] = {
    "an object that is not plain data": (
        "refused at the put, naming the field and row: TransferQueue pickles it, and the broker never unpickles "
        "what it reads from a shared Redis",
        lambda tq, p: (tq.kv_put("a", p, {"q": fractions.Fraction(1, 3)}), tq.kv_batch_get(["a"], p))[1]),
    "status columns of fields first put in another order elsewhere": (
        "a production status's columns follow the order fields were first put into the system, TransferQueue's "
        "into the partition: the same where partitions get their fields in one order, as a pipeline's steps do",
        lambda tq, p: (tq.kv_put("a", p + "1", {"v": torch.ones(2)}), tq.kv_put("a", p + "1", {"w": torch.ones(2)}),
                       tq.kv_put("a", p + "2", {"w": torch.ones(2)}), tq.kv_put("b", p + "2", {"v": torch.ones(2)}),
                       status(tq.get_client().get_production_status(["v", "w"], p + "2")))[4]),
}


def answer(tq: Any, case: Case, partition: str) -> Any:
    try:
        return seen(case(tq, partition))
    except Exception as exc:  # noqa: BLE001 - an error is an answer too, compared by its bases
        return seen(exc)


def same(mine: Any, theirs: Any) -> bool:
    """Equal answers; an error of the drop-in may derive from more built-in exceptions than TransferQueue's."""
    if isinstance(theirs, tuple) and theirs[:1] == ("raises",):
        return isinstance(mine, tuple) and mine[:1] == ("raises",) and set(theirs[1]) <= set(mine[1])
    return bool(mine == theirs)


@pytest.mark.parametrize("name", list(CASES))
def test_the_drop_in_answers_as_transfer_queue(both, name):
    real, dropin = both
    partition = "p-" + uuid.uuid4().hex[:8]  # each system its own, the same name on both
    theirs, mine = answer(real, CASES[name], partition), answer(dropin, CASES[name], partition)
    assert same(mine, theirs), f"{name}:\n  TransferQueue: {theirs!r:.800}\n  the drop-in:   {mine!r:.800}"


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_differences_are_still_what_the_docs_say(both, name):
    """A known difference that disappears fails here: move the case to CASES (and out of the docs)."""
    real, dropin = both
    why, case = KNOWN[name]
    partition = "p-" + uuid.uuid4().hex[:8]
    theirs, mine = answer(real, case, partition), answer(dropin, case, partition)
    assert not same(mine, theirs), f"{name} now answers as TransferQueue: move it to CASES ({why})"
