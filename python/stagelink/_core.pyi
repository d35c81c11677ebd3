"""stagelink native core"""

from collections.abc import Sequence

from stagelink import (
    CancelledError as CancelledError,
    ClosedError as ClosedError,
    CorruptError as CorruptError,
    ExhaustedError as ExhaustedError,
    IOError as IOError,
    InvalidArgumentError as InvalidArgumentError,
    KeyInUseError as KeyInUseError,
    NotFoundError as NotFoundError,
    PeerDeadError as PeerDeadError,
    PermissionDeniedError as PermissionDeniedError,
    StagelinkError as StagelinkError,
    TimeoutError as TimeoutError,
    UnsupportedError as UnsupportedError
)


def _set_zero_copy_hook(fn: object | None) -> None:
    """
    what each torch tensor of a zero_copy get passes through as the decoder makes it (None: nothing)
    """

def _detach_at_exit() -> None:
    """
    at interpreter exit: leave every shared-memory namespace still attached (a zero-copy torch view alive then is never freed, and would keep the directory in /dev/shm)
    """

def _set_rebuild_hook(fn: object | None) -> None:
    """
    what a Connector.get's dict holding the key '__stagelink_kv__' passes through (None: nothing)
    """

class _Loan:
    def region(self, arg: int, /) -> object: ...

    @property
    def count(self) -> int: ...

    @property
    def frame_size(self) -> int: ...

    @property
    def valid(self) -> bool: ...

class _Connector:
    def __init__(self, name: str, extra: object | None, allow_pickle: bool = True) -> None: ...

    def put(self, from_stage: object, to_stage: object, put_key: object, data: object | None, *, readers: object | None = None, request_id: object | None = None) -> object:
        """
        Publish ``data`` for ``get(from_stage, to_stage, put_key)``; returns ``(success, size, metadata)``.

        ``readers``: how many gets may read it (fan-out); the memory is freed after the last one.
        ``request_id``: ties the put to a request, so that ``cleanup(request_id)`` frees it (chunk
        keys of one request); without it only ``cleanup(put_key)`` does.
        numpy arrays, torch tensors (any dtype), bytes-likes and trees of dicts, lists, tuples,
        str, int, float, bool and None travel as native frames, readable from C++; ``Loan``
        objects are published in place; anything else is pickled (protocol 5, buffers out of
        band) where ``allow_pickle`` permits.
        """

    def get(self, from_stage: object, to_stage: object, get_key: object, metadata: object | None = None, timeout: object | None = None, *, zero_copy: bool = False, device: object | None = None) -> object:
        """
        Fetch what ``put`` published: ``(data, size)``, or ``None`` when absent, timed out or failed.

        ``metadata``: what put returned (direct lookup); without it the key is looked up, waiting
        up to ``timeout`` seconds (None: ``extra.get_timeout_s``, else a single attempt).
        ``zero_copy``: arrays and buffers are read-only views into shared memory that keep the
        slot alive until dropped; otherwise the data is copied out and the slot freed at once.
        ``device``: where torch tensors land (``"cpu"``, ``"cuda:N"``); None: where they came
        from (a CUDA tensor back on its GPU, found by UUID).
        """

    def _put_parts(self, from_stage: object, to_stage: object, key: str, kind: int, regions: list, readers: int = 0, request_id: object | None = None) -> tuple: ...

    def _get_into_parts(self, from_stage: object, to_stage: object, key: str, metadata: object | None, timeout: object | None, out: object) -> object: ...

    def _loan_array(self, arg0: str, arg1: Sequence[int], /) -> _Loan: ...

    def _put_loan(self, from_stage: object, to_stage: object, key: str, loan: _Loan, readers: int = 0, request_id: object | None = None) -> tuple: ...

    def _cleanup(self, arg: str, /) -> int: ...

    @property
    def allow_pickle(self) -> bool: ...

    @property
    def last_error(self) -> object:
        """
        Why the last put or get failed or returned None (NotFoundError: nothing under the key, or already read by every reader; TimeoutError; CancelledError: cleaned up), kept without its traceback; None after a call that worked.
        """

    @last_error.setter
    def last_error(self, error: object | None) -> None: ...

    def _health(self) -> object: ...

    def close(self) -> None:
        """Release everything this connector owns. Safe to call twice."""

    @property
    def closed(self) -> bool: ...

    def _abandon_get(self, arg: str, /) -> int: ...

    def _reap_consumed(self) -> int: ...

    def _arrival_epoch(self) -> object: ...

    def _wait_arrival(self, arg0: int, arg1: float, /) -> bool: ...

    def _pending_key_list(self) -> object: ...

    def _sender_info(self) -> object: ...

    def _connect(self, sender_info: object | None, timeout: object | None) -> None: ...

    def _update_sender_info(self, arg0: str, arg1: int, /) -> None: ...

class _MessageQueue:
    @staticmethod
    def create(n_reader: int, n_local_reader: int, local_ranks: Sequence[int], max_chunk_bytes: int, max_chunks: int, connect_ip: str, remote_port: int, overflow_bytes: int, warn_interval_s: float, drop_dead_readers: bool, spin_us: int, shm_dir: str, curve: object | None = None) -> _MessageQueue: ...

    @staticmethod
    def create_from_handle(handle: bytes, rank: int, curve: object | None = None) -> _MessageQueue: ...

    def export_handle(self) -> bytes: ...

    def wait_until_ready(self, timeout: object | None) -> None: ...

    def enqueue_parts(self, kind: int, regions: list, timeout: object | None) -> None: ...

    def enqueue_obj(self, obj: object | None, timeout: object | None) -> bool: ...

    def dequeue_parts(self, timeout: object | None) -> tuple: ...

    def wait_message(self, timeout: object | None) -> bool: ...

    def drop_reader(self, arg: int, /) -> None: ...

    def shutdown(self, everyone: bool = False) -> None: ...

    def stats(self) -> object: ...

    @property
    def is_writer(self) -> bool: ...

    @property
    def rank(self) -> int: ...

    @property
    def shutting_down(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

def _torch_routes(exchange_api: bool, dlpack: bool) -> tuple:
    """
    For tests: which of torch's routes tensors may take (DLPack's C exchange API, DLPack capsules; off: the attribute and numpy routes an older torch leaves). Returns the previous setting.
    """

def _frame_as_cpp_sees_it(arg: bytes, /) -> dict: ...

def _frame_from_parts(arg0: object, arg1: list, /) -> bytes:
    """
    For tests: a frame built from its parts, as a C++ producer (or a forger) could send it.
    """

def cuda_drain(timeout_s: float = 30.0) -> bool:
    """
    Wait until the device slots this process read were released (the work it queued on them finished).
    """

def cuda_arenas() -> object:
    """
    This process's device arenas (CUDA tensors it put through a connector that keeps them on their GPU).
    """

def cuda_status() -> object:
    """
    Whether this process can use CUDA (the driver is loaded at run time): {'available': bool, 'reason': why not, or 'driver_version' and 'devices' [{ordinal, name, uuid, total_bytes}]}.
    """

def mq_handle_info(arg: bytes, /) -> dict: ...

def host_address() -> str: ...

def host_pool_stats() -> dict: ...

def expand_env(value: str, key: str, source: str, bare: bool = False) -> str: ...

def encode_object(obj: object | None, limit: int = -1) -> object: ...

def encode_parts(arg0: int, arg1: list, /) -> bytes: ...

def decode_frame_parts(arg: bytes, /) -> tuple: ...

def option_schemas() -> list:
    """
    Every connector's and the relay's option schema (key, type, default, range, meaning): the source of the configuration reference.
    """

def connectors() -> dict:
    """
    Every registered connector's descriptor by name and alias: {name, aliases, traits (host_local, side_channel, pickle_default, device_slots, lookup_gets, python_made), schema, python, doc}.
    """

def relay_backends() -> dict:
    """
    The relay's backends: {name: {connector it makes (None: local, or named by the config), host_local, doc}}.
    """

def check_connector_options(name: str, extra: object | None) -> None:
    """
    For configuration checks: `extra` read by connector `name`'s own option reader, as when it is made, without making it.
    """

def make_private_socket_dir(tag: str = 'stagelink') -> str: ...

def remove_private_socket_dir(arg: str, /) -> None: ...

def registered_connectors() -> list[str]: ...

def load_config_file(path: str, default_shm_threshold: int = 65536) -> dict: ...

def load_config_value(obj: object, source: str, default_shm_threshold: int = 65536) -> dict:
    """
    The transfer-config loader on values already read (a dict), not text: errors name `source` and the key.
    """

def load_config_string(text: str, source: str, default_shm_threshold: int = 65536) -> dict: ...

def transfer_engine_port(base: int, purpose: str, from_stage: int, dp_index: int = 0, tp_size: int = 1, tp_rank: int = 0) -> int: ...

def shm_list(shm_dir: str = '/dev/shm') -> list: ...

def metrics_time_every() -> int: ...

def metrics_set_time_every(n: int) -> None:
    """
    time one put and get in n per thread (1: every one); calls are counted exactly all the same
    """

def count_pickle_refused() -> None:
    """
    count a payload holding a pickle refused unread (stagelink_pickle_refused_total)
    """

def trace_set_recording(on: bool) -> None: ...

def trace_recording() -> bool: ...

def trace_new_id() -> int: ...

def trace_now_ns() -> int: ...

def trace_dropped() -> int: ...

def trace_record(name: str, cat: str, start_ns: int, end_ns: int, trace_hi: int, trace_lo: int, span_id: int, parent_id: int, request_id: str, args: object | None) -> None:
    """
    keep one span in this process's trace buffer (stagelink.trace records through it)
    """

def trace_drain() -> list:
    """
    take every span this process recorded: (name, cat, start_ns, end_ns, trace_hi, trace_lo, span_id, parent_id, request_id, args, tid)
    """

def metrics_collect() -> object:
    """
    every sample of this process's metrics tree: [{name, kind, unit, help, labels, samples}]
    """

def metric_families() -> list:
    """every metric family declared in this process, by name"""

class _Metric:
    @staticmethod
    def get(arg0: str, arg1: str, arg2: str, arg3: str, arg4: Sequence[str], /) -> _Metric: ...

    def add(self, arg0: Sequence[str], arg1: float, /) -> None: ...

    def set(self, arg0: Sequence[str], arg1: float, /) -> None: ...

    def observe(self, arg0: Sequence[str], arg1: float, /) -> None: ...

    def cell(self, arg: Sequence[str], /) -> _MetricCell: ...

class _MetricCell:
    def add(self, arg: float, /) -> None: ...

    def set(self, arg: float, /) -> None: ...

    def observe(self, arg: float, /) -> None: ...

    @property
    def value(self) -> float: ...

def shm_reap(shm_dir: str = '/dev/shm') -> list[str]: ...

def shm_user_prefix() -> str: ...

def curve_keypair() -> tuple:
    """
    A fresh CurveZMQ key pair, (public_key, secret_key), each 40 Z85 characters.
    """

def bench_mq_cpp(arg0: int, arg1: int, arg2: int, arg3: int, arg4: float, arg5: object, /) -> object: ...

def bench_relay_cpp(sizes: Sequence[int], iters: int, ns: str, progress: object | None) -> list: ...

def bench_seam_ns(iters: int = 1000000, rounds: int = 7) -> float:
    """what the metrics seam adds to one put + get, in ns (median of rounds)"""

def bench_shm_cpp(arg0: Sequence[int], arg1: int, arg2: str, arg3: int, /) -> list: ...

def control_encode(type: str, request_id: str, from_stage: str, to_stage: str, metadata: object | None, chunk_id: object | None, is_done: bool, error: str, body: object | None, traceparent: str = '') -> bytes: ...

def control_decode(arg: object, /) -> dict: ...

class _ControlInbox:
    @staticmethod
    def bind(endpoint: str, curve: object | None = None) -> _ControlInbox: ...

    @property
    def refused(self) -> int: ...

    @property
    def authenticated(self) -> bool: ...

    @property
    def endpoint(self) -> str: ...

    def recv(self, timeout: object | None) -> dict: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

class _ControlOutbox:
    @staticmethod
    def connect(endpoint: str, curve: object | None = None) -> _ControlOutbox: ...

    def send(self, type: str, request_id: str, from_stage: str, to_stage: str, metadata: object | None, chunk_id: object | None, is_done: bool, error: str, body: object | None, timeout: object | None, traceparent: str = '') -> None: ...

    def send_bytes(self, data: bytes, timeout: object | None) -> None: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

class _RelayOp:
    @property
    def metadata(self) -> object: ...

    def wait(self, timeout: object | None = None) -> None: ...

    def done(self) -> bool: ...

    def withdraw(self) -> bool: ...

class _Relay:
    def __init__(self, config: object | None, allow_pickle: bool = True) -> None: ...

    def _put_obj(self, data: object | None, request_id: object | None, dst_rank: object | None, edge: str, readers: int, traceparent: str = '') -> object: ...

    def _put_ref(self, data: object | None, request_id: object | None, dst_rank: object | None, edge: str, readers: int, nbytes: int, traceparent: str = '') -> object: ...

    def _put_parts(self, kind: int, regions: list, request_id: object | None, dst_rank: object | None, edge: str, readers: int, traceparent: str = '') -> _RelayOp: ...

    def _put_segments(self, segments: object, total: int, request_id: object | None, dst_rank: object | None, edge: str, readers: int, traceparent: str = '') -> _RelayOp: ...

    def _get_found(self, metadata: object | None, request_id: object | None, timeout: object | None, zero_copy: bool, traceparent: str = '') -> tuple: ...

    def _get_into(self, metadata: object | None, out: object, request_id: object | None, timeout: object | None, traceparent: str = '') -> int: ...

    def sender_info(self) -> object:
        """
        Where another process's relay reaches this one's puts (a transfer engine's source_host and source_port), or None where nothing needs connecting (shared memory).
        """

    def _connect(self, sender_info: object | None, timeout: object | None) -> None: ...

    def cleanup(self, arg: str, /) -> int:
        """
        Release every unread put of ``request_id`` on this host and this relay's credits for them; returns how many.
        """

    def health(self) -> object: ...

    @property
    def allow_pickle(self) -> bool: ...

    def close(self) -> None:
        """
        Release everything; waits for credits end with ClosedError. Idempotent.
        """

    @property
    def closed(self) -> bool: ...
