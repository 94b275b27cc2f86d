"""`python -m tfmixprec` runs the `tfmixprec` command."""

import sys

from tfmixprec.tools.cli import main

sys.exit(main())
