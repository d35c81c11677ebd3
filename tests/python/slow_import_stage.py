"""A stage module whose import takes SL_T_IMPORT_S seconds (a torch import on a loaded machine)."""
import os
import time

time.sleep(float(os.environ.get("SL_T_IMPORT_S", "0")))


def stage(payload, ctx):
    return payload
