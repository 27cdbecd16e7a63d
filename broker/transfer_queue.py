"""``broker.transfer_queue``: TransferQueue's API on the broker, the name users import
(``import broker.transfer_queue as tq``). The code is ``broker.adapters.transfer_queue``; this name and its
submodules (``broker.transfer_queue.metadata``, ``.sampler``, ...) are those modules, not copies, so a
``BatchMeta`` made under one name is the class of the other."""

import importlib
import sys
from typing import TYPE_CHECKING

from broker.adapters import transfer_queue as _moved

#: The submodules TransferQueue's users import by path.
_SUBMODULES = ("metadata", "sampler", "client", "interface", "dataloader", "config", "system", "tensors",
               "checkpoint")

sys.modules[__name__] = _moved
for _name in _SUBMODULES:
    try:
        sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_moved.__name__}.{_name}")
    except ModuleNotFoundError as exc:  # a submodule not written yet must not break the others
        if exc.name != f"{_moved.__name__}.{_name}":
            raise

if TYPE_CHECKING:
    from broker.adapters.transfer_queue import *  # noqa: F403
