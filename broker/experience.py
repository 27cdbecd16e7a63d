"""Old import path of ``broker.api.batches``, kept so users' code runs unchanged: this name is that module."""

import sys
from typing import TYPE_CHECKING

from broker.api import batches as _moved

sys.modules[__name__] = _moved

if TYPE_CHECKING:  # what type checkers see under the old name
    from broker.api.batches import *  # noqa: F403
