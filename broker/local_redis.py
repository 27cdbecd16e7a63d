"""Old import path of ``broker.ops.local_redis``, kept so users' code runs unchanged: this name is that module."""

import sys
from typing import TYPE_CHECKING

from broker.ops import local_redis as _moved

sys.modules[__name__] = _moved

if TYPE_CHECKING:  # what type checkers see under the old name
    from broker.ops.local_redis import *  # noqa: F403
