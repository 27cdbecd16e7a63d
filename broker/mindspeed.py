"""Old import path of ``broker.adapters.mindspeed``, kept so users' code runs unchanged: this name is that module."""

import sys
from typing import TYPE_CHECKING

from broker.adapters import mindspeed as _moved

sys.modules[__name__] = _moved

if TYPE_CHECKING:  # what type checkers see under the old name
    from broker.adapters.mindspeed import *  # noqa: F403
