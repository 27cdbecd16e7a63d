"""MindSpeed-RL's single-actor TransferDock, rewritten for the baseline as its documentation describes it.

``mindspeed_rl/trainer/utils/transfer_dock.py``: Python lists of tensors per column, int32 status
tensors per column and per consumer, one ``threading.Lock`` per consumer around sampling, sampling
by scanning every status tensor (reshape to groups, ``all``, ``stack``, ``nonzero``), then
``batch_balencing_sampler`` (a uniform ``torch.multinomial`` without a target length). Reads return
a padded batch (``padding_dict_to_tensor_dict``), puts take one and cut the padding off again.

Kept out as irrelevant to a GRPO batch without partial rollout: metrics, ``max_age``, multimodal
docks, ``use_batch_seqlen_balance``. Two deliberate deviations, both in the baseline's favour: the
padding helpers are this package's vectorised ones (MindSpeed pads row by row) and batches are plain
dicts, not TensorDicts.
"""

from __future__ import annotations

import threading
import time
from operator import itemgetter
from typing import Any

import torch

from broker.adapters.mindspeed.padding import (
    padding_dict_to_tensor_dict,
    remove_padding_tensor_dict_to_dict,
    trans_input_to_experience,
)


class MindSpeedTransferDock:
    """The base class: columns of per-row tensors and their ready status."""

    def __init__(self, prompts_num: int, n_samples_per_prompt: int, experience_columns: list[str],
                 timeout: float | None = None, timeout_interval: float | None = None):
        self.prompts_num = prompts_num
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_len = prompts_num * n_samples_per_prompt
        self.experience_columns = list(experience_columns) if experience_columns is not None else []
        self.experience_data: dict[str, list[Any]] = {
            key: [None for _ in range(self.max_len)] for key in self.experience_columns
        }
        self.experience_data_status = {
            key: torch.zeros(self.max_len, dtype=torch.int32) for key in self.experience_columns
        }
        self.timeout = timeout if timeout is not None else 300
        self.timeout_interval = timeout_interval if timeout_interval is not None else 5

    def _put(self, experience_columns: list[str], experience: list[list[torch.Tensor]], indexes: list[int]) -> None:
        if max(indexes) >= self.max_len:
            raise ValueError(f"index {max(indexes)} out of range {self.max_len}")
        for column_idx, single_column in enumerate(experience_columns):
            for i, idx in enumerate(indexes):
                if idx >= 0:
                    self.experience_data[single_column][idx] = experience[column_idx][i]
                    self.experience_data_status[single_column][idx] = 1

    def _get(self, experience_columns: list[str], indexes: list[int]) -> list[list[torch.Tensor]]:
        if len(indexes) == 0:
            return [[] for _ in range(len(experience_columns))]
        if max(indexes) >= self.max_len:
            raise ValueError(f"index {max(indexes)} out of range {self.max_len}")
        self._wait_for_data(experience_columns, indexes)
        experience: list[list[torch.Tensor]] = []
        for single_column in experience_columns:
            if len(indexes) == 1:
                experience.append([self.experience_data[single_column][indexes[0]]])
            else:
                experience.append(list(itemgetter(*indexes)(self.experience_data[single_column])))
        return experience

    def _data_ready(self, experience_columns: list[str], indexes: list[int]) -> bool:
        ready = torch.stack([self.experience_data_status[c] for c in experience_columns]).sum(0)[indexes]
        return int(ready.sum()) == len(indexes) * len(experience_columns)

    def _wait_for_data(self, experience_columns: list[str], indexes: list[int]) -> None:
        start = time.time()
        while not self._data_ready(experience_columns, indexes):
            if time.time() - start > self.timeout:
                raise TimeoutError("get experience data timeout")
            time.sleep(self.timeout_interval)

    def _clear_experience_data_and_status(self) -> None:
        self.experience_data = {key: [None for _ in range(self.max_len)] for key in self.experience_columns}
        for key in self.experience_columns:
            self.experience_data_status[key].zero_()


class MindSpeedGRPOTransferDock(MindSpeedTransferDock):
    """GRPOTransferDock: consumer status, sampling of whole groups under a per-consumer lock."""

    def __init__(self, prompts_num: int, n_samples_per_prompt: int, experience_columns: list[str],
                 experience_consumers: list[str], seed: int = 0):
        super().__init__(prompts_num, n_samples_per_prompt, experience_columns)
        self.experience_consumers = list(experience_consumers)
        self.experience_consumer_status = {
            key: torch.zeros(self.max_len, dtype=torch.int32) for key in self.experience_consumers
        }
        self.consumer_sampling_lock = {key: threading.Lock() for key in self.experience_consumers}
        self.enable_partial_rollout = False
        self.batch_seqlen_balance_mapper: dict[str, Any] = {}
        self.generator = torch.Generator().manual_seed(seed)

    def get_experience(self, consumer: str, experience_columns: list[str], experience_count: int | None = None,
                       dp_size: int = 1, indexes: list[int] | None = None, get_n_samples: bool = True,
                       use_batch_seqlen_balance: bool = False) -> tuple[Any, list[int] | None]:
        if consumer not in self.experience_consumers:
            raise ValueError(f"get experience ERROR: {consumer} not in TD experience_consumers")
        for experience_column in experience_columns:
            if experience_column not in self.experience_columns:
                raise ValueError(f"get experience ERROR: {experience_column} not in TD experience_column")
        if indexes is None:
            if experience_count is None or experience_count > self.max_len:
                raise ValueError(f"TD max_len: {self.max_len} need > experience_count: {experience_count}")
            if get_n_samples:
                indexes = self._sample_ready_index_n_samples(consumer, experience_count, experience_columns)
            else:
                indexes = self._sample_ready_index(consumer, experience_count, experience_columns)
            if not indexes:
                return None, None
            experience = self._get(experience_columns, indexes)
        else:
            self.experience_consumer_status[consumer][indexes] = 1
            experience = self._get(experience_columns, indexes)
        experience_batch = {}
        for i, experience_column in enumerate(experience_columns):
            experience_batch[experience_column] = experience[i]
        return padding_dict_to_tensor_dict(experience_batch), indexes

    def put_experience(self, data_dict: dict[str, torch.Tensor], indexes: list[int] | None = None,
                       is_prompt: bool = False) -> None:
        if not indexes:
            raise ValueError("put experience into TD without indexes, indexes must be provided")
        experience_columns, experience = trans_input_to_experience(remove_padding_tensor_dict_to_dict(data_dict))
        self._put(experience_columns, experience, indexes)

    def _sample_ready_index(
        self, consumer: str, experience_count: int, experience_columns: list[str]
    ) -> list[int] | None:
        with self.consumer_sampling_lock[consumer]:
            not_consumed_indexes = self.experience_consumer_status[consumer] == 0
            data_ready_indexes = torch.all(
                torch.stack([self.experience_data_status[c] == 1 for c in experience_columns]), dim=0
            )
            usable_indexes = (not_consumed_indexes & data_ready_indexes).nonzero(as_tuple=True)[0]
            if len(usable_indexes) < experience_count:
                return None
            sampled_indexes = self.batch_balencing_sampler(experience_columns, usable_indexes, experience_count)
            self.experience_consumer_status[consumer][sampled_indexes] = 1
        return sampled_indexes

    def _sample_ready_index_n_samples(self, consumer: str, experience_count: int,
                                      experience_columns: list[str]) -> list[int] | None:
        experience_count_n_samples = experience_count // self.n_samples_per_prompt
        with self.consumer_sampling_lock[consumer]:
            # MindSpeed wraps these in torch.tensor(...), a copy that only adds a warning; clone() is the same copy.
            experience_consumer_status_n_samples = (
                1 - torch.all(
                    torch.reshape(self.experience_consumer_status[consumer],
                                  (self.prompts_num, self.n_samples_per_prompt)).clone() == 0,
                    dim=1,
                ).int()
            )
            not_consumed_indexes = experience_consumer_status_n_samples == 0
            experience_data_status_n_samples = {}
            for key, value in self.experience_data_status.items():
                experience_data_status_n_samples[key] = torch.all(
                    torch.reshape(value, (self.prompts_num, self.n_samples_per_prompt)).clone() == 1, dim=1
                ).int()
            data_ready_indexes = torch.all(
                torch.stack([experience_data_status_n_samples[c] == 1 for c in experience_columns]), dim=0
            )
            usable_indexes = (not_consumed_indexes & data_ready_indexes).nonzero(as_tuple=True)[0]
            if len(usable_indexes) < experience_count_n_samples:
                return None
            sampled_indexes_n_sample = self.batch_balencing_sampler(
                experience_columns, usable_indexes, experience_count_n_samples
            )
            sampled_indexes = []
            for n_sample_index in sampled_indexes_n_sample:
                index_list = []
                for index in range(n_sample_index * self.n_samples_per_prompt,
                                   (n_sample_index + 1) * self.n_samples_per_prompt):
                    index_list.append(index)
                sampled_indexes += index_list
            self.experience_consumer_status[consumer][sampled_indexes] = 1
        return sampled_indexes

    def batch_balencing_sampler(self, experience_columns: list[str], usable_indexes: torch.Tensor,
                                experience_count: int, target_seq_len: int | None = None) -> list[int]:
        # Without a target length every usable index weighs the same: a uniform draw without replacement.
        weights = torch.ones(len(usable_indexes))
        sampled_indexes_idx = torch.multinomial(weights, experience_count, replacement=False,
                                                generator=self.generator).tolist()
        return [int(usable_indexes[i]) for i in sampled_indexes_idx]

    def all_consumed(self, consumer: str) -> bool:
        return bool(self.experience_consumer_status[consumer].sum() == self.max_len)

    def clear(self) -> None:
        for key in self.experience_consumers:
            self.experience_consumer_status[key].zero_()
        self._clear_experience_data_and_status()
