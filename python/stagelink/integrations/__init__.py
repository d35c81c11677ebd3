"""Ways into the frameworks users already run, through each one's own plugin mechanism; nothing
here is imported unless a framework (or the user) asks for it.

- `vllm_omni`: the ``vllm_omni.general_plugins`` entry point ``stagelink``: registers
  ``StagelinkSharedMemoryConnector``, ``StagelinkTransferEngineConnector`` and
  ``StagelinkStoreConnector`` with vLLM-Omni's ``OmniConnectorFactory``.
- `vllm`: the ``vllm.general_plugins`` entry point ``stagelink``: with ``STAGELINK_VLLM_MQ=1``,
  vLLM's ``shm_broadcast.MessageQueue`` becomes stagelink's.
- `sglang_omni`: with ``STAGELINK_SGLANG_OMNI=1`` (read at interpreter start), the relay type
  ``stagelink`` in SGLang-Omni's ``create_relay`` registry, and stagelink's relay for the ``shm``
  transport its ``CommRouter`` builds.
"""
