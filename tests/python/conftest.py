import os
import uuid

import pytest


@pytest.fixture
def ns():
    """A namespace of its own per test; the test must leave nothing of it in /dev/shm."""
    name = "py" + uuid.uuid4().hex[:12]
    yield name
    left = [f for f in os.listdir("/dev/shm") if f".{name}." in f]
    assert not left, f"test left shared memory behind: {left}"
