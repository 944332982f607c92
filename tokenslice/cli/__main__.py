"""`python -m tokenslice.cli`: the `tokenslice` command, as servers and sweeps start it."""
import sys

from tokenslice.cli import main

sys.exit(main())
