"""``DockScripts``: every wrapper of one dock's scripts on one object, the one the dock and its store hold."""

from __future__ import annotations

from broker.control.scripts.admin import AdminScripts
from broker.control.scripts.forget import ForgetScripts
from broker.control.scripts.handout import HandOutScripts
from broker.control.scripts.leases import LeaseScripts
from broker.control.scripts.puts import PutScripts
from broker.control.scripts.rollout import RolloutScripts


class DockScripts(HandOutScripts, LeaseScripts, PutScripts, ForgetScripts, RolloutScripts, AdminScripts):
    """The scripts of one dock on one client: one method per Lua file, each building its KEYS and ARGV.

    Each family is complete on its own (``ScriptsBase`` holds the loaded scripts and how to run them), so
    this class only puts them together: callers hold one object and need not know which family a script
    is in. ``schema`` must be set (``bind``) before any script but ``create`` runs.
    """
