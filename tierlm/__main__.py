"""`python -m tierlm COMMAND`: the same as the `tierlm` script."""

import sys

from tierlm.cli import main

sys.exit(main())
