"""``python -m broker`` is the ``broker`` command."""

import sys

from broker.ops.cli import main

sys.exit(main())
