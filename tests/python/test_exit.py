"""Objects still alive when the interpreter exits: closed then, after multiprocessing's children."""
import os
import subprocess
import sys
import textwrap

import pytest

# A stage whose daemon thread holds a connector (with a put in its arena) and a message queue at
# exit. The thread runs a function of the script's own module, whose frame keeps the module's
# globals alive too: nothing of it is ever collected, so only an exit-time close releases them.
_HELD_BY_DAEMON = """
import sys, threading, time
import stagelink
c = stagelink.create_connector("SharedMemoryConnector", {"namespace": sys.argv[1]})
ok, _, meta = c.put(0, 1, "k", b"x" * (1 << 20))
assert ok and "shm" in meta, meta
q = stagelink.MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
def hold(*objs):
    while True:
        time.sleep(0.05)
threading.Thread(target=hold, args=(c, q), daemon=True).start()
"""

# A producer that hands its put's metadata to a multiprocessing child and exits without joining
# it: multiprocessing joins the child at exit, and the connector must stay open until it has read.
_CHILD_READS_AFTER_EXIT = """
import sys, time
import multiprocessing as mp
if sys.argv[3] == "mp-first":  # as importing torch does: multiprocessing's exit handler runs after stagelink's
    import multiprocessing.util
import stagelink

def read(ns, meta, out):
    time.sleep(1.0)  # the parent is in its exit meanwhile
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    got = c.get(0, 1, "k", meta, timeout=10)
    with open(out, "w") as f:
        f.write("ok" if got is not None and got[0] == b"y" * (1 << 20) else "lost: %.60r" % (got,))
    c.close()

if __name__ == "__main__":
    ns, out = sys.argv[1], sys.argv[2]
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    ok, _, meta = c.put(0, 1, "k", b"y" * (1 << 20))
    assert ok and "shm" in meta, meta
    mp.get_context("spawn").Process(target=read, args=(ns, meta, out)).start()
"""


# The same held by a daemon thread of a forkserver child, which ends in os._exit after
# multiprocessing's exit function: no exit handler runs there.
_HELD_IN_A_CHILD = """
import sys, threading, time
import multiprocessing as mp

def hold(*objs):
    while True:
        time.sleep(0.05)

def stage(ns):
    import stagelink
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    ok, _, meta = c.put(0, 1, "k", b"x" * (1 << 20))
    assert ok and "shm" in meta, meta
    threading.Thread(target=hold, args=(c,), daemon=True).start()

if __name__ == "__main__":
    p = mp.get_context("forkserver").Process(target=stage, args=(sys.argv[1],))
    p.start()
    p.join(60)
    sys.exit(p.exitcode)
"""


def _run(tmp_path, script, *args):
    path = tmp_path / "stage.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)


def test_objects_held_by_a_daemon_thread_at_exit_are_closed(ns, tmp_path):
    """A connector and a queue still referenced when the process exits (a daemon thread holds
    them) leave nothing in /dev/shm: before, their arena, directory and rings stayed there until
    a `stagelink shm reap`."""
    rings = {f for f in os.listdir("/dev/shm") if ".mq." in f}
    p = _run(tmp_path, _HELD_BY_DAEMON, ns)
    assert p.returncode == 0, p.stderr
    left = [f for f in os.listdir("/dev/shm") if f".{ns}." in f or (".mq." in f and f not in rings)]
    assert not left, f"left in /dev/shm at exit: {left}\n{p.stderr}"


@pytest.mark.parametrize("order", ["mp-first", "stagelink-first"])
def test_exit_close_waits_for_multiprocessing_children(ns, tmp_path, order):
    """The exit-time close runs after multiprocessing has joined the process's children: a child
    still reading what its parent put when the parent's script ends gets the whole payload,
    whichever of the two was imported first (their exit handlers run in the reverse order)."""
    out = tmp_path / "result"
    p = _run(tmp_path, _CHILD_READS_AFTER_EXIT, ns, str(out), order)
    assert p.returncode == 0, p.stderr
    assert out.read_text() == "ok", p.stderr


def test_objects_held_in_a_multiprocessing_child_at_its_exit_are_closed(ns, tmp_path):
    """A forkserver child's daemon-held connector is closed at the child's exit too (before, its
    arena and directory stayed: the child ends in os._exit, where no exit handler runs)."""
    p = _run(tmp_path, _HELD_IN_A_CHILD, ns)
    assert p.returncode == 0, p.stderr
    left = [f for f in os.listdir("/dev/shm") if f".{ns}." in f]
    assert not left, f"left in /dev/shm at the child's exit: {left}\n{p.stderr}"


# A zero-copy torch view alive at exit: torch never frees tensors still referenced then, so the
# view's hold on its namespace's directory was never let go.
_TORCH_VIEW_AT_EXIT = """
import sys
import torch
import stagelink
with stagelink.SharedMemoryConnector({"namespace": sys.argv[1]}) as c:
    ok, _, meta = c.put(0, 1, "k", {"t": torch.ones(1 << 18)})
    view, _ = c.get(0, 1, "k", meta, zero_copy=True)
assert float(view["t"].sum()) == 1 << 18
"""


def test_a_zero_copy_torch_view_alive_at_exit_leaves_nothing(ns, tmp_path):
    """Before, the directory sl.<uid>.<ns>.dir stayed in /dev/shm (found by the KV-cache docs'
    example, which keeps a zero-copy cache to the end)."""
    pytest.importorskip("torch")
    p = _run(tmp_path, _TORCH_VIEW_AT_EXIT, ns)
    assert p.returncode == 0, p.stderr
    left = [f for f in os.listdir("/dev/shm") if f".{ns}." in f]
    assert not left, f"left in /dev/shm at exit: {left}\n{p.stderr}"
