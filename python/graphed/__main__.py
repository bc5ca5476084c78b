"""`python -m graphed`: the graphed command line."""

import sys

from .cli import main

sys.exit(main())
