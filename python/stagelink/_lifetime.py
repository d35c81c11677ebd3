"""Shared lifetime plumbing of the Python objects that wrap a native one (``self._native``).

Every such object closes when it is collected. One still alive when the interpreter exits -- held
by a daemon thread, whose frame keeps its module's globals alive too, or by a cycle the final
collection leaves -- is never collected, so it is closed at exit instead: its arena, directory
attachment, queue rings and sockets would otherwise stay in ``/dev/shm`` (and queued control
messages undelivered) until a ``stagelink shm reap``. The close runs after ``multiprocessing``
has joined this process's children (which may still be reading what it put), and after every
exit handler registered after stagelink was imported; in a multiprocessing child too."""

import atexit
import sys
import weakref

# The objects to close at exit: weak references, so tracking keeps nothing alive.
_live: "weakref.WeakSet" = weakref.WeakSet()


def track(obj):
    """Close ``obj`` at interpreter exit if it is still open then. Returns ``obj``."""
    _live.add(obj)
    return obj


def _close_all() -> None:
    for obj in list(_live):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - exiting: one object's failure must not keep the rest open
            pass
    # What still holds a namespace's directory now is a zero-copy view the interpreter will not free
    # (torch tensors alive at exit never are): leave the namespaces, or the directory stays in /dev/shm.
    core = sys.modules.get("stagelink._core")
    if core is not None:
        try:
            core._detach_at_exit()
        except Exception:  # noqa: BLE001
            pass


_deferred = False  # _close_all is one of multiprocessing's exit finalizers


def _defer_to_multiprocessing(mp) -> None:
    """Close in multiprocessing's exit function, after it has joined this process's children (which
    may still read what it put): its lowest-priority finalizer."""
    global _deferred
    if not _deferred:
        mp.Finalize(None, _close_all, exitpriority=-(1 << 30))
        _deferred = True


def _at_exit() -> None:
    mp = sys.modules.get("multiprocessing.util")
    if mp is not None and not getattr(mp, "_exiting", True):
        _defer_to_multiprocessing(mp)  # its exit handler, registered before this one, runs next
        return
    _close_all()


atexit.register(_at_exit)
# A forkserver child (Python 3.14's default start method on Linux) imports multiprocessing before
# stagelink and ends in os._exit after multiprocessing's exit function: no exit handler runs
# there, that function's finalizers do. (A spawn child exits through sys.exit: the handler above
# runs. A fork child starts with the finalizers cleared; what it holds is reclaimed as a dead
# process's, docs/shm.md.)
if "multiprocessing.util" in sys.modules:
    _defer_to_multiprocessing(sys.modules["multiprocessing.util"])


class NativeOwner:
    """``close()``, ``closed``, context manager and close-on-collection over ``self._native``."""

    _native = None

    def close(self) -> None:
        """Release everything this object owns. Safe to call twice."""
        if self._native is not None:
            self._native.close()

    @property
    def closed(self) -> bool:
        return self._native is None or self._native.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
