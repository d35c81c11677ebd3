"""SGLang-Omni's way in. SGLang-Omni 0.1.9 reads no plugin entry points, and its ``CommRouter``
asks its relay registry (``sglang_omni.relay.base.create_relay``) for fixed type names (``shm``
on one host); so stagelink offers an environment variable that every SGLang-Omni process inherits:

    STAGELINK_SGLANG_OMNI=1 sgl-omni serve ...

A line in ``stagelink.pth`` (installed beside the package; Python reads it at start-up) sees the
variable and, when SGLang-Omni's ``sglang_omni.relay.base`` is imported, calls `install`: the
relay type ``stagelink`` is registered, and stagelink's relay (`StagelinkRelay`) is registered as
the ``shm`` type, with a warning naming what it replaced. The value may instead list the types to
replace (``STAGELINK_SGLANG_OMNI=shm``), or be ``stagelink`` to only add the type of that name.
Without the variable the line costs one dictionary lookup at start-up and nothing else happens.

In a process of your own, ``stagelink.integrations.sglang_omni.install()`` does the same.
"""
import logging
import os
from typing import Iterable, Optional

from ..relay import ShmRelay

ENV = "STAGELINK_SGLANG_OMNI"

_log = logging.getLogger("stagelink")


class StagelinkRelay(ShmRelay):
    """stagelink's shared-memory relay under SGLang-Omni's constructor, ``(engine_id,
    slot_size_mb=64, credits=2, device="cpu")``; the arena is reused across requests, credits are
    per edge and every wait has a deadline (`stagelink.ShmRelay`)."""


def replaced_types(value: Optional[str] = None) -> tuple:
    """The SGLang-Omni relay types the environment variable's value asks to replace."""
    value = (os.environ.get(ENV, "") if value is None else value).strip().lower()
    if value in ("", "0", "false", "no", "off", "stagelink"):
        return ()
    if value in ("1", "true", "yes", "on"):
        return ("shm",)
    return tuple(t.strip() for t in value.split(",") if t.strip())


def install(replace: Optional[Iterable[str]] = None, base=None) -> tuple:
    """Register ``stagelink`` in SGLang-Omni's relay registry and make it the relay of each type in
    ``replace`` (default: what ``STAGELINK_SGLANG_OMNI`` says). Returns the types replaced. Calling
    it again is harmless."""
    if base is None:
        from sglang_omni.relay import base
    replace = replaced_types() if replace is None else tuple(replace)
    registry = base.RELAY_REGISTRY
    registry["stagelink"] = StagelinkRelay
    done = []
    for name in replace:
        if name in ("cuda_ipc", "nccl", "nixl", "mooncake"):
            _log.warning("%s: SGLang-Omni's '%s' relay moves device or cross-host data; stagelink's "
                         "shared-memory relay does not replace it", ENV, name)
            continue
        previous = registry.get(name)
        registry[name] = StagelinkRelay
        if previous is not StagelinkRelay:
            what = f"{previous.__module__}.{previous.__qualname__}" if previous else "its built-in one"
            _log.warning("%s: SGLang-Omni's relay type '%s' (%s) is now stagelink's StagelinkRelay, in "
                         "process %d", ENV, name, what, os.getpid())
        done.append(name)
    return tuple(done)
