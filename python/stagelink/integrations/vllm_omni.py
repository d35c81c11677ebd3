"""vLLM-Omni's way in: the ``vllm_omni.general_plugins`` entry point ``stagelink`` (declared by
stagelink's wheel) calls `register` in every vLLM-Omni process, which adds stagelink's
connectors to vLLM-Omni's ``OmniConnectorFactory`` under names of their own, so that its YAML
selects them::

    runtime:
      connectors:
        shm:
          name: StagelinkSharedMemoryConnector
          extra: {shm_threshold_bytes: 65536}

vLLM-Omni's own ``SharedMemoryConnector`` and the others keep their names. ``VLLM_PLUGINS``, when
set, must list ``stagelink`` (vLLM-Omni loads only the plugins it names). Registering again (a
second call, a re-import, several processes) changes nothing.
"""
import logging

#: vLLM-Omni connector name -> the stagelink class it makes (each takes the connector's ``extra``).
CONNECTORS = {
    "StagelinkSharedMemoryConnector": "SharedMemoryConnector",
    "StagelinkTransferEngineConnector": "MooncakeTransferEngineConnector",
    "StagelinkStoreConnector": "StoreConnector",
}

_log = logging.getLogger("stagelink")


def _constructor(class_name: str):
    def make(extra):
        import stagelink
        return getattr(stagelink, class_name)(dict(extra or {}))
    make.__name__ = f"create_{class_name}"
    make.__qualname__ = make.__name__
    return make


def register() -> list:
    """Add stagelink's connectors to vLLM-Omni's factory; returns the names added by this call
    (none when vLLM-Omni is not installed or they are there already)."""
    try:
        from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    except ImportError as e:  # an entry point of a package that is not there: nothing to do
        _log.debug("vLLM-Omni's connector factory is not importable (%s); nothing registered", e)
        return []
    have = set(OmniConnectorFactory.list_registered_connectors())
    added = []
    for name, class_name in CONNECTORS.items():
        if name in have:
            continue
        try:
            OmniConnectorFactory.register_connector(name, _constructor(class_name))
        except ValueError:  # registered meanwhile (another thread): the same constructor
            continue
        added.append(name)
    if added:
        _log.debug("registered %s with vLLM-Omni's OmniConnectorFactory", ", ".join(added))
    return added
