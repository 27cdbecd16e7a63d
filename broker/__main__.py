"""``python -m broker`` is the ``broker`` command."""

import sys

from broker.cli import main

sys.exit(main())
