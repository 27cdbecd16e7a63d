"""``broker.transfer_queue``: TransferQueue's API on the broker, the name users import
(``import broker.transfer_queue as tq``). The code is ``broker.adapters.transfer_queue``; this name and every
submodule under it (``broker.transfer_queue.metadata``, ``.sampler``, ``.sampler.base``, ...) are those
modules, not copies, so a ``BatchMeta`` made under one name is an instance of the class of the other."""

import sys
from typing import TYPE_CHECKING

from broker.adapters import transfer_queue as _moved

_PREFIX = _moved.__name__ + "."
# The package imports all of its modules, so each can be registered under this name before anyone asks.
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_PREFIX):
        sys.modules[__name__ + "." + _name[len(_PREFIX):]] = _module
sys.modules[__name__] = _moved

if TYPE_CHECKING:  # what type checkers see under this name
    from broker.adapters.transfer_queue import *  # noqa: F403
