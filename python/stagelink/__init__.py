"""stagelink: move tensors, hidden states and KV caches between pipeline stages.

    import stagelink
    with stagelink.create_connector("SharedMemoryConnector") as c:
        ok, size, meta = c.put(0, 1, "req-1", {"hidden": np.zeros((4, 4096), np.float16)})
        data, size = c.get(0, 1, "req-1", meta)
"""
import os as _os

# A wheel carries its own UCX (stagelink.libs/, renamed by auditwheel) and the transport modules
# UCX loads at run time (stagelink.libs/ucx/, made to link that copy): point UCX there, unless the
# user chose, so that it never loads a system UCX's modules beside the carried one.
_ucx_modules = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "stagelink.libs", "ucx")
if _os.path.isdir(_ucx_modules):
    _os.environ.setdefault("UCX_MODULE_DIR", _ucx_modules)

from . import _core  # noqa: E402
from ._core import (  # noqa: F401  exception classes
    CancelledError, ClosedError, CorruptError, ExhaustedError, InvalidArgumentError, IOError,
    KeyInUseError, NotFoundError, PeerDeadError, PermissionDeniedError, StagelinkError, TimeoutError, UnsupportedError,
)
from .config import (ConnectorSpec, Edge, OmniTransferConfig, TransferConfig,  # noqa: F401
                     get_connectors_config_for_stage, load_omni_transfer_config, load_transfer_config)
from .connector import (Connector, Loan, MooncakeTransferEngineConnector, OmniConnectorBase, OmniConnectorFactory,  # noqa: F401
                        OmniSerializer, SharedMemoryConnector, StoreConnector, TransferEngineConnector,
                        create_connector)
from .initialization import (build_stage_connectors, create_connectors_from_config,  # noqa: F401
                             get_stage_connector_config, initialize_connectors_from_config,
                             initialize_orchestrator_connectors)
from .control import ControlMessage  # noqa: F401
from .mq import MessageQueue  # noqa: F401
from .relay import (LocalRelay, Relay, RelayOperation, ShmRelay, UcxRelay, create_relay,  # noqa: F401
                    register_relay)
from . import metrics  # noqa: F401,E402
from .metrics import serve_metrics  # noqa: F401,E402
from .pipeline import Pipeline  # noqa: F401
from .pipeline._readonly import ReadOnlyInputError, protect_tensor as _protect_tensor  # noqa: F401

# A zero_copy get's torch tensors view read-only shared memory: an in-place write there raises
# ReadOnlyInputError instead of killing the process with SIGSEGV (as a stage's inputs do). The
# decoder passes each torch tensor it makes through this, not the whole result.
_core._set_zero_copy_hook(_protect_tensor)
# A KV cache sent as its tensors (transformers' DynamicCache) comes back as the cache (stagelink.kv).
from . import kv  # noqa: E402
_core._set_rebuild_hook(kv.unpack)

from ._version import __version__  # noqa: F401  (the one place it is written)


def __getattr__(name):
    # MooncakeStoreConnector's module is imported on first use (it drives Mooncake's client).
    if name == "MooncakeStoreConnector":
        from .mooncake_store import MooncakeStoreConnector
        return MooncakeStoreConnector
    raise AttributeError(f"module 'stagelink' has no attribute '{name}'")


def registered_connectors():
    return list(_core.registered_connectors())


def curve_keypair() -> tuple:
    """A fresh CurveZMQ key pair ``(public_key, secret_key)`` (40 Z85 characters each) for the
    ``curve`` settings of control inboxes and outboxes, the transfer engine's side channel and the
    message queue's remote path (SECURITY.md). Keep the secret key out of command lines and files
    others can read."""
    return _core.curve_keypair()


def get_cmake_dir() -> str:
    """The directory of the CMake package this installed stagelink carries (its headers and static
    library beside it), for C++ stage libraries: ``cmake -Dstagelink_DIR=$(stagelink --cmake-dir)``,
    then ``find_package(stagelink)`` gives ``stagelink::stagelink`` (examples/cpp_stage). The
    libraries it links (libzmq, UCX, hiredis, xxhash, yaml-cpp, OpenSSL) are found on the system.
    Raises FileNotFoundError where this install has none (a build that left it out)."""
    import glob
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "lib*", "**", "cmake", "stagelink", "stagelinkConfig.cmake"),
                             recursive=True))
    if not found:
        raise FileNotFoundError(f"no CMake package under {here} (a C++ build installs one with cmake --install)")
    return os.path.dirname(found[0])


def cuda_status() -> dict:
    """Whether stagelink can use CUDA here. The driver (libcuda.so.1) is loaded at run time, so
    stagelink installs and runs without it. Returns ``{"available": False, "reason": ...}`` or
    ``{"available": True, "driver_version": 12040, "devices": [{"ordinal", "name", "uuid",
    "total_bytes"}]}``. ``STAGELINK_CUDA=0`` turns CUDA off."""
    return _core.cuda_status()


def transfer_engine_port(base: int, purpose: str, from_stage: int, dp_index: int = 0, tp_size: int = 1,
                         tp_rank: int = 0) -> int:
    """Side-channel port of vLLM-Omni's transfer engine: base + purpose offset
    (request_forwarding 0, kv_transfer 100, orchestrator 200) + from_stage + dp_index*tp_size + tp_rank."""
    return _core.transfer_engine_port(base, purpose, int(from_stage), dp_index, tp_size, tp_rank)
