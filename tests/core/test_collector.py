"""A large put runs with Python's cyclic collector paused (``broker/data/collector.py``): its many short-lived
objects must not be promoted and bring on a full collection. The pause ends with the put, failed or not, is
shared by puts in several threads, and never enables a collector the process had disabled itself."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from broker import QuotaExceededError
from broker.data import collector
from tests.helpers import small_dock


@pytest.fixture
def enabled_collector():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_small_put_leaves_the_collector_alone(enabled_collector):
    with collector.paused(collector.LARGE_PUT_VALUES - 1):
        assert gc.isenabled()


def test_pauses_in_several_threads_end_with_the_last(enabled_collector):
    first_in, second_in, first_may_end = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with collector.paused(collector.LARGE_PUT_VALUES):
            first_in.set()
            first_may_end.wait(10)
        seen.append(gc.isenabled())  # the second put is still paused

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with collector.paused(collector.LARGE_PUT_VALUES):
        assert not gc.isenabled()
        second_in.set()
        first_may_end.set()
        thread.join(10)
        assert seen == [False] and not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_process_disabled_stays_disabled(enabled_collector):
    gc.disable()
    with collector.paused(collector.LARGE_PUT_VALUES):
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_large_put_pauses_the_collector_and_resumes_it_refused_or_not(client, enabled_collector):
    dock = small_dock(client, "collector", 64, 64, ("prompts",), ("reader",), shards=0)  # 4,096 rows
    seen: list[bool] = []
    original = dock._puts._request

    def request(checked):
        seen.append(gc.isenabled())
        return original(checked)

    dock._puts._request = request
    rows = torch.zeros(collector.LARGE_PUT_VALUES, 2)
    dock.put_experience({"prompts": rows}, indexes=list(range(collector.LARGE_PUT_VALUES)))
    assert seen == [False] and gc.isenabled()
    dock.set_quota(1)
    with pytest.raises(QuotaExceededError):
        dock.put_experience({"prompts": rows + 1}, indexes=list(range(collector.LARGE_PUT_VALUES)))
    assert seen == [False, False] and gc.isenabled()
    dock.set_quota(None)
    dock.put_experience({"prompts": rows[:10]}, indexes=list(range(10)))  # a small put: not paused
    assert seen == [False, False, True]
    dock.delete()
