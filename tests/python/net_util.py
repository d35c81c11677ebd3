"""Loopback ports for the tests, and the redis-server instances they start and stop themselves
(loopback, or a network namespace through ``prefix``): the ``redis`` fixture (conftest.py) and
test_store.py's servers."""
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n):
    """A base port whose ``n`` ports from it are free on 127.0.0.1 now; None if none was found."""
    import random
    for _ in range(100):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return None


def start_redis(prefix=(), bind="127.0.0.1"):
    """(process, port) of a redis-server that answers PING; the caller kills it."""
    port = free_port()
    p = subprocess.Popen(list(prefix) + ["redis-server", "--port", str(port), "--bind", bind, "--save", "",
                                         "--appendonly", "no", "--protected-mode", "no"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        r = subprocess.run(list(prefix) + ["redis-cli", "-h", bind, "-p", str(port), "PING"], capture_output=True, text=True)
        if r.stdout.strip() == "PONG":
            return p, port
        time.sleep(0.02)
    p.kill()
    raise RuntimeError("redis-server did not start")
