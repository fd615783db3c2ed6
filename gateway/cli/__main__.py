"""`python -m gateway.cli ...`: the same command line as the console script."""

import sys

from gateway.cli import main

sys.exit(main())
