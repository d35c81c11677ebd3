"""KV caches as users hold them (stagelink.kv): transformers' DynamicCache through the connectors
as its tensors (no pickle, rebuilt on get), lists of (key, value) pairs and dicts of tensors as
they are, zero-copy views a decode can extend, and the runnable disaggregation example checked
against single-process generate."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import stagelink  # noqa: E402
from stagelink import kv  # noqa: E402


def _cache(layers=3, tokens=5, dtype=torch.bfloat16):
    c = DynamicCache()
    g = torch.Generator().manual_seed(1)
    for i in range(layers):
        c.update(torch.randn(1, 2, tokens, 16, generator=g).to(dtype), torch.randn(1, 2, tokens, 16, generator=g).to(dtype), i)
    return c


def _same(a, b):
    assert type(b) is DynamicCache and len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        assert x.keys.dtype == y.keys.dtype and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_dynamic_cache_travels_as_its_tensors_without_pickle(ns):
    """Before, a DynamicCache was pickled (and refused where pickle is off); now it is native and
    comes back a DynamicCache, alone or as a value of the payload dict."""
    c = _cache()
    with stagelink.SharedMemoryConnector({"namespace": ns, "allow_pickle": False}) as s:
        ok, size, meta = s.put(0, 1, "a", c)
        assert ok and size >= 3 * 2 * 2 * 5 * 16 * 2
        got, _ = s.get(0, 1, "a", meta)
        _same(c, got)
        assert got.get_seq_length() == 5
        ok, _, meta = s.put(0, 1, "b", {"past_key_values": c, "next_token": torch.tensor([[7]]), "step": 3})
        assert ok
        got, _ = s.get(0, 1, "b", meta)
        _same(c, got["past_key_values"])
        assert got["step"] == 3 and got["next_token"].tolist() == [[7]]


def test_zero_copy_cache_is_read_only_and_still_decodes(ns):
    """zero_copy: the cache's tensors view shared memory; an in-place write raises instead of
    SIGSEGV, and the decode's update (a concatenation) makes new tensors."""
    c = _cache()
    with stagelink.SharedMemoryConnector({"namespace": ns}) as s:
        ok, _, meta = s.put(0, 1, "a", {"past_key_values": c})
        got, _ = s.get(0, 1, "a", meta, zero_copy=True)
        cache = got["past_key_values"]
        with pytest.raises(stagelink.ReadOnlyInputError):
            cache.layers[0].keys.add_(1)
        with pytest.raises(stagelink.ReadOnlyInputError):  # every layer, as the rebuild left them
            cache.layers[-1].values.mul_(2)
        assert all(layer.dtype == torch.bfloat16 and layer.device == torch.device("cpu") for layer in cache.layers)
        k, v = torch.ones(1, 2, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
        cache.update(k, v, 0)
        assert cache.get_seq_length() == 6 and torch.equal(cache.layers[0].keys[:, :, :5], c.layers[0].keys)
        del got, cache


def test_pairs_and_dicts_travel_as_they_are(ns):
    c = _cache()
    layers = [(layer.keys, layer.values) for layer in c.layers]
    named = {f"layer{i}.{w}": t for i, (k, v) in enumerate(layers) for w, t in (("k", k), ("v", v))}
    with stagelink.SharedMemoryConnector({"namespace": ns, "allow_pickle": False}) as s:
        for key, data in (("pairs", layers), ("tuple", tuple(layers)), ("dict", named)):
            ok, _, meta = s.put(0, 1, key, data)
            assert ok
            got, _ = s.get(0, 1, key, meta)
            assert type(got) is type(data)
            if key == "dict":
                assert set(got) == set(named) and all(torch.equal(got[n], named[n]) for n in named)
            else:
                assert all(type(p) is tuple and torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
                           for p, q in zip(got, layers))


def test_a_cache_it_cannot_rebuild_is_left_to_pickle(ns):
    """A cache with layers other than full-attention DynamicLayers (here a sliding-window one) is
    not flattened (it could not come back as it was): pickled where allowed, refused otherwise."""
    cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=4, hidden_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=64, vocab_size=64)
    c = DynamicCache(config=cfg)
    for i in range(2):
        c.update(torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16), i)
    assert kv.pack(c) is None
    with stagelink.SharedMemoryConnector({"namespace": ns, "allow_pickle": False}) as strict:
        assert strict.put(0, 1, "a", c)[0] is False
    with stagelink.SharedMemoryConnector({"namespace": ns, "allow_pickle": True}) as s:
        ok, _, meta = s.put(0, 1, "a", c)
        got, _ = s.get(0, 1, "a", meta)
        assert type(got) is DynamicCache and torch.equal(got.layers[1].values, c.layers[1].values)


def test_the_marked_form_is_plain_data():
    """What C++ readers see: the mark, and the cache as [key, value] pairs; a dict that merely has
    the key (not ours) is left alone by the rebuild."""
    c = _cache(layers=2)
    packed = kv.pack({"past_key_values": c, "x": 1})
    assert packed[kv.MARK] == {"past_key_values": "DynamicCache"} and packed["value"]["x"] == 1
    assert [len(p) for p in packed["value"]["past_key_values"]] == [2, 2]
    assert kv.unpack({kv.MARK: "not a dict"}) == {kv.MARK: "not a dict"}
    _same(c, kv.unpack(kv.pack(c)))


def test_transfer_engine_takes_a_dynamic_cache():
    """The transfer engine refused a DynamicCache (pickle is off across hosts); now it is native."""
    c = _cache()
    s = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "role": "sender",
                                                               "memory_pool_size": 16 << 20})
    r = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "role": "receiver",
                                                               "memory_pool_size": 16 << 20})
    try:
        ok, _, meta = s.put(0, 1, "kv", {"past_key_values": c})
        assert ok
        got, _ = r.get(0, 1, "kv", meta)
        _same(c, got["past_key_values"])
    finally:
        r.close()
        s.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype, zero_copy", [("bfloat16", False), ("float32", True)])
def test_disaggregation_example_matches_generate(ns, dtype, zero_copy):
    """The example: prefill in one process, decode in another from the moved cache; tokens and
    every decode step's logits equal single-process generate."""
    from stagelink.examples import kv_disaggregation
    r = kv_disaggregation.run(dtype=dtype, tokens=8, zero_copy=zero_copy, namespace=ns)
    assert r["match"], r
    assert len(r["disaggregated"]) == 8 and r["cache_bytes"] > 4 * 2 * 48 * 64
    assert not [f for f in os.listdir("/dev/shm") if ns in f]


@pytest.mark.timeout(300)
def test_bench_kv_measures_every_method_and_charts_them(tmp_path):
    """`stagelink bench kv` at one small size: each method's transfers timed end to end (the
    receiver held a DynamicCache), torch.multiprocessing measured in the same run, and a chart."""
    import io
    import json
    from stagelink.bench_kv import run_kv
    from stagelink.bench_plot import charts
    out = io.StringIO()
    run_kv([256 << 10], str(tmp_path / "kv.json"), out=out)
    result = json.loads((tmp_path / "kv.json").read_text())
    (row,) = result["rows"]
    for m in ("copying get", "zero-copy", "torch.mp"):
        assert 0 < row[m]["min_ms"] <= row[m]["median_ms"] <= row[m]["max_ms"] < 10_000
    assert "torch.mp / copying" in out.getvalue()
    g = row["get_alone"]  # the get's own cost, beside one memcpy of the cache
    assert 0 < g["zero-copy"] < 10_000 and 0 < g["copying"] < 10_000 and "The get alone" in out.getvalue()
    (title, svg), = charts(result)
    assert "torch.multiprocessing" in svg and "DynamicCache" in title
