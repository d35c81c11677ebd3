"""Smoke test of an installed wheel: what issue 55 lists, each in this fresh environment."""
import json, os, subprocess, sys, tempfile, time, uuid
import numpy as np
import stagelink

ns = "wh" + uuid.uuid4().hex[:8]
# 1. shared memory across processes
with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
    a = np.arange(1 << 20, dtype=np.float32)
    ok, _, meta = c.put(0, 1, "k", {"a": a, "ids": [1, 2, 3]})
    code = ("import stagelink, numpy as np, sys, json\n"
            f"c = stagelink.create_connector('SharedMemoryConnector', {{'namespace': '{ns}'}})\n"
            "d, _ = c.get(0, 1, 'k', json.loads(sys.argv[1]))\n"
            "print(float(d['a'].sum()), d['ids']); c.close()\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(meta, default=lambda b: None)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(float(a.sum())), out.stdout
print("shm across processes: ok")
# 2. MessageQueue with a remote reader (loopback)
w = stagelink.MessageQueue(2, 1, max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1")
h = w.export_handle()
r_local = stagelink.MessageQueue.create_from_handle(h, 0)
r_remote = stagelink.MessageQueue.create_from_handle(h, 1)
w.wait_until_ready(30); r_local.wait_until_ready(30); r_remote.wait_until_ready(30)
w.enqueue({"x": np.arange(10)})
assert r_local.dequeue(timeout=10)["x"].sum() == 45 and r_remote.dequeue(timeout=10)["x"].sum() == 45
for q in (r_local, r_remote, w):
    q.close()
print("queue with a remote reader: ok")
# 3. transfer engine over loopback TCP
snd = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "protocol": "tcp", "role": "sender", "memory_pool_size": 64 << 20})
port = snd.health()["zmq_port"]
rcv = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "protocol": "tcp", "role": "receiver", "sender_host": "127.0.0.1", "sender_zmq_port": port, "memory_pool_size": 64 << 20})
big = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8)
ok, _, meta = snd.put(0, 1, "t", big)
got, _ = rcv.get(0, 1, "t", meta)
assert ok and np.array_equal(got, big)
maps = open("/proc/self/maps").read()
assert "stagelink.libs/libucp" in maps and "/usr/lib/x86_64-linux-gnu/libucp" not in maps, "a system UCX was loaded"
rcv.close(); snd.close()
print("transfer engine over loopback TCP (the carried UCX): ok")
# 4. the store against redis-server
port = 6390 + os.getpid() % 500
srv = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
try:
    time.sleep(0.5)
    with stagelink.create_connector("StoreConnector", {"host": "127.0.0.1", "port": port}) as s:
        ok, _, meta = s.put(0, 1, "s", big)
        got, _ = s.get(0, 1, "s", meta)
        assert ok and np.array_equal(got, big)
finally:
    srv.kill(); srv.wait()
print("store against redis-server: ok")
