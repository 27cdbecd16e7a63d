"""Model-based test: random put / get / clear sequences on a tiny dock, checked against an in-memory model.

``DockModel`` is a few lines of plain Python stating what the dock should do; ``DockMachine`` drives a
real ``TransferDock`` and the model side by side and compares every reply, every value read back and,
after every step, ``status()`` and ``all_consumed()``. It runs on fakeredis and on a real redis-server
(see conftest.py), because the Lua scripts run on two different interpreters there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest
import redis
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.cluster import RedisCluster

from broker import ExperienceTimeoutError, TransferDock
from broker.control.keys import DockKeys
from tests.helpers import empty_cluster

COLUMN_NAMES = ("prompts", "responses", "rewards")
CONSUMERS = ("actor_train", "reference")

#: Dtypes and shapes cycle with the write version, so a value read back from an older write (or from
#: another column or row) differs in content, and usually in dtype and shape too.
DTYPES = (torch.int64, torch.bfloat16, torch.float32, torch.int16, torch.float64, torch.uint8)
SHAPES: tuple[tuple[int, ...], ...] = ((3,), (1, 3), (3, 1), (2, 3), ())

#: Small enough to run both backends in well under a minute on two cores.
MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: The full search runs where the scripts run on an interpreter of their own: fakeredis's Lua (lupa) and
#: Redis 7's. Redis 6.2 runs the same Lua 5.1 as Redis 7, and the cluster runs it on Redis 7 behind a
#: cluster client: there the search only has to take every rule through that server's commands and that
#: client's routing, which a quarter of the examples does many times over (25 steps each).
SHORT_SEARCH_BACKENDS = {"redis62": 15, "cluster": 15}

Store = Callable[[], redis.Redis | RedisCluster]
Batch = dict[str, list[torch.Tensor]]


def cell_value(column: int, row: int, version: int) -> torch.Tensor:
    """A tensor whose content encodes (column, row, version); dtype and shape vary with the version.

    Every number stays below 256 so bfloat16 and uint8 hold it exactly; the 0-d variant packs the
    triple into one int64.
    """
    shape = SHAPES[version % len(SHAPES)]
    if shape == ():
        return torch.tensor(column * 1_000_000 + row * 1_000 + version, dtype=torch.int64)
    triple = torch.tensor([column, row, version % 256], dtype=torch.float64)
    # Pad with a marker of the version so (2, 3) is not just the triple twice.
    flat = torch.cat([triple, triple.flip(0) + 1])[: torch.Size(shape).numel()]
    return flat.reshape(shape).to(DTYPES[version % len(DTYPES)])


def bits_of(bitmap: bytes, count: int) -> list[int]:
    """The first ``count`` bits of a Redis bitmap, bit 0 being the high bit of byte 0 as in SETBIT."""
    padded = bitmap.ljust((count + 7) // 8, b"\0")
    return [(padded[i // 8] >> (7 - i % 8)) & 1 for i in range(count)]


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Equal dtype, shape and content; torch.equal alone would accept a different dtype."""
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(got, want), f"{where}: {got.tolist()} != {want.tolist()}"


# -- the model ----------------------------------------------------------------------------------


@dataclass
class DockModel:
    """What the dock should hold: which version of which cell is written, and who consumed what."""

    prompts_num: int
    n: int
    columns: tuple[str, ...]
    consumers: tuple[str, ...]
    #: column -> row -> version of the value last written; a row is ready iff it is present.
    cells: dict[str, dict[int, int]] = field(default_factory=dict)
    #: consumer -> rows handed to it.
    consumed: dict[str, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cells = {c: {} for c in self.columns}
        self.consumed = {c: set() for c in self.consumers}

    @property
    def capacity(self) -> int:
        return self.prompts_num * self.n

    def group_rows(self, g: int) -> range:
        return range(g * self.n, (g + 1) * self.n)

    def ready(self, cols: Sequence[str], row: int) -> bool:
        return all(row in self.cells[c] for c in cols)

    def put(self, cols: Sequence[str], rows: Sequence[int], version: int) -> None:
        for c in cols:
            for r in rows:
                self.cells[c][r] = version

    def qualifying_units(self, consumer: str, cols: Sequence[str], groups: bool) -> list[int]:
        """Groups (or rows) that sampling may hand to ``consumer``, ascending."""
        taken = self.consumed[consumer]
        if groups:
            return [
                g for g in range(self.prompts_num)
                if all(self.ready(cols, r) and r not in taken for r in self.group_rows(g))
            ]
        return [r for r in range(self.capacity) if self.ready(cols, r) and r not in taken]

    def rows_of_units(self, units: Sequence[int], groups: bool) -> list[int]:
        if not groups:
            return sorted(units)
        return [r for g in sorted(units) for r in self.group_rows(g)]

    def sample_fifo(self, consumer: str, cols: Sequence[str], count: int, groups: bool) -> list[int] | None:
        """The fifo pick: the lowest qualifying units, all or nothing; marks them consumed."""
        wanted = count // self.n if groups else count
        units = self.qualifying_units(consumer, cols, groups)
        if len(units) < wanted:
            return None
        rows = self.rows_of_units(units[:wanted], groups)
        self.consumed[consumer].update(rows)
        return rows

    def take(self, consumer: str, cols: Sequence[str], rows: Sequence[int]) -> dict[str, list[int]]:
        """Explicit rows: the missing cells (column order, then row order), or mark them all consumed."""
        missing = {c: [r for r in rows if r not in self.cells[c]] for c in cols}
        missing = {c: rs for c, rs in missing.items() if rs}
        if not missing:
            self.consumed[consumer].update(rows)
        return missing

    def clear(self, rows: Sequence[int] | None) -> None:
        if rows is None:
            self.__post_init__()
            return
        for c in self.columns:
            for r in rows:
                self.cells[c].pop(r, None)
        for taken in self.consumed.values():
            taken.difference_update(rows)

    def status(self) -> dict[str, Any]:
        """The part of ``TransferDock.status()`` that depends on the contents."""
        return {
            "capacity": self.capacity,
            "columns": {
                c: {
                    "ready": len(self.cells[c]),
                    "groups_ready": sum(
                        all(r in self.cells[c] for r in self.group_rows(g)) for g in range(self.prompts_num)
                    ),
                }
                for c in self.columns
            },
            "consumers": {
                c: {"consumed": len(rows), "leased": 0, "redelivered": 0, "dead": 0}
                for c, rows in self.consumed.items()
            },
        }

    def all_consumed(self, consumer: str) -> bool:
        return len(self.consumed[consumer]) == self.capacity

    def bitmaps(self, keys: DockKeys) -> dict[str, list[int]]:
        """Every status bitmap the dock should hold (see broker/control/keys.py), as one 0/1 per row or group."""
        rows, groups = range(self.capacity), range(self.prompts_num)
        out = {}
        for c in self.columns:
            out[keys.ready(c)] = [int(r in self.cells[c]) for r in rows]
            out[keys.group_ready(c)] = [int(all(r in self.cells[c] for r in self.group_rows(g))) for g in groups]
        for c in self.consumers:
            taken = self.consumed[c]
            out[keys.consumed(c)] = [int(r in taken) for r in rows]
            out[keys.group_taken(c)] = [int(any(r in taken for r in self.group_rows(g))) for g in groups]
        return out


# -- the machine --------------------------------------------------------------------------------


class DockMachine(RuleBasedStateMachine):
    """Drives a TransferDock and a DockModel with the same calls and compares them.

    Each rule draws its arguments and calls a ``do_*`` method; the ``do_*`` methods hold all the
    comparing, so the fixed-sequence tests below run exactly the code the random runs do.
    """

    def __init__(self, fresh_store: Store):
        super().__init__()
        self.client = fresh_store()
        self.dock: TransferDock | None = None
        self.model: DockModel | None = None
        self.version = 0  # bumped by every put, so each write is told apart from the previous ones

    # -- operations, shared by the random and the fixed runs ----------------------------------

    def do_create(self, prompts_num: int, n: int, n_columns: int) -> None:
        columns = COLUMN_NAMES[:n_columns]
        # seed: the "random" policy must pick the same rows when Hypothesis replays an example.
        self.dock = TransferDock(self.client, "model", prompts_num, n, columns, CONSUMERS, seed=0)
        self.model = DockModel(prompts_num, n, columns, CONSUMERS)

    def value(self, col: str, row: int, version: int) -> torch.Tensor:
        return cell_value(self.model.columns.index(col), row, version)

    def do_put(self, cols: Sequence[str], rows: Sequence[int]) -> None:
        self.version += 1
        data = {c: [self.value(c, r, self.version) for r in rows] for c in cols}
        self.dock.put_experience(data, indexes=list(rows))
        self.model.put(cols, rows, self.version)

    def check_batch(self, batch: Batch, cols: Sequence[str], rows: Sequence[int]) -> None:
        """Every value read back is the one last written to that cell."""
        assert list(batch) == list(cols), f"batch columns {list(batch)}, asked for {list(cols)}"
        for c in cols:
            assert len(batch[c]) == len(rows), f"column {c}: {len(batch[c])} tensors for {len(rows)} rows"
            for r, got in zip(rows, batch[c]):
                want = self.value(c, r, self.model.cells[c][r])
                assert_same_tensor(got, want, f"column {c!r} row {r}")

    def do_sample(self, consumer: str, cols: Sequence[str], count: int, groups: bool) -> list[int] | None:
        """A fifo sample; its answer must be exactly the model's."""
        batch, rows = self.dock.get_experience(consumer, list(cols), count, get_n_samples=groups)
        expected = self.model.sample_fifo(consumer, cols, count, groups)
        mode = "groups" if groups else "rows"
        assert rows == expected, f"{consumer} sampled {count} in {mode} mode: got rows {rows}, model {expected}"
        if rows is None:
            assert batch is None
        else:
            self.check_batch(batch, cols, rows)
        return rows

    def do_sample_random(self, consumer: str, cols: Sequence[str], count: int, groups: bool) -> list[int] | None:
        """A random-policy sample: the model cannot predict the pick, only check it is a legal one."""
        units = self.model.qualifying_units(consumer, cols, groups)
        wanted = count // self.model.n if groups else count
        batch, rows = self.dock.get_experience(consumer, list(cols), count, get_n_samples=groups, policy="random")
        if len(units) < wanted:
            assert (batch, rows) == (None, None), f"only {len(units)} units qualify for {wanted}, got rows {rows}"
            return None
        assert rows is not None, f"{len(units)} units qualify for {wanted}, got nothing"
        assert rows == sorted(rows) and len(rows) == count, f"rows {rows} are not {count} ascending rows"
        picked = sorted({r // self.model.n for r in rows}) if groups else rows
        assert set(picked) <= set(units), f"picked {picked}, only {units} qualify"
        assert rows == self.model.rows_of_units(picked, groups), f"rows {rows} are not whole units {picked}"
        self.model.consumed[consumer].update(rows)
        self.check_batch(batch, cols, rows)
        return rows

    def do_take(self, consumer: str, cols: Sequence[str], rows: Sequence[int]) -> dict[str, list[int]]:
        """Explicit rows without waiting: returned in the given order, or a timeout naming the gaps."""
        expected_missing = self.model.take(consumer, cols, rows)
        try:
            batch, got_rows = self.dock.get_experience(consumer, list(cols), indexes=list(rows))
        except ExperienceTimeoutError as exc:
            # Compare as lists of pairs: the order of columns and rows is part of the contract.
            assert list(exc.missing.items()) == list(expected_missing.items()), (
                f"missing {exc.missing}, model {expected_missing}"
            )
            return exc.missing
        assert not expected_missing, f"rows {list(rows)} returned, but the model misses {expected_missing}"
        assert got_rows == list(rows), f"rows {got_rows}, asked for {list(rows)}"
        self.check_batch(batch, cols, rows)
        return {}

    def do_clear(self, rows: Sequence[int] | None) -> None:
        self.dock.clear(None if rows is None else list(rows))
        self.model.clear(rows)

    def compare_status(self) -> None:
        """status() and all_consumed() agree with the model."""
        status = self.dock.status()
        got = {k: status[k] for k in ("capacity", "columns", "consumers")}
        want = self.model.status()
        assert got == want, f"status {got}\n model {want}"
        for c in self.model.consumers:
            assert self.dock.all_consumed(c) == self.model.all_consumed(c), f"all_consumed({c!r})"

    def compare_all(self) -> None:
        """Everything checked after each step."""
        self.compare_status()
        self.compare_bitmaps()

    def compare_bitmaps(self) -> None:
        """The status bitmaps hold exactly the model's bits.

        White-box on purpose: status() only counts bits, so a wrong group bit (say a group still
        marked taken after its rows were cleared) would otherwise stay hidden until a later group
        sample happened to trip on it.
        """
        want = self.model.bitmaps(DockKeys(self.dock.name))
        pipe = self.client.pipeline(transaction=True)
        for key in want:
            pipe.get(key)
        wrong = {}
        for (key, bits), raw in zip(want.items(), pipe.execute()):
            # Read every stored bit, not just the first len(bits): none may be set past the end.
            got = bits_of(raw or b"", max(len(bits), 8 * len(raw or b"")))
            if got != bits + [0] * (len(got) - len(bits)):
                wrong[key] = (got, bits)
        assert not wrong, f"bitmaps (dock, model): {wrong}"

    # -- Hypothesis rules: draw arguments, then call the operations above ----------------------

    def columns_strategy(self) -> st.SearchStrategy[list[str]]:
        """A non-empty subset of the columns in any order (order shapes the batch and the errors)."""
        cols = self.model.columns
        return st.permutations(cols).flatmap(lambda p: st.integers(1, len(cols)).map(lambda k: list(p[:k])))

    def groups_strategy(self) -> st.SearchStrategy[list[int]]:
        """The rows of some whole groups."""
        m = self.model
        return st.lists(st.integers(0, m.prompts_num - 1), min_size=1, max_size=m.prompts_num, unique=True).map(
            lambda gs: [r for g in gs for r in m.group_rows(g)]
        )

    def rows_strategy(self, prefer: Sequence[int] = ()) -> st.SearchStrategy[list[int]]:
        """Distinct rows in any order: scattered rows, whole groups, or some of ``prefer``.

        Uniform row sets would mostly name an unwritten row; ``prefer`` lets a caller aim at rows
        where the interesting (successful) path runs.
        """
        m = self.model
        branches = [st.lists(st.integers(0, m.capacity - 1), min_size=1, max_size=m.capacity, unique=True)]
        branches.append(self.groups_strategy())
        if prefer:
            branches.append(st.lists(st.sampled_from(sorted(prefer)), min_size=1, max_size=len(prefer), unique=True))
        return st.one_of(branches).flatmap(st.permutations).map(list)

    def count_strategy(self, groups: bool, available: int) -> st.SearchStrategy[int]:
        """Sample sizes: often at most the ``available`` qualifying units (so sampling succeeds), else any."""
        m = self.model
        units = st.one_of(st.integers(1, max(available, 1)), st.integers(1, m.prompts_num if groups else m.capacity))
        return units.map(lambda k: k * m.n) if groups else units

    @initialize(prompts_num=st.integers(3, 4), n=st.integers(1, 3), n_columns=st.integers(2, 3))
    def create(self, prompts_num: int, n: int, n_columns: int) -> None:
        self.do_create(prompts_num, n, n_columns)

    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        """Any rows of any columns: partial groups, overwrites."""
        cols = data.draw(self.columns_strategy(), label="cols")
        self.do_put(cols, data.draw(self.rows_strategy(), label="rows"))

    @rule(data=st.data())
    def put_groups(self, data: st.DataObject) -> None:
        """Whole groups in every column: what makes sampling succeed, so it gets its own rule."""
        rows = data.draw(self.groups_strategy().flatmap(st.permutations).map(list), label="rows")
        self.do_put(list(self.model.columns), rows)

    @rule(
        data=st.data(),
        consumer=st.sampled_from(CONSUMERS),
        groups=st.booleans(),
        policy=st.sampled_from(["fifo", "random"]),
    )
    def sample(self, data: st.DataObject, consumer: str, groups: bool, policy: str) -> None:
        cols = data.draw(self.columns_strategy(), label="cols")
        available = len(self.model.qualifying_units(consumer, cols, groups))
        count = data.draw(self.count_strategy(groups, available), label="count")
        do = self.do_sample if policy == "fifo" else self.do_sample_random
        rows = do(consumer, cols, count, groups)
        # Events (shown by --hypothesis-show-statistics) tell whether both outcomes get exercised.
        event(f"sample {policy} {'groups' if groups else 'rows'}: {'hit' if rows else 'miss'}")

    @rule(data=st.data(), consumer=st.sampled_from(CONSUMERS))
    def take(self, data: st.DataObject, consumer: str) -> None:
        cols = data.draw(self.columns_strategy(), label="cols")
        ready = [r for r in range(self.model.capacity) if self.model.ready(cols, r)]
        rows = data.draw(self.rows_strategy(prefer=ready), label="rows")
        event(f"take: {'missing' if self.do_take(consumer, cols, rows) else 'hit'}")

    # One rule for both kinds of clear, with the whole-dock one rare: Hypothesis favours rules with
    # fewer arguments, and a frequent argument-less clear_all kept wiping the state the other rules build.
    @rule(data=st.data(), everything=st.sampled_from([False, False, False, True]))
    def clear(self, data: st.DataObject, everything: bool) -> None:
        # Prefer consumed rows: clearing them is what has to reset consumers' row and group marks.
        consumed = sorted(set().union(*self.model.consumed.values()))
        self.do_clear(None if everything else data.draw(self.rows_strategy(prefer=consumed), label="rows"))

    @invariant()
    @precondition(lambda self: self.dock is not None)
    def agrees_with_model(self) -> None:
        self.compare_all()

    def teardown(self) -> None:
        self.client.close()


# -- backends -----------------------------------------------------------------------------------


@pytest.fixture
def fresh_store(backend: str, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A factory of empty stores on the backend, one per Hypothesis example.

    Built like conftest's ``client``, but a fixture runs once per test, not once per example, so
    the machine calls this factory to get a fresh fakeredis server or a flushed real database.
    """
    if backend == "fake":
        yield lambda: fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    if backend == "cluster":
        yield from _fresh_clusters(request.getfixturevalue("cluster_url"))
        return
    url = request.getfixturevalue("redis62_url" if backend == "redis62" else "real_url")
    opened: list[redis.Redis] = []

    def fresh() -> redis.Redis:
        c = redis.Redis.from_url(url)
        c.flushdb()
        opened.append(c)
        return c

    c = redis.Redis.from_url(url)
    c.script_flush()  # the first example then also covers loading scripts after NOSCRIPT
    yield fresh
    c.flushdb()  # leave the database empty for the next test, as conftest's client does
    c.close()
    for o in opened:
        o.close()


def _fresh_clusters(url: str) -> Iterator[Store]:
    """``fresh_store`` on the local cluster: a cluster client per example, every primary flushed."""
    opened: list[RedisCluster] = []

    def fresh() -> RedisCluster:
        c = RedisCluster.from_url(url)
        empty_cluster(c)
        opened.append(c)
        return c

    yield fresh
    for o in opened:
        o.close()


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_random_sequences_agree_with_model(fresh_store: Store, backend: str) -> None:
    """Random put / sample / take / clear sequences: the dock behaves like DockModel."""
    examples = SHORT_SEARCH_BACKENDS.get(backend, MACHINE_SETTINGS.max_examples)
    run_state_machine_as_test(lambda: DockMachine(fresh_store),
                              settings=settings(MACHINE_SETTINGS, max_examples=examples))


def crafted_sequence(m: DockMachine) -> None:
    """A fixed walk through the tricky parts. ``m`` compares each step with the model (that is the
    test); the expected replies are spelled out as well, so the model itself is checked too."""
    m.do_create(prompts_num=3, n=2, n_columns=3)  # groups {0,1} {2,3} {4,5}
    pr, all3 = ["prompts", "responses"], ["prompts", "responses", "rewards"]
    steps: list[tuple[Callable[[], Any], Any]] = [
        (lambda: m.do_put(pr, [1, 0, 3]), None),  # group 0 complete in two columns, group 1 half
        (lambda: m.do_sample("actor_train", pr, 4, True), None),  # 2 groups asked, 1 ready: nothing
        (lambda: m.do_put(pr, [2]), None),  # completes group 1
        (lambda: m.do_sample("actor_train", ["responses", "prompts"], 4, True), [0, 1, 2, 3]),
        (lambda: m.do_sample("actor_train", ["prompts"], 2, True), None),  # group 2 was never written
        (lambda: m.do_sample("reference", ["prompts"], 1, False), [0]),  # one row, which blocks group 0 ...
        (lambda: m.do_sample("reference", ["prompts"], 4, True), None),  # ... for reference's group sampling
        (lambda: m.do_put(["prompts"], [0]), None),  # overwrite: reads must now see the new version
        (lambda: m.do_take("reference", ["rewards", "prompts"], [5, 0, 4]), {"rewards": [5, 0, 4], "prompts": [5, 4]}),
        (lambda: m.do_put(["rewards"], [0, 1, 2, 3, 4, 5]), None),
        (lambda: m.do_take("reference", ["rewards", "prompts"], [1, 0]), {}),  # given order; re-taking 0 is fine
        (lambda: m.do_clear([0]), None),  # forgets row 0: its data, and every consumer's mark on it
        (lambda: m.do_put(pr, [0]), None),  # group 0 complete again in prompts and responses ...
        (lambda: m.do_sample("reference", ["responses"], 2, True), [2, 3]),  # ... but row 1 still blocks it
        (lambda: m.do_clear([1]), None),  # now no row of group 0 is marked for reference ...
        (lambda: m.do_put(pr, [1]), None),
        (lambda: m.do_sample("reference", ["responses"], 2, True), [0, 1]),  # ... so it is handed out again
        (lambda: m.do_sample("reference", ["rewards"], 2, False), [4, 5]),  # rows 0 and 1 lost their rewards
        (lambda: m.do_put(pr, [4, 5]), None),
        (lambda: m.do_sample_random("actor_train", all3, 2, True), [4, 5]),  # the one qualifying group
        (lambda: m.do_take("actor_train", all3, [0, 1, 2, 3, 4, 5]), {"rewards": [0, 1]}),
        (lambda: m.do_clear(None), None),
        (lambda: m.do_sample("actor_train", ["prompts"], 1, False), None),  # empty dock
    ]
    m.compare_all()
    for i, (step, expected) in enumerate(steps):
        assert step() == expected, f"step {i}"
        m.compare_all()


def test_crafted_sequence_agrees_with_model(fresh_store: Store) -> None:
    """One fixed sequence through the machine's own code path, readable step by step."""
    machine = DockMachine(fresh_store)
    try:
        crafted_sequence(machine)
    finally:
        machine.teardown()


def test_machine_catches_a_disagreement(fresh_store: Store) -> None:
    """The comparison has teeth: a model that forgets one consumed row is caught at the next check."""
    machine = DockMachine(fresh_store)
    try:
        machine.do_create(prompts_num=3, n=2, n_columns=2)
        machine.do_put(["prompts", "responses"], [0, 1])
        assert machine.do_sample("actor_train", ["prompts"], 2, True) == [0, 1]
        machine.model.consumed["actor_train"].discard(1)  # the deliberate model error
        with pytest.raises(AssertionError, match="status"):
            machine.compare_status()
        # And a stale value is caught when it is read: claim row 0 holds an older version.
        machine.model.consumed["actor_train"].add(1)
        machine.model.cells["prompts"][0] -= 1
        with pytest.raises(AssertionError, match="row 0"):
            machine.do_take("reference", ["prompts"], [0])
    finally:
        machine.teardown()
