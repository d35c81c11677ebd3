"""The process test_process_death.py SIGKILLs mid-operation: a connector's or a relay's writer
(one put that completes, then puts of 64 MiB for ever) or reader (a get of the metadata on its
stdin, held). Prints JSON lines: the completed put's metadata, then "go" just before the
operation it is killed in."""
import json
import sys
import time

import numpy as np

import stagelink


def make(kind, name, extra):
    if kind == "relay":
        return stagelink.Relay(dict(extra, backend=name))
    return stagelink.create_connector(name, dict(extra, strict=True))


def put(kind, c, key, data):
    if kind == "relay":
        return dict(c.put_async(data, request_id=key, edge="r").metadata)
    ok, _, md = c.put("w", "r", key, data)
    assert ok
    return md


def get(kind, c, key, md):
    """Held where it can be: a zero-copy view of shared memory is a get still in progress (the
    put is released when the view goes); other transports are killed during the transfer."""
    if kind == "relay":
        return c.get_async(md, zero_copy=True).result()
    if c.name == "SharedMemoryConnector":
        return c.get("w", "r", key, md, timeout=30, zero_copy=True)
    return c.get("w", "r", key, md, timeout=30)


def main():
    role, kind, name, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    c = make(kind, name, extra)
    if role == "writer":
        print(json.dumps(put(kind, c, "done", np.full(1 << 20, 7, np.uint8))), flush=True)
        print(json.dumps("go"), flush=True)
        i = 0
        while True:
            put(kind, c, f"big{i}", np.full(64 << 20, i % 251, np.uint8))
            i += 1
    md = json.loads(sys.stdin.readline())
    print(json.dumps("go"), flush=True)
    held = get(kind, c, "big", md)
    print(json.dumps("got"), flush=True)
    time.sleep(60)
    del held


if __name__ == "__main__":
    main()
