"""``python -m broker`` is the ``broker`` command."""

import sys

from .cli import main

sys.exit(main())
