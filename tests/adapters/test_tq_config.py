"""broker.transfer_queue's conf and init: TransferQueue's own config.yaml accepted (what means nothing here logged
once, not refused), the broker's keys checked, samplers named or given, and a second process attaching to the
private redis-server the first one started."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tensordict")

import broker.transfer_queue as tq  # noqa: E402
from broker.errors import SchemaError  # noqa: E402
from broker.transfer_queue.config import DEFAULTS, merged  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "broker" / "transfer_queue" / "config.yaml"


def test_the_packaged_config_yaml_is_the_defaults():
    assert yaml.safe_load(CONFIG.read_text()) == DEFAULTS


def test_transfer_queues_own_config_is_accepted_and_what_means_nothing_is_logged_once(caplog):
    their = pytest.importorskip("transfer_queue")
    omegaconf = pytest.importorskip("omegaconf")
    conf = omegaconf.OmegaConf.load(Path(their.__file__).parent / "config.yaml")
    with caplog.at_level(logging.INFO, logger="broker.transfer_queue.config"):
        got = merged(conf)
    lines = [r.getMessage() for r in caplog.records if "ignores conf keys" in r.getMessage()]
    assert len(lines) == 1 and "backend.SimpleStorage.num_data_storage_units" in lines[0]
    assert got["controller"]["sampler"] == "SequentialSampler"
    assert got["broker"] == DEFAULTS["broker"]


@pytest.mark.parametrize("bad, match", [
    ({"broker": {"capacity": 0}}, "broker.capacity"),
    ({"broker": {"get_meta_timeout": -1}}, "broker.get_meta_timeout"),
    ({"broker": {"lease": "soon"}}, "broker.lease"),
    ({"backend": {"SimpleStorage": {"total_storage_size": 1.5}}}, "total_storage_size"),
    ("not a conf", "conf must be a dict"),
])
def test_bad_confs_are_refused_naming_the_key(bad, match):
    with pytest.raises(SchemaError, match=match):
        merged(bad)


def test_an_unknown_sampler_name_is_refused(url):
    with pytest.raises(SchemaError, match="is not a sampler"):
        tq.init({"broker": {"url": url, "namespace": "s" + uuid.uuid4().hex[:6]}, "controller": {"sampler": "Nope"}})
    tq.close()


ATTACH = """
import sys
import broker.transfer_queue as tq
tq.init()
print(tq.get_client().system.url, sorted(tq.kv_list("p")["p"]))
tq.close()
"""


def test_a_second_process_attaches_to_the_private_server_the_first_started(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("BROKER_TQ_DIR", str(tmp_path))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    try:
        tq.init()
        import torch
        from tensordict import TensorDict

        tq.kv_batch_put(["k1", "k2"], "p", TensorDict({"x": torch.ones(2)}, batch_size=2))
        url = tq.get_client().system.url
        done = subprocess.run([sys.executable, "-c", ATTACH], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [url, "['k1',", "'k2']"]
    finally:
        tq.close()
    assert not (tmp_path / "tq.default.url").exists()  # the server stopped with the process that started it
