"""`python -m kvjax.commands ...` runs the `kvjax` command."""

import sys

from kvjax.commands import main

sys.exit(main())
