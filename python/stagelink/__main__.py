"""`python -m stagelink ...`: the `stagelink` command (stagelink.cli)."""
import sys

from .cli import main

sys.exit(main())
