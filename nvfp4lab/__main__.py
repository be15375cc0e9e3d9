"""``python -m nvfp4lab ...``: the same as the ``nvfp4lab`` command."""

import sys

from .cli import main

sys.exit(main())
