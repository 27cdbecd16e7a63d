"""Old import path of ``broker.api.metrics``, kept so users' code runs unchanged: this name is that module."""

import sys
from typing import TYPE_CHECKING

from broker.api import metrics as _moved

sys.modules[__name__] = _moved

if TYPE_CHECKING:  # what type checkers see under the old name
    from broker.api.metrics import *  # noqa: F403
