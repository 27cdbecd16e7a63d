"""One rank of a role's worker group, run as a Ray actor: it loops on the broker, not on the driver.

Per iteration the driver only says "go" (with new weights, if the role follows the trainer); the
rank then runs ``while not all_consumed: dispatch -> compute -> collect`` against the dock, at
whatever pace the stages before it write rows, and returns what it did and when it was busy.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from broker import FencedError, TransferDock

from ..algorithms.roles import DROP, Role, Trainer, checksum, make_role
from ..config import RunConfig
from ..model import task
from ..model.parallel_state import ParallelState
from .dispatch import Dispatcher, guaranteed_ranges

log = logging.getLogger(__name__)

#: Longest wait of a get up to the filter under dynamic sampling (see ``run_iteration``), in seconds.
TRICKLE_WAIT = 0.2


class RoleWorker:
    """Rank ``rank`` of role ``role``'s ``dp x tp`` group."""

    def __init__(self, role: str, cfg: RunConfig, dock: TransferDock, rank: int) -> None:
        # Many actors share few cores: a second intra-op thread only fights the neighbours for a core.
        torch.set_num_threads(1)
        self.role_name = role
        self.cfg = cfg
        self.dock = dock
        self.rank = rank
        self.layout = cfg.layout(role)
        self.state: ParallelState | None = None
        self.role: Role | None = None
        self.dispatcher: Dispatcher | None = None
        #: Rows admitted by the dock's admission control and not generated yet (asynchronous rollout).
        self._owed = 0

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the group's rendezvous."""
        import ray  # only meaningful inside a Ray worker

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str | None, master_port: int | None) -> dict[str, Any]:
        """Join the group's process groups (blocks until every rank has called it) and build the role."""
        self.state = ParallelState(self.layout, self.rank, master_addr, master_port)
        self.role = make_role(self.role_name, self.cfg, self.state)
        self.dispatcher = Dispatcher(self.dock, self.role_name, self.state, pad_id=task.EOS,
                                     lease=self.cfg.lease_seconds)
        return {"role": self.role_name, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}

    def run_iteration(self, iteration: int, weights: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
        """Drain this role's share of the dock; returns busy intervals (wall clock), counts and stats."""
        assert self.role is not None and self.dispatcher is not None and self.state is not None, "setup() first"
        if weights is not None:
            self.role.load_weights(weights)
        if self.role_name == "actor_rollout" and self.cfg.tracked:
            return self._rollout_iteration(iteration)
        cfg, state = self.cfg, self.state
        algorithm = cfg.algorithm
        count = cfg.rows_per_get(self.role_name)
        plan = guaranteed_ranges(cfg.capacity, state.dp_size, state.dp_rank, count) if cfg.guarantee_order else None
        get_kwargs = {"get_n_samples": False} if algorithm.row_sampling and plan is None else {}
        done = self.dispatcher.all_consumed
        # Replacement groups arrive a few at a time, and a get of more rows than there are waits forever:
        # up to the filter, a role takes a full batch if there is one, else waits for a single group.
        trickle = self.role_name in algorithm.before_filter
        if trickle and self.role_name != algorithm.filter_role:
            # Dropped groups come back as new prompts, and a drop un-consumes the group's rows for every
            # stage: a stage before the filter that had consumed every row must still wait for them. It
            # is done once the filter's output is written on every row: the filter writes it only for
            # the groups it keeps, and never holds a group again once kept. (Not the filter's
            # all_consumed: between its get and its drop it has consumed rows it is about to give back.)
            kept_column = algorithm.outputs[algorithm.filter_role][0]
            done = lambda: self.dispatcher.agree(  # noqa: E731
                lambda: self.dock.status()["columns"][kept_column]["ready"] == cfg.capacity)
        busy: list[tuple[float, float]] = []
        trace: list[dict[str, Any]] = []
        rows_done = 0
        last_progress = time.monotonic()
        while not done():
            indexes = None
            if plan is not None:
                if not plan:
                    break  # this DP rank's fixed range is done; the others finish theirs
                indexes = plan[0]
            if trickle:
                # A short wait: the batch can be complete while this get waits for a group that will never
                # come, and only a return to ``done()`` sees it (a put of the filter's output wakes the
                # get, which finds nothing and would sleep on for the rest of ``poll_seconds``).
                got = (self.dispatcher.dispatch(self.role.inputs, count, **get_kwargs)
                       or self.dispatcher.dispatch(self.role.inputs, cfg.n, timeout=min(cfg.poll_seconds, TRICKLE_WAIT),
                                                   **get_kwargs))
            else:
                got = self.dispatcher.dispatch(self.role.inputs, count, indexes, timeout=cfg.poll_seconds,
                                               **get_kwargs)
            if got is None:
                self._check_stall(last_progress, iteration, "while rows are still owed; is a stage before it stuck?")
                continue
            start = time.time()
            batch, rows = got
            if plan is not None:
                plan.pop(0)
            output = self.role.compute(batch, rows, iteration)
            kept = self._drop(output, rows) if DROP in output else rows
            if kept:  # a filter may have dropped every group it got
                self.dispatcher.collect(output, kept)
            busy.append((start, time.time()))
            if cfg.trace:
                trace.append({"indexes": rows, "checksum": checksum(batch, rows), "kept": kept})
            rows_done += len(rows)
            last_progress = time.monotonic()
        start = time.time()
        if self.role.finish_iteration(iteration):
            busy.append((start, time.time()))
        if isinstance(self.role, Trainer) and cfg.tracked and state.dp_rank == 0 and state.is_tp_src:
            self.dock.set_version(iteration)  # the weights now include `iteration` updates
        return self._result(rows_done, busy, trace)

    def _drop(self, output: dict[str, list[Tensor]], rows: list[int]) -> list[int]:
        """Drop the groups the role rejected (``output[DROP]``) and keep only the other rows' outputs.

        The drop goes first, then the put of the kept rows: a dropped group's rows are forgotten before
        anything else is written, and the driver may put new prompts there at once. Nothing else holds
        them: the stages after this one read its output, which the dropped rows never get.
        """
        assert self.dispatcher is not None
        groups = [int(g) for g in output.pop(DROP)[0].tolist()]
        if groups and self.dispatcher.state.is_tp_src:
            # Fenced by the delivery: a filter late for its groups (refilled meanwhile) drops nothing, and
            # the rows are no longer this worker's to write either.
            try:
                self.dock.drop_groups(self.role_name, groups, delivery=self.dispatcher.delivery)
            except FencedError as exc:
                log.warning("%s: groups %s not dropped: %s", self.role_name, groups, exc)
                return []
        n = self.cfg.n
        gone = set(groups)
        keep = [i for i, row in enumerate(rows) if row // n not in gone]
        for column, values in output.items():
            output[column] = [values[i] for i in keep]
        return [rows[i] for i in keep]

    def _check_stall(self, last_progress: float, iteration: int, detail: str | Callable[[], str]) -> None:
        """Raise TimeoutError once this rank has got no rows for ``stall_seconds``: a stage before it is stuck."""
        seconds = self.cfg.stall_seconds
        if time.monotonic() - last_progress > seconds:
            text = detail() if callable(detail) else detail
            raise TimeoutError(
                f"{self.role_name} rank {self.rank}: no rows for {seconds:.0f} s in iteration {iteration} {text}"
            )

    def _result(self, rows_done: int, busy: list[tuple[float, float]], trace: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.role is not None and self.state is not None
        state = self.state
        return {
            "role": self.role_name,
            "rank": self.rank,
            "dp_rank": state.dp_rank,
            "tp_rank": state.tp_rank,
            "rows": rows_done,
            "busy": busy,
            "stats": self.role.take_stats(),
            "trace": trace,
        }

    def _rollout_iteration(self, iteration: int) -> dict[str, Any]:
        """The rollout's loop when the dock keeps groups across iterations.

        Partial rollout (``--max-age``): passes over unfinished rows, oldest first, each adding at most the
        token budget, until the dock's stop signal (``get_update_ready``: GBS_train groups finished and
        none of the oldest age left unfinished). Asynchronous (``--max-staleness``): generate whatever the
        dock's admission control (``prefetch_request_index``) lets through with the weights this rank
        has, and stop once it refuses (the rollout is as far ahead as the bound allows) or the trainer
        published newer weights.
        """
        assert self.role is not None and self.dispatcher is not None
        cfg, dock, dispatcher = self.cfg, self.dock, self.dispatcher
        version = iteration - 1  # the weights this rank has: the trainer's after iteration - 1 updates
        self.role.version = version  # type: ignore[attr-defined]
        count = cfg.rows_per_get(self.role_name)
        busy: list[tuple[float, float]] = []
        trace: list[dict[str, Any]] = []
        rows_done = 0
        last_progress = time.monotonic()

        def stop() -> bool:  # rank 0 only
            if cfg.partial:
                return dock.get_update_ready(require_max_age_all_finished=True)
            if dock.version() > version:
                return True  # newer weights are out; this rank gets them with the next iteration
            if self._owed == 0:
                admitted = dock.prefetch_request_index(count)
                if admitted is None:
                    if dock.all_consumed(self.role_name):
                        return True
                    time.sleep(0.05)  # the other rollout ranks still generate the rows this iteration trains
                else:
                    self._owed = len(admitted)
            return False

        while not dispatcher.agree(stop):
            ask = count if cfg.partial else min(count, self._owed)
            got = dispatcher.dispatch(self.role.inputs, ask, timeout=cfg.poll_seconds, get_n_samples=False)
            if got is None:
                self._check_stall(last_progress, iteration,
                                  lambda: f"to generate; dock status {dock.status()['rollout']}")
                continue
            start = time.time()
            batch, rows = got
            output = self.role.compute(batch, rows, iteration)
            completed = output.pop("rollout_completed")
            dispatcher.collect(output, rows, rollout_completed=completed, version=version)
            busy.append((start, time.time()))
            if cfg.trace:
                trace.append({"indexes": rows, "checksum": checksum(batch, rows)})
            self._owed = max(0, self._owed - len(rows))
            rows_done += len(rows)
            last_progress = time.monotonic()
        return self._result(rows_done, busy, trace)

    def export_state(self) -> dict[str, Any]:
        """A trainer rank's model shard and optimizer state (see ``Trainer.export_state``)."""
        if not isinstance(self.role, Trainer):
            raise TypeError(f"{self.role_name} does not train; only a trainer's state is kept for restarts")
        return self.role.export_state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Load what ``export_state`` took on the rank this one replaces."""
        if not isinstance(self.role, Trainer):
            raise TypeError(f"{self.role_name} does not train")
        self.role.load_state(state)

    def export_weights(self) -> dict[str, Tensor] | None:
        """The trainer's full weights from its first TP group's rank 0; None on every other rank."""
        if not isinstance(self.role, Trainer):
            raise TypeError(f"{self.role_name} does not train; only actor_train exports weights")
        return self.role.export_weights()

    def weights_checksum(self) -> int | None:
        """CRC32 of this rank's weight shard, or None for a role without a model (tests compare replicas)."""
        model = getattr(self.role, "model", None)
        if model is None:
            return None
        crc = 0
        for _, value in sorted(model.state_dict().items()):
            crc = zlib.crc32(value.detach().contiguous().numpy().tobytes(), crc)
        return crc

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
