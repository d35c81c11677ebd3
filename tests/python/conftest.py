import os
import shutil
import uuid

import pytest

from net_util import start_redis


@pytest.fixture
def ns():
    """A namespace of its own per test; the test must leave nothing of it in /dev/shm."""
    name = "py" + uuid.uuid4().hex[:12]
    yield name
    left = [f for f in os.listdir("/dev/shm") if f".{name}." in f]
    assert not left, f"test left shared memory behind: {left}"


def _mq_files():
    pre = f"sl.{os.getuid()}.mq."
    return {f for f in os.listdir("/dev/shm") if f.startswith(pre)}


@pytest.fixture
def mq_clean():
    """Message-queue tests must leave no mq segment of theirs behind."""
    before = _mq_files()
    yield
    left = _mq_files() - before
    assert not left, f"test left message-queue segments behind: {left}"


@pytest.fixture
def redis():
    """The port of a redis-server started for the test (skipped where none is installed)."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (./scripts/setup installs it)")
    p, port = start_redis()
    yield port
    p.kill()
    p.wait()
