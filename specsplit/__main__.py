"""`python -m specsplit` is the `specsplit` command."""

import sys

from specsplit.cli import main

sys.exit(main())
