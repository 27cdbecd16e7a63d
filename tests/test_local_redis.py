"""The one redis-server launcher (broker.local_redis), where the tests, the demo and the bench share it."""

from __future__ import annotations

import atexit
import os

import pytest

from broker.ops.local_redis import RedisServer
from tests.helpers import redis_server_binary


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_forked_child_that_exits_leaves_its_parents_server_running():
    with RedisServer() as server:
        pid = os.fork()
        if pid == 0:  # the child ends as a process leaving Python normally does: its exit handlers run
            try:
                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert server.client().ping()  # the child's exit stopped nothing of the parent's
        assert server.folder.is_dir()
