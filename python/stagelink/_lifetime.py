"""Shared lifetime plumbing of the Python objects that wrap a native one (``self._native``)."""


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
