"""`python -m tfmixprec` runs the `tfmixprec` command."""

import sys

from tfmixprec.cli import main

sys.exit(main())
