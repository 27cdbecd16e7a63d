"""What a dock does when its server lost a key: a version that was set and is gone is an error, not 0.

Before: a version key that vanished (evicted by a server that evicts) read as 0, and a staleness bound
then handed out rows of any age.
"""

from __future__ import annotations

import pytest
import torch

from broker import DataLostError
from broker.rollout import Rollout

# -- a version that was set and is gone


def test_a_lost_version_is_an_error_never_0(make_dock, client):
    rollout = Rollout(response_columns=("responses",), prompt_columns=("prompts",), max_staleness=1, gbs_train=1)
    dock = make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), rollout=rollout)
    client.delete(dock.keys.version)
    assert dock.version() == 0  # never set: 0, nothing lost
    rows = [0, 1]
    dock.put_experience({"prompts": [torch.tensor([0])] * 2}, rows)
    dock.put_experience({"responses": [torch.tensor([1])] * 2}, rows, version=4)
    dock.set_version(5)
    client.delete(dock.keys.version)  # what an evicting server did to it first
    with pytest.raises(DataLostError, match=r"td:\{.*\}:version is gone although set_version set it"):
        dock.version()
    with pytest.raises(DataLostError):  # 0 would hand out these rows of version 4 at version 5 - 1
        dock.get_experience("actor_train", ["prompts", "responses"], 2)
    with pytest.raises(DataLostError):
        dock.prefetch_request_index(1)
    with pytest.raises(DataLostError):
        dock.set_version(3)  # versions only grow: from what, no one knows now
    with pytest.raises(DataLostError):
        dock.status()
    dock.delete()
    remade = make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), rollout=rollout,
                       name=dock.name)
    assert remade.version() == 0  # delete() took the version's mark along
