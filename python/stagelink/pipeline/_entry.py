"""``python -m stagelink.pipeline._entry SPEC PROCESS DIR`` (or ``--remote BLOB PROCESS`` on another
host, the spec inside BLOB): a stage process (see worker.py).
A module of its own, not imported by the package, so that runpy runs it cleanly."""
import sys

from stagelink.pipeline.worker import main

sys.exit(main())
