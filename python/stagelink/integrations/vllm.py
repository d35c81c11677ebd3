"""vLLM's way in: the ``vllm.general_plugins`` entry point ``stagelink`` (declared by stagelink's
wheel) calls `register` in every vLLM process. With ``STAGELINK_VLLM_MQ=1`` it makes
``vllm.distributed.device_communicators.shm_broadcast.MessageQueue`` stagelink's
`stagelink.MessageQueue` (same constructor, ``create_from_process_group``, handles, ``enqueue`` /
``dequeue``), with a warning naming what it replaced; without it, nothing changes.

vLLM's process-group broadcasters (``GroupCoordinator.create_mq_broadcaster`` and the single-reader
ones) look the class up in that module when they are made, after the plugins are loaded, so they
get stagelink's. A module that imported the name itself before vLLM loaded its plugins keeps
vLLM's class. ``VLLM_PLUGINS``, when set, must list ``stagelink``.
"""
import logging
import os

MODULE = "vllm.distributed.device_communicators.shm_broadcast"
ENV = "STAGELINK_VLLM_MQ"

_log = logging.getLogger("stagelink")


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def register() -> bool:
    """Replace vLLM's broadcast queue with stagelink's where ``STAGELINK_VLLM_MQ=1``; returns
    whether vLLM's module now holds stagelink's class."""
    if not enabled():
        return False
    import importlib
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        _log.warning("%s=1, but vLLM's %s is not importable (%s): nothing replaced", ENV, MODULE, e)
        return False
    from stagelink.mq import MessageQueue
    if module.MessageQueue is MessageQueue:
        return True
    replaced = module.MessageQueue
    module.vllm_MessageQueue = replaced  # vLLM's own class stays reachable
    module.MessageQueue = MessageQueue
    _log.warning("%s=1: %s.MessageQueue (vLLM's %s) is now stagelink.MessageQueue, in process %d",
                 ENV, MODULE, replaced.__qualname__, os.getpid())
    return True
