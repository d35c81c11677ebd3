"""Prefill -> decode disaggregation of a small transformers model across two processes, its KV
cache moved by stagelink with no hand flattening:

    python -m stagelink.examples.kv_disaggregation [--dtype bfloat16] [--tokens 16] [--zero-copy]

The model is a Llama made from a config and randomly initialised with a fixed seed (no weights to
download; both processes build the same one). The prefill process runs the prompt, puts
``{"past_key_values": DynamicCache, "next_token": tensor}`` on a shared-memory connector and
exits; this process gets it (a ``DynamicCache`` again), decodes greedily, and checks its tokens
and every decode step's logits equal a single-process ``model.generate`` of the same prompt.
Exit status 0 when they do.
Needs torch and transformers (``pip install stagelink[torch] transformers``).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time


def build_model(dtype: str = "bfloat16"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def prompt_ids(length: int = 48):
    import torch
    return torch.arange(1, length + 1, dtype=torch.long).remainder(500).unsqueeze(0) + 3


def prefill(namespace: str, dtype: str, prompt_len: int, q) -> None:
    """The prefill stage: runs the prompt once, puts the cache and the first generated token."""
    import torch
    import stagelink
    model = build_model(dtype)
    with torch.no_grad():
        out = model(prompt_ids(prompt_len), use_cache=True)
    next_token = out.logits[:, -1:].argmax(-1)
    with stagelink.SharedMemoryConnector({"namespace": namespace}) as c:
        ok, size, meta = c.put("prefill", "decode", "req-1",
                               {"past_key_values": out.past_key_values, "next_token": next_token})
        q.put((ok, size, meta))
        q.get(timeout=120)  # the decoder has it (a put's memory lives until it is read or the sender cleans up)


def decode(cache, next_token, tokens: int, model):
    """Greedy decode from a prefilled cache: the tokens, and the logits of each step."""
    import torch
    out_tokens, logits = [int(next_token)], []
    with torch.no_grad():
        for _ in range(tokens - 1):
            out = model(next_token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1].float())
            next_token = out.logits[:, -1:].argmax(-1)
            out_tokens.append(int(next_token))
    return out_tokens, logits


def run(dtype: str = "bfloat16", tokens: int = 16, prompt_len: int = 48, zero_copy: bool = False,
        namespace: str | None = None) -> dict:
    """The whole example; returns what it checked (``match`` is the verdict)."""
    import torch
    import stagelink
    namespace = namespace or f"kvex{os.getpid()}"
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_prefill_entry, args=(namespace, dtype, prompt_len, q, done))
    p.start()
    try:
        ok, size, meta = q.get(timeout=300)
        if not ok:
            raise RuntimeError("the prefill process's put failed")
        model = build_model(dtype)
        with stagelink.SharedMemoryConnector({"namespace": namespace}) as c:
            t0 = time.perf_counter()
            got, _ = c.get("prefill", "decode", "req-1", meta, zero_copy=zero_copy)
            get_ms = (time.perf_counter() - t0) * 1e3
            done.put(True)
            cache = got["past_key_values"]
            disaggregated, logits = decode(cache, got["next_token"], tokens, model)
            del got, cache
        with torch.no_grad():
            ids = prompt_ids(prompt_len)
            whole = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens,
                                   output_logits=True, return_dict_in_generate=True)
        single = [int(t) for t in whole.sequences[0, ids.shape[1]:]]
        # generate's logits of steps 2.. are the decode steps' (step 1 is the prefill's)
        diff = max(float((a - b.float()).abs().max()) for a, b in zip(logits, whole.logits[1:]))
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    return {"match": disaggregated == single and diff == 0.0, "max_logit_diff": diff,
            "disaggregated": disaggregated, "single_process": single,
            "cache_bytes": size, "get_ms": get_ms, "cache_type": "DynamicCache"}


def _prefill_entry(namespace, dtype, prompt_len, q, done):
    class _Both:  # the queue the parent reads from, and the one it answers on
        def put(self, x):
            q.put(x)

        def get(self, timeout=None):
            return done.get(timeout=timeout)
    prefill(namespace, dtype, prompt_len, _Both())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", type=int, default=16, help="tokens to decode (default 16)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--zero-copy", action="store_true", help="decode on views of the shared memory")
    a = ap.parse_args(argv)
    r = run(a.dtype, a.tokens, a.prompt_len, a.zero_copy)
    print(f"KV cache: {r['cache_bytes'] / 1024:.0f} KiB ({r['cache_type']}), get {r['get_ms']:.2f} ms")
    print(f"disaggregated: {r['disaggregated']}")
    print(f"generate():    {r['single_process']}")
    print(f"largest difference of the decode steps' logits: {r['max_logit_diff']}")
    print("tokens and logits match" if r["match"] else "THEY DIFFER")
    return 0 if r["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
