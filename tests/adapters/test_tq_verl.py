"""verl 0.9.1, a real TransferQueue client, as the judge of broker.transfer_queue: verl's own TransferQueue-facing
functions and classes run once on TransferQueue 0.1.11 and once on the drop-in, and what they return, store and
hand on is compared (values, dtypes, nested or regular layouts, tags, metas, metrics).

verl imports ``transfer_queue`` by name; for the drop-in run its modules' ``tq``, ``BatchMeta`` and
``KVBatchMeta`` names (and ``sys.modules["transfer_queue"]``, which some functions import late) are pointed at
``broker.transfer_queue``: the one edit per import the docs ask of a user. Nothing verl does with the data is
re-implemented here. Only what is not TransferQueue-facing is stood in for, each stand-in saying so: the LLM
generation of one agent loop (a fixed AgentLoopOutput per prompt and session), the model behind the worker
groups (deterministic log-probs, entropies and values computed from the rows verl's tqbridge hands it), the
reward model (a rule score), the tokenizer (token ids joined as text), the weight-sync and checkpoint engines
(no-ops), the dataloader (verl's own collate_fn over fixed prompts), Ray's actor dispatch (verl's own DP split
and concat functions, run in this process) and the random uuids (a counter, so both runs use the same keys).
The stand-in LLM finishes sessions in one fixed order. Both systems run every case, one after the other, each
cleared between cases as verl would clear it (so the drop-in reuses freed rows, as TransferQueue its indexes):
kv_list's order, which verl's replay buffers build their batches in, follows the keys, not the rows.

Needs verl (``pip install verl==0.9.1``: it is not one of the project's extras) besides TransferQueue and Ray:
skipped without it. Marked ``once``, as tests/adapters/test_tq_differential.py whose module fixture it reuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.once, pytest.mark.slow, pytest.mark.real]

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
pytest.importorskip("ray")

import verl  # noqa: E402
import verl.utils.tensordict_utils as tu  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.single_controller.base.decorator import (  # noqa: E402
    _concat_data_proto_or_future,
    _split_args_kwargs_data_proto,
)
from verl.trainer.ppo import padding_utils  # noqa: E402
from verl.trainer.ppo.metric_utils import RolloutMoELoadBalanceMetricsAccumulator  # noqa: E402
from verl.trainer.ppo.v1 import agent_loop_tq, trainer_base  # noqa: E402
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync  # noqa: E402
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import transferqueue_utils  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402
from verl.utils.skip import rollout_skip  # noqa: E402
from verl.utils.transferqueue_utils import tqbridge  # noqa: E402

from tests.adapters.test_tq_differential import both  # noqa: E402, F401

VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config"

#: The names each verl module bound at import (``import transfer_queue as tq``, ``from transfer_queue import
#: KVBatchMeta``...): the drop-in run points them at broker.transfer_queue.
BINDINGS = {
    "verl.utils.transferqueue_utils": ("tq", "BatchMeta", "KVBatchMeta"),
    "verl.protocol": ("BatchMeta", "KVBatchMeta"),
    "verl.trainer.ppo.v1.replay_buffer": ("tq", "KVBatchMeta"),
    "verl.trainer.ppo.v1.agent_loop_tq": ("tq",),
    "verl.trainer.ppo.v1.trainer_base": ("tq", "KVBatchMeta"),
    "verl.trainer.ppo.v1.trainer_separate_async": ("KVBatchMeta",),
    "verl.trainer.ppo.padding_utils": ("tq", "KVBatchMeta"),
}


@contextlib.contextmanager
def verl_on(system: Any):
    """verl's modules using ``system`` (the real ``transfer_queue`` or the drop-in) as their TransferQueue."""
    mp = pytest.MonkeyPatch()
    try:
        for module, names in BINDINGS.items():
            m = importlib.import_module(module)
            for name in names:
                mp.setattr(m, name, system if name == "tq" else getattr(system, name))
        mp.setitem(sys.modules, "transfer_queue", system)  # rollout_skip, tracking, main_ppo import it late
        mp.setattr(transferqueue_utils, "TQ_INITIALIZED", False)  # verl's bridge calls tq.init() itself
        counter = itertools.count()  # stand-in for uuid4 (trainer uids, padding uids): the same keys on both
        fake_uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=(next(counter) + 1) << 64))
        mp.setattr(trainer_base, "uuid", fake_uuid)
        mp.setattr(padding_utils, "uuid", fake_uuid)
        yield
    finally:
        mp.undo()


def wipe(system: Any) -> None:
    """Clear every key of every partition: verl hard-codes its partitions ("train", "val")."""
    for partition, items in (system.kv_list() or {}).items():
        if items:
            system.kv_clear(list(items), partition)


# -- what is compared ---------------------------------------------------------------------------------------

BASES = (KeyError, ValueError, TypeError, RuntimeError, TimeoutError, IndexError, AttributeError, AssertionError)


def seen(x: Any) -> Any:
    """What is compared of an answer: values with their types, tensors with dtype and layout."""
    if isinstance(x, BaseException):
        return ("raises", sorted(b.__name__ for b in BASES if isinstance(x, b)))
    if isinstance(x, NonTensorData):
        return ("NonTensorData", seen(x.data))
    if isinstance(x, NonTensorStack):
        return ("NonTensorStack", seen(x.tolist()))
    if isinstance(x, TensorDict):
        return {"<TensorDict batch_size>": list(x.batch_size), **{k: seen(x.get(k)) for k in sorted(x.keys())}}
    if isinstance(x, torch.Tensor):
        if x.is_nested:
            return ("nested", str(x.layout), str(x.dtype), [seen(t) for t in x.unbind()])
        values = x.to(torch.float64) if x.dtype.is_floating_point or x.dtype == torch.bfloat16 else x
        return ("tensor", str(x.dtype), list(x.shape), seen(values.tolist()))
    if isinstance(x, DataProto):
        return ("DataProto", seen(x.batch), seen(dict(sorted(x.non_tensor_batch.items()))), seen(x.meta_info))
    if type(x).__name__ == "KVBatchMeta":
        return ("KVBatchMeta", list(x.keys), seen(x.tags), x.partition_id, seen(x.fields), seen(x.extra_info))
    if type(x).__name__ == "BatchMeta":
        return ("BatchMeta", x.size, sorted(x.field_names), seen(list(x.partition_ids)), seen(x.extra_info))
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), seen(x.tolist()))
    if isinstance(x, np.generic):
        return (f"np.{x.dtype}", seen(x.item()))
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x)
    if isinstance(x, (bool, int)):
        return (type(x).__name__, x)
    if isinstance(x, (list, tuple)):
        return [seen(v) for v in x]
    if isinstance(x, dict):
        return {str(k): seen(v) for k, v in x.items()}
    if x is None or isinstance(x, str):
        return x
    return ("object", type(x).__name__, repr(x)[:200])


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two answers first differ, as a path and the two values there. An error of the drop-in may derive
    from more built-in exceptions than TransferQueue's (its own carry KeyError beside ValueError, say)."""
    if isinstance(a, tuple) and a[:1] == ("raises",) and isinstance(b, tuple) and b[:1] == ("raises",):
        return None if set(a[1]) <= set(b[1]) else f"{path or '.'}: raises {a[1]} vs {b[1]}"
    if type(a) is not type(b):
        return f"{path or '.'}: {a!r:.300} vs {b!r:.300}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return (f"{path or '.'} keys: only TransferQueue {sorted(set(a) - set(b))}, only the drop-in "
                    f"{sorted(set(b) - set(a))}, order {list(a)[:8]} vs {list(b)[:8]}")
        for k in a:
            d = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path or '.'} length {len(a)} vs {len(b)}: {a!r:.300} vs {b!r:.300}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path or '.'}: {a!r:.300} vs {b!r:.300}"


def run(system: Any, driver: Any, tmp: Path) -> tuple[Any, str | None]:
    """``driver(system, tmp)``'s answer as seen, and the error's text if it raised."""
    wipe(system)
    with verl_on(system):
        try:
            return seen(driver(system, tmp)), None
        except Exception as exc:  # noqa: BLE001 - an error is an answer too
            import traceback

            frames = [f for f in traceback.extract_tb(exc.__traceback__)]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
            return seen(exc), f"{type(exc).__name__}: {str(exc)[:600]} at {where}"
        finally:
            with contextlib.suppress(Exception):
                wipe(system)


def compare(systems: tuple[Any, Any], driver: Any, tmp_path: Path) -> None:
    real, dropin = systems
    theirs, their_error = run(real, driver, tmp_path / "tq")
    assert their_error is None, f"the driver fails on TransferQueue itself: {their_error}"
    mine, my_error = run(dropin, driver, tmp_path / "dropin")
    if my_error is not None:
        pytest.fail(f"raises on the drop-in, not on TransferQueue: {my_error}", pytrace=False)
    difference = first_difference(theirs, mine)
    assert difference is None, f"TransferQueue vs the drop-in differ at {difference}"


# -- verl's configuration and stand-ins for what is not TransferQueue-facing ----------------------------------


def verl_config(tmp: Path, **overrides: Any) -> Any:
    """verl's own generated PPO config, made small: GRPO, n=2, tiny batches."""
    conf = OmegaConf.load(VERL_CONFIG / "_generated_ppo_trainer.yaml")
    settings = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.val_kwargs.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 3,  # 4 trajectories pad to lcm(dp 2, 3 * n) = 6
        "critic.ppo_mini_batch_size": 3,
        "data.train_batch_size": 2,
        "trainer.default_local_dir": str(tmp / "ckpt"),
        "trainer.resume_mode": "disable",
        "trainer.log_val_generations": 0,
        **overrides,
    }
    for key, value in settings.items():
        OmegaConf.update(conf, key, value, force_add=True)
    return conf


def prompt_rows(start: int, count: int) -> list[dict[str, Any]]:
    """Samples as verl's RLHFDataset.__getitem__ returns them (text-only, chat messages)."""
    return [{
        "raw_prompt": [{"role": "user", "content": f"What is {i} + {i}? Think step by step."}],
        "data_source": "openai/gsm8k" if i % 2 == 0 else "math_dapo",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}"},
        "index": i,
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
    } for i in range(start, start + count)]


class Dataloader:
    """Stand-in for the StatefulDataLoader: batches of verl's collate_fn over fixed prompts."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.next_index = batch_size, 0

    def __iter__(self):
        while True:
            rows = prompt_rows(self.next_index, self.batch_size)
            self.next_index += self.batch_size
            yield collate_fn(rows)

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]


class Generation:
    """What the stand-in LLM answers a prompt (index) in a session: token ids, log-probs and a reward."""

    def __init__(self, equal: bool = False, reward: Any = None) -> None:
        self.equal = equal
        self.reward = reward or (lambda index, session: float((index + session) % 2))

    def output(self, index: int, session: int, global_steps: int) -> AgentLoopOutput:
        prompt_len = 5 if self.equal else 3 + index % 4
        response_len = 4 if self.equal else 2 + (index + 2 * session) % 5
        response_mask = [1] * response_len
        if not self.equal and response_len > 3:
            response_mask[1] = 0  # a tool-response token
        reward = self.reward(index, session)
        return AgentLoopOutput(
            prompt_ids=[1000 + 10 * index + k for k in range(prompt_len)],
            response_ids=[2000 + 100 * session + k for k in range(response_len)],
            response_mask=response_mask,
            response_logprobs=[-0.25 * (k + 1) - 0.125 * session for k in range(response_len)],
            reward_score=reward,
            num_turns=2,
            metrics=AgentLoopMetrics(generate_sequences=0.5, tool_calls=0.0),
            extra_fields={"min_global_steps": global_steps, "max_global_steps": global_steps,
                          "reward_extra_info": {"acc": reward, "pred": f"{index + session}"}},
        )


class AgentLoopWorker(agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's AgentLoopWorkerTQ (the class under its Ray actor), with only the LLM stood in for: its
    generate_sequences, _run_prompt and _agent_loop_postprocess (every TransferQueue call) are verl's. The
    stand-in LLM finishes the sessions in one order, (index, session), so both runs put the same rows in the
    same order (a real LLM's order is arbitrary, and would make every later comparison moot)."""

    def __init__(self, config: Any, generation: Generation) -> None:  # noqa: D107 - no servers, no tokenizer
        self.config, self.generation = config, generation
        self.processor = self.tokenizer = self.reward_loop_worker_handles = None
        self.distillation_enabled = False
        self.background_tasks = set()
        self.order: list[tuple[int, int]] = []
        agent_loop_tq.tq.init()  # as AgentLoopWorkerTQ.__init__: attach to the running system

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        me = (int(kwargs["index"]), kwargs["session_id"])
        async with self.turn:
            await asyncio.wait_for(self.turn.wait_for(lambda: self.order[0] == me), 60)
        try:
            # Stand-in for the agent loop's LLM call; what follows it is verl's.
            output = self.generation.output(me[0], me[1], int(kwargs["global_steps"]))
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
        finally:
            async with self.turn:
                self.order.pop(0)
                self.turn.notify_all()


class AgentLoopManager:
    """Stand-in for AgentLoopManagerTQ without Ray actors: one worker, run to completion in this process."""

    def __init__(self, worker: AgentLoopWorker | None) -> None:
        self.worker, self.dispatched = worker, []

    def generate_sequences(self, prompts: TensorDict) -> None:
        self.dispatched.append(seen(prompts))
        if self.worker is not None:
            rollout = self.worker.config.actor_rollout_ref.rollout
            n = rollout.val_kwargs.n if "validate" in prompts.keys() and prompts["validate"] else rollout.n
            self.worker.order = sorted((int(i), s) for i in prompts["index"] for s in range(n))
            asyncio.run(self._run(prompts))

    async def _run(self, prompts: TensorDict) -> None:
        self.worker.turn = asyncio.Condition()
        await self.worker.generate_sequences(prompts)
        await asyncio.gather(*list(self.worker.background_tasks))


class Tokenizer:
    """Stand-in tokenizer: ids as text."""

    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids if int(t) != self.pad_token_id)


class RewardLoopManager:
    """Stand-in for the colocated reward model: a rule score on the last valid response token."""

    reward_loop_worker_handles = None

    def __init__(self) -> None:
        self.inputs: list[Any] = []

    def compute_rm_score(self, data: DataProto) -> DataProto:
        self.inputs.append(seen(data))
        responses = data.batch["responses"]
        response_mask = data.batch["attention_mask"][:, -responses.size(1):]
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        acc = []
        for i, length in enumerate(response_mask.sum(dim=1).tolist()):
            score = float(len(data.non_tensor_batch["raw_prompt"][i][0]["content"]) % 3) / 2
            scores[i, length - 1] = score
            acc.append(score > 0.4)
        return DataProto(batch=TensorDict({"rm_scores": scores}, batch_size=len(responses)),
                         non_tensor_batch={"acc": np.array(acc, dtype=object)},
                         meta_info={"reward_extra_keys": ["acc"]})


#: What verl's tqbridge handed the stand-in model, per call (compared too).
HANDED: list[Any] = []


def _per_token(data: TensorDict, name: str, fn: Any) -> torch.Tensor:
    return torch.nested.as_nested_tensor([fn(row) for row in data[name].unbind()], layout=torch.jagged)


@tqbridge()
def model_log_prob(data: TensorDict) -> TensorDict:
    """Stand-in for the actor / reference model's forward pass, under verl's tqbridge (as a worker's method is)."""
    HANDED.append(seen(data))
    return TensorDict({"log_probs": _per_token(data, "input_ids", lambda r: -(r % 7).float() / 8),
                       "entropy": _per_token(data, "input_ids", lambda r: (r % 5).float() / 4)},
                      batch_size=[len(data)])


@tqbridge()
def model_values(data: TensorDict) -> TensorDict:
    """Stand-in for the critic's forward pass."""
    HANDED.append(seen(data))
    return TensorDict({"values": _per_token(data, "input_ids", lambda r: (r % 3).float() / 2)},
                      batch_size=[len(data)])


@tqbridge()
def model_update(data: TensorDict) -> TensorDict:
    """Stand-in for the actor's update: a loss from the advantages verl's bridge reads back."""
    HANDED.append(seen(data))
    advantages = data["advantages"]
    total = float(sum(row.sum() for row in advantages.unbind()))
    return TensorDict({"metrics": NonTensorData({"pg_loss": [total], "mfu": [0.5]})}, batch_size=[])


@tqbridge()
def model_update_critic(data: TensorDict) -> TensorDict:
    """Stand-in for the critic's update: a loss from the values and returns verl's bridge reads back."""
    HANDED.append(seen(data))
    total = float(sum((v - r).pow(2).sum() for v, r in zip(data["values"].unbind(), data["returns"].unbind())))
    return TensorDict({"metrics": NonTensorData({"vf_loss": [total], "mfu": [0.5]})}, batch_size=[])


class WorkerGroup:
    """Stand-in for RayWorkerGroup: verl's own DP split (BatchData.chunk, KVBatchMeta -> BatchMeta chunks) and
    concat (BatchData.concat, BatchMeta -> KVBatchMeta), the workers' functions run in this process."""

    world_size = 2

    def __init__(self) -> None:
        self._dispatch_info = {"actor": [0, 1]}

    def _dp(self, fn: Any, batch: Any) -> Any:
        args, _ = _split_args_kwargs_data_proto(self.world_size, batch)
        return _concat_data_proto_or_future([fn(chunk) for chunk in args[0]])

    def compute_log_prob(self, batch: Any) -> Any:
        return self._dp(model_log_prob, batch)

    compute_ref_log_prob = compute_log_prob

    def infer_batch(self, batch: Any) -> Any:
        self._dp(model_values, batch)
        return types.SimpleNamespace(futures=[])

    def update_actor(self, batch: Any) -> Any:
        return model_update(batch)

    def train_mini_batch(self, batch: Any) -> Any:
        return types.SimpleNamespace(get=lambda: model_update_critic(batch))

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass


class Replicas:
    """Stand-in for the checkpoint engine manager (weight sync to rollout replicas)."""

    def sleep_replicas(self) -> None:
        pass

    def update_weights(self, *args: Any) -> None:
        pass


def make_trainer(cls: type, config: Any, generation: Generation | None = None, worker: bool = True) -> Any:
    """verl's trainer class with its collaborators set as its ``_setup`` would, the heavy ones stood in for."""
    t = object.__new__(cls)
    t.config = config
    t.trainer_mode = config.trainer.v1.trainer_mode
    t.parameter_sync_step = config.trainer.v1.get(t.trainer_mode, {}).get("parameter_sync_step", 1)
    t.use_critic, t.use_reference_policy, t.use_teacher_policy, t.ref_in_actor = True, True, False, False
    t.local_trigger_step, t._restored_tq_prompt_count, t.global_steps = 0, 0, 1
    t._rollout_moe_lb_metrics_accumulator = RolloutMoELoadBalanceMetricsAccumulator(
        model_config=config.actor_rollout_ref.model)
    t.checkpoint_callback = trainer_base.build_checkpoint_callback(config)
    t.tokenizer, t.reward_loop_manager, t.checkpoint_manager = Tokenizer(), RewardLoopManager(), Replicas()
    t.actor_rollout_wg = t.ref_policy_wg = t.critic_wg = WorkerGroup()
    t.train_dataloader, t.train_dataloader_it = Dataloader(config.data.train_batch_size), None
    t.agent_loop_manager = AgentLoopManager(AgentLoopWorker(config, generation or Generation()) if worker else None)
    t.replay_buffer = t._build_replay_buffer()
    t.replay_buffer.poll_interval = 0.05
    t.curr_step_profile, t.timing_raw = False, {}
    t._get_n_gpus_for_throughput = lambda: 1
    return t


def without_timings(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics less the ones that measure time (different on every run)."""
    return {k: v for k, v in sorted(metrics.items()) if not k.startswith(("timing_", "perf/", "timing/"))}


def everything(system: Any, partition: str) -> Any:
    """Every key of a partition, its tags and all its fields."""
    listing = system.kv_list(partition).get(partition, {})
    keys = sorted(listing)
    by_fields: dict[str, Any] = {}
    for key in keys:  # one get per key: keys of different fields (prompts, trajectories) in one partition
        try:
            data = system.kv_batch_get([key], partition)
        except ValueError:  # a key of tags alone (a prompt's status) on TransferQueue
            data = None
        by_fields[key] = data if data is not None and len(data.keys()) else "no fields"
    return {"tags": {k: listing[k] for k in keys}, "data": by_fields}


# -- the drivers: one per verl call site ----------------------------------------------------------------------


def agent_loop(equal: bool) -> Any:
    """AgentLoopWorkerTQ: generate_sequences -> _run_prompt (async_kv_put of tags alone) ->
    _agent_loop_postprocess (async_kv_batch_put of list_of_dict_to_tensordict of every sample's fields)."""

    def driver(system: Any, tmp: Path) -> Any:
        config = verl_config(tmp)
        t = make_trainer(PPOTrainerSync, config, Generation(equal=equal))
        batch_dict = collate_fn(prompt_rows(0, 3))
        batch_dict["uid"] = np.array([f"uid{i}" for i in range(3)], dtype=object)
        prompts = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(prompts, "global_steps", 1)
        t._submit_batch_to_rollout(prompts)  # the prompts' tags, then the agent loop
        return everything(system, "train")

    return driver


def submit_and_sample(mode: str) -> Any:
    """PPOTrainer._add_batch_to_generate (kv_batch_put of prompt tags, and in async modes of the prompts'
    fields) -> agent loop -> ReplayBuffer(Async).sample (kv_list, kv_clear) -> the sampled KVBatchMeta."""

    def driver(system: Any, tmp: Path) -> Any:
        cls = PPOTrainerSync if mode == "sync" else PPOTrainerColocateAsync
        t = make_trainer(cls, verl_config(tmp, **{"trainer.v1.trainer_mode": mode}))
        t._add_batch_to_generate()
        listed = system.kv_list("train")
        batch, metrics = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
        return {"listed": listed, "sampled": batch, "metrics": metrics, "left": system.kv_list("train")}

    return driver


def dapo_sample(system: Any, tmp: Path) -> Any:
    """ReplayBufferAsync with DAPO group filtering on the canonical reward: _dapo_filtered_keys reads
    kv_batch_get(select_fields=["rm_scores"]) and sums each row; groups of one reward are evicted and refilled."""
    config = verl_config(tmp, **{"trainer.v1.trainer_mode": "colocate_async", "algorithm.filter_groups.enable": True,
                                 "algorithm.filter_groups.metric": "reward",
                                 "trainer.v1.sampler.max_off_policy_threshold": None})
    # prompts 0 and 1: rewards differ within the group; 2, 3: one reward (filtered); refills 4, 5 differ
    generation = Generation(reward=lambda index, session: float(session) if index in (0, 1, 4, 5) else 1.0)
    t = make_trainer(PPOTrainerColocateAsync, config, generation)
    assert isinstance(t.replay_buffer, ReplayBufferAsync)
    t._add_prompts_to_generate(4)
    batch, metrics = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    # Which of the sampleable groups (all of one global step) make the batch hangs on the order verl iterates its
    # sets in, built from kv_list's order: on the drop-in the choice can differ from TransferQueue's (with
    # PYTHONHASHSEED=1 it does; the cases on kv_list's order show that difference). Compared here: what was
    # evicted, refilled and kept, whatever the choice.
    left = system.kv_list("train").get("train", {})
    return {"groups": len({k.split("_")[0] for k in batch.keys}), "trajectories": len(batch.keys),
            "partition": batch.partition_id, "metrics": metrics,
            "trajectories left": sorted(k for k in left if "_" in k), "prompts left": sum("_" not in k for k in left)}


def ppo_step(equal: bool, **overrides: Any) -> Any:
    """PPOTrainer.step (verl's whole step: sample, _compute_reward_colocate with .offsets(), _balance_batch with
    upsample_batch_to_divisible_size, _compute_old_log_prob / _compute_ref_log_prob / _compute_values through
    tqbridge and BatchData, _compute_advantage, _update_actor), then _compute_metrics (.offsets()),
    _log_rollout_data and the step's kv_clear, as fit() runs them."""

    def driver(system: Any, tmp: Path) -> Any:
        HANDED.clear()
        t = make_trainer(PPOTrainerSync, verl_config(tmp, **overrides), Generation(equal=equal))
        metrics: dict[str, Any] = {}
        t._add_batch_to_generate()
        batch = t.step(metrics, t.timing_raw)
        t.timing_raw.setdefault("step", 1.0)
        stored = everything(system, "train")
        t._compute_metrics(batch, metrics, t.timing_raw, global_steps=1, epoch=0)
        t._init_dump_executor()
        t._log_rollout_data(batch, t.timing_raw, str(tmp / "rollouts"))
        t._shutdown_dump_executor()
        system.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        return {"batch": batch, "stored": stored, "metrics": without_timings(metrics),
                "reward model saw": t.reward_loop_manager.inputs, "workers saw": list(HANDED),
                "rollout dump": (tmp / "rollouts" / "1.jsonl").read_text().splitlines(),
                "routed_experts retried from step":
                    t._rollout_moe_lb_metrics_accumulator.routed_experts_retry_after_step,
                "left": system.kv_list("train")}

    return driver


def validate(system: Any, tmp: Path) -> Any:
    """PPOTrainer._validate: kv_batch_put of prompt tags into "val", the agent loop, ReplayBuffer.sample on "val",
    _compute_reward_colocate, kv_batch_get of prompts/responses (to_padded_tensor) and of uid, rm_scores,
    num_turns, reward_model, data_source, extra_fields; the validation metrics and the generations dump."""
    t = make_trainer(PPOTrainerSync, verl_config(tmp, **{"trainer.validation_data_dir": str(tmp / "val")}))
    t.val_dataloader = [collate_fn(prompt_rows(10, 3))]
    t._init_dump_executor()
    metrics = t._validate()
    t._shutdown_dump_executor()
    return {"metrics": metrics, "reward model saw": t.reward_loop_manager.inputs,
            "dump": (tmp / "val" / "1.jsonl").read_text().splitlines(), "left": system.kv_list("val")}


def checkpoint_and_reissue(system: Any, tmp: Path) -> Any:
    """Async mode: _submit_batch_to_rollout of finished and of in-flight prompts, _save_checkpoint
    (tq.save_checkpoint), a fresh system, _load_checkpoint (tq.load_checkpoint, _count_tq_prompt_groups), then
    _reissue_inflight_prompts (kv_list, kv_batch_get of the prompts' stored fields, kv_clear, kv_batch_put)."""
    config = verl_config(tmp, **{"trainer.v1.trainer_mode": "colocate_async"})
    t = make_trainer(PPOTrainerColocateAsync, config)
    t._add_batch_to_generate()  # rolled out to the end
    stalled = make_trainer(PPOTrainerColocateAsync, config, worker=False)
    stalled.train_dataloader.next_index = 100
    stalled._add_batch_to_generate()  # still pending when the checkpoint is taken
    t._save_checkpoint()
    before = everything(system, "train")
    wipe(system)
    OmegaConf.update(config, "trainer.resume_mode", "resume_path")
    OmegaConf.update(config, "trainer.resume_from_path", str(tmp / "ckpt" / "global_step_1"))
    t._load_checkpoint()
    after = everything(system, "train")
    t.global_steps = 2
    reissued = t._reissue_inflight_prompts()
    return {"before": before, "restored prompt groups": t._restored_tq_prompt_count, "after load": after,
            "reissued": reissued, "dispatched": t.agent_loop_manager.dispatched[-1:],
            "left": everything(system, "train")}


def upsample(system: Any, tmp: Path) -> Any:
    """padding_utils.upsample_batch_to_divisible_size: kv_batch_get(...)[0] of a sample as the template,
    construct_minimal_padding_template, kv_batch_put of list_of_dict_to_tensordict of the padding samples."""
    t = make_trainer(PPOTrainerSync, verl_config(tmp))
    t._add_batch_to_generate()
    batch, _ = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    padded = padding_utils.upsample_batch_to_divisible_size(batch, 3, Tokenizer.eos_token_id)
    return {"batch": padded, "pads": system.kv_batch_get(padded.keys[len(batch):], "train")}


def bridge(system: Any, tmp: Path) -> Any:
    """tqbridge on a KVBatchMeta handed straight to a worker function (kv_batch_meta2batch_meta, get_data,
    put of the output, batch_meta2kv_batch_meta, tags kept), and BatchData chunk / concat of a field subset."""
    HANDED.clear()
    t = make_trainer(PPOTrainerSync, verl_config(tmp))
    t._add_batch_to_generate()
    batch, _ = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    batch.extra_info["temperature"] = 0.7
    out = model_log_prob(batch)
    subset = type(batch)(keys=batch.keys, tags=batch.tags, partition_id=batch.partition_id,
                         fields=["prompts", "responses", "input_ids"], extra_info={"calculate_entropy": True})
    chunked = WorkerGroup()._dp(model_log_prob, subset)
    return {"direct": out, "chunked": chunked, "workers saw": list(HANDED),
            "log_probs": system.kv_batch_get(batch.keys, "train", select_fields=["log_probs", "entropy"])}


def rollout_cache(system: Any, tmp: Path) -> Any:
    """RolloutTqSkip.prepare_data (kv_batch_get of a sampled batch, all fields) and load_dump_data
    (index_select_tensor_dict of it, kv_batch_put of trajectories and of prompt tags). Its torch.save / torch.load
    of the batch are stood in for by a dict in memory (no pickle of what was read from the store)."""
    config = verl_config(tmp)
    t = make_trainer(PPOTrainerSync, config)
    t._add_batch_to_generate()
    batch, _ = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    files: dict[str, Any] = {}

    def save(obj: Any, path: Any) -> None:
        files[str(path)] = obj
        Path(path).touch()

    disk = types.SimpleNamespace(save=save, load=lambda path, weights_only=False: files[str(path)])
    skip = rollout_skip.RolloutTqSkip(
        OmegaConf.create({"enable": True, "action": "cache", "dump_dir": str(tmp / "dump"), "steps": [1]}), config)
    mp = pytest.MonkeyPatch()
    mp.setattr(rollout_skip, "torch", types.SimpleNamespace(save=disk.save, load=disk.load))
    try:
        skip.prepare_data(step=1, batch=batch, global_steps=1)
        system.kv_clear(batch.keys, "train")
        skip.load_dump_data(step=1, new_prompt_uids=["uidA", "uidB"], n=2, global_steps=3)
    finally:
        mp.undo()
    return {"dumped": [files[k]["tensordict"] for k in sorted(files)], "injected": everything(system, "train")}


def kv_list_order(system: Any, tmp: Path) -> Any:
    """The minimal form of the difference the two cases above show through verl: TransferQueue lists a
    partition's keys in the order they were first put, whatever global indexes they got; the drop-in lists them
    by row, and a cleared row goes to the next new key."""
    system.kv_batch_put(["a", "b", "c"], "train", tags=[{}, {}, {}])
    system.kv_clear(["a", "b"], "train")
    system.kv_batch_put(["x", "y"], "train", tags=[{}, {}])
    return list(system.kv_list("train")["train"])


def tags_alone(system: Any, tmp: Path) -> Any:
    """A probe, not a verl call: kv_batch_get of the prompt keys verl's sync trainer registers with tags alone
    (_submit_batch_to_rollout); TransferQueue raises ValueError."""
    t = make_trainer(PPOTrainerSync, verl_config(tmp), worker=False)
    t._add_batch_to_generate()
    keys = sorted(system.kv_list("train")["train"])
    try:
        return system.kv_batch_get(keys, "train")
    except ValueError as exc:
        return exc


def second_step_order(system: Any, tmp: Path) -> Any:
    """Two steps as fit() runs them on one system: step() (which reorders the batch in _balance_batch), then
    the step's kv_clear of the batch's keys in that order. The second step's prompts and trajectories take the
    freed rows, and ReplayBuffer._materialize_batch lists the batch in kv_list's order."""
    t = make_trainer(PPOTrainerSync, verl_config(tmp))
    sample, sampled = t.replay_buffer.sample, []

    def recorded(**kwargs: Any) -> Any:
        batch, metrics = sample(**kwargs)
        sampled.append(list(batch.keys))
        return batch, metrics

    t.replay_buffer.sample = recorded
    trained = []
    for step in (1, 2):
        t.global_steps = step
        batch = t.step({}, {})
        trained.append(list(batch.keys))
        system.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    return {"sampled": sampled, "trained": trained}


CASES = {
    "agent loop, ragged prompts and responses": agent_loop(equal=False),
    "agent loop, prompts and responses of one length": agent_loop(equal=True),
    "submit and sample, sync": submit_and_sample("sync"),
    "submit and sample, colocate_async (prompt fields stored)": submit_and_sample("colocate_async"),
    "replay buffer, DAPO filter on rm_scores": dapo_sample,
    "PPO step and metrics, ragged": ppo_step(equal=False),
    "PPO step and metrics, one length": ppo_step(equal=True),
    # _compute_old_log_prob's bypass mode: kv_batch_get of rollout_log_probs, put back as old_log_probs
    "PPO step, bypass mode": ppo_step(equal=False, **{"algorithm.rollout_correction.bypass_mode": True}),
    # get_metric_data_with_optional_routed_experts asks for "routed_experts", which no sample has; it would fall
    # back on a ValueError naming the field, but neither system raises (the unknown field is left out)
    "metrics asking for routed_experts": ppo_step(
        equal=False, **{"actor_rollout_ref.rollout.moe_load_balance_metrics_interval": 1}),
    "validation": validate,
    "checkpoint, load and re-issue in-flight prompts": checkpoint_and_reissue,
    "padding to a batch multiple": upsample,
    "tqbridge and BatchData": bridge,
    "rollout skip cache": rollout_cache,
    "second step's batch order (reused rows)": second_step_order,
    "kv_list order after a clear (the minimal form)": kv_list_order,
    "a prompt key's data (tags alone)": tags_alone,
}


@pytest.mark.parametrize("name", list(CASES))
def test_verl_runs_alike_on_the_drop_in(both, name, tmp_path):  # noqa: F811
    compare(both, CASES[name], tmp_path)


# -- tq.init with verl's own conf, in a process of its own ---------------------------------------------------

INIT = textwrap.dedent("""
    import json, logging, os, re, sys
    from omegaconf import OmegaConf
    conf = OmegaConf.load(sys.argv[1])
    conf.enable = True  # as verl's main_ppo.TaskRunner.run sets it before tq.init(config.transfer_queue)
    conf.metrics.enabled = sys.argv[3] == "metrics"
    if sys.argv[2] == "real":
        import ray
        import transfer_queue as tq
        ray.init(address="local", num_cpus=12, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    else:
        import broker.transfer_queue as tq
        sys.modules["transfer_queue"] = tq  # verl's tracking imports it by that name
    returned = tq.init(conf)
    from verl.utils.tracking import RLInsightLogger
    registered = []  # stand-in for the Prometheus registration, which is not TransferQueue-facing
    RLInsightLogger.register_metrics = classmethod(
        lambda cls, addresses, name, labels: registered.append([name, [bool(a) for a in addresses]]))
    RLInsightLogger.register_transfer_queue_metrics({"transfer_queue": conf})
    endpoint = tq.get_metrics_endpoint()
    tq.kv_put("k", "p", {"x": __import__("torch").arange(3)}, tag={"status": "running"})
    print(json.dumps({"returned": type(returned).__name__,
                      "endpoint": endpoint and bool(re.match(r"^[^:]+:[0-9]+$", endpoint)),
                      "registered": registered, "listed": tq.kv_list("p")}))
    if sys.argv[2] != "real":
        tq.get_client().system.delete()  # the next run's init must not attach to this one's stored conf
    tq.close()
""")


@pytest.mark.parametrize("metrics", ["no metrics", "metrics"])
def test_init_with_verls_conf(real_url, metrics, tmp_path):
    """main_ppo: tq.init(config.transfer_queue) with verl's transfer_queue.yaml (8 storage units, Mooncake keys,
    metrics), then RLInsightLogger.register_transfer_queue_metrics (tq.get_metrics_endpoint), a put and kv_list."""
    script = tmp_path / "init.py"
    script.write_text(INIT)
    conf = VERL_CONFIG / "transfer_queue" / "transfer_queue.yaml"
    answers = {}
    for system in ("real", "drop-in"):
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "REDIS_URL": real_url,
               "BROKER_TQ_DIR": str(tmp_path / system)}
        done = subprocess.run([sys.executable, str(script), str(conf), system, metrics.split()[-1]], env=env,
                              capture_output=True, text=True, timeout=300)
        lines = done.stdout.strip().splitlines()
        answers[system] = json.loads(lines[-1]) if done.returncode == 0 and lines else done.stderr[-1500:]
    assert isinstance(answers["real"], dict), f"the driver fails on TransferQueue itself: {answers['real']}"
    assert answers["drop-in"] == answers["real"], f"TransferQueue: {answers['real']}\nthe drop-in: {answers['drop-in']}"
