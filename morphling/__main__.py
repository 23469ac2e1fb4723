"""``python -m morphling`` is the ``morphling`` command."""

import sys

from .cli import main

sys.exit(main())
