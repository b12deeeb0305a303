"""`python -m offload.cli ...` runs the `offload` console script."""

import sys

from offload.cli import main

sys.exit(main())
