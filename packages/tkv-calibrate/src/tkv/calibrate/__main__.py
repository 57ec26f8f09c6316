"""``python -m tkv.calibrate`` — same as the ``tkv-calibrate`` console script."""

import sys

from .cli import main

sys.exit(main())
