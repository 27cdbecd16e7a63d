"""What only the workers' and demos' tests need: a local Ray."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for one module's tests of the demo's worker groups."""
    ray = pytest.importorskip("ray")
    from workers.runtime.cluster import start_ray

    start_ray(None, 2)
    yield
    ray.shutdown()
