#!/usr/bin/env python3
"""Measures a running `dsx serve` from the outside, as clients see it (standard library only).

    python3 tools/serve_bench.py --url http://127.0.0.1:8080 [--concurrency 1,4,16]
        [--prompt-tokens 1024] [--max-tokens 64] [--reuse-tokens 8192] [--json OUT]

1. Concurrency: for each level C, C clients at once each send one streaming
   /v1/chat/completions request with a prompt of their own (no shared prefix) and
   max_tokens; per request the time to first token (the first streamed delta) and the
   decode rate ((completion tokens - 1) / (last delta - first delta)); per level the
   medians, the aggregate decode tokens/s (all completion tokens after each first one,
   over the span from the first first-token to the last delta), and the steady state:
   streamed deltas per second while all C streams decode (after the last first token,
   before the first stream ends), with the implied step time (C / that rate).
2. Prefix reuse: a cold request with a prompt of about --reuse-tokens tokens, then the
   conversation's second turn (the same messages, the answer, a short new user message);
   time to first token of both and their ratio, with usage's cached tokens.

Prompts are random words (seeded): on a synthetic model the text is noise anyway, and on a
trained one they still exercise prefill. Token counts come from the server's usage.
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("alpha beta gamma delta kernel tensor stream window expert router cache token layer "
         "prefix buffer shard graph block anchor draft verify sample commit rollback session "
         "vector matrix scale queue worker thread socket request answer tool schema value").split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def stream_chat(url, messages, max_tokens, timeout=600):
    """One streaming chat completion; returns dict with t0, first, last, usage, text."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    body = json.dumps({
        "model": "dsx", "messages": messages, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
    })
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    usage = None
    text = []
    times = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or {}
            piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
            if piece or d.get("tool_calls"):
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
                times.append(now)
                text.append(piece)
    conn.close()
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a delta or without usage")
    return {"t0": t0, "first": first, "last": last, "usage": usage, "text": "".join(text), "times": times}


def concurrency_level(url, c, prompt_words, max_tokens, seed):
    results = [None] * c
    errors = []

    def client(i):
        rng = random.Random(seed * 1000 + i)
        msgs = [{"role": "user", "content": f"[{seed}-{i}] " + words(rng, prompt_words)}]
        try:
            results[i] = stream_chat(url, msgs, max_tokens)
        except Exception as e:  # reported below, the level fails
            errors.append(f"client {i}: {e}")

    th = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    ttft = [r["first"] - r["t0"] for r in results]
    rates = []
    for r in results:
        n = r["usage"]["completion_tokens"]
        if n > 1 and r["last"] > r["first"]:
            rates.append((n - 1) / (r["last"] - r["first"]))
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    decoded = sum(max(0, r["usage"]["completion_tokens"] - 1) for r in results)
    # steady state: the window in which every stream is past its first token and none has ended
    # (no prefill of another client in between): streamed deltas per second in it
    w0, w1 = max(r["first"] for r in results), min(r["last"] for r in results)
    steady = 0.0
    if w1 - w0 > 0.05:
        n = sum(sum(1 for t in r["times"] if w0 < t <= w1) for r in results)
        steady = n / (w1 - w0)
    return {
        "concurrency": c,
        "prompt_tokens": statistics.median(r["usage"]["prompt_tokens"] for r in results),
        "completion_tokens": statistics.median(r["usage"]["completion_tokens"] for r in results),
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "decode_tok_s_per_stream_median": statistics.median(rates) if rates else 0.0,
        "decode_tok_s_aggregate": decoded / span if span > 0 else 0.0,
        "steady_window_s": max(0.0, w1 - w0),
        "steady_deltas_per_s": steady,
        "steady_step_ms": 1e3 * c / steady if steady > 0 else 0.0,
    }


def first_turn(url, prompt_words, max_tokens, seed, tag):
    """A conversation's cold turn; returns its second turn's messages (the answer and a
    next user message) with the cold figures."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": words(rng, 40)},
            {"role": "user", "content": f"[{tag} {seed}] " + words(rng, prompt_words)}]
    cold = stream_chat(url, msgs, max_tokens)
    msgs2 = msgs + [{"role": "assistant", "content": cold["text"]}, {"role": "user", "content": words(rng, 30)}]
    return {"messages": msgs2, "cold_ttft_s": cold["first"] - cold["t0"],
            "cold_prompt_tokens": cold["usage"]["prompt_tokens"]}


def second_turn(url, max_tokens, saved):
    """The second turn of a conversation first_turn made (this server's or a restarted one's)."""
    r = stream_chat(url, saved["messages"], max_tokens)
    cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    t = r["first"] - r["t0"]
    return {"cold_prompt_tokens": saved["cold_prompt_tokens"], "cold_ttft_s": saved["cold_ttft_s"],
            "second_turn_prompt_tokens": r["usage"]["prompt_tokens"], "second_turn_cached_tokens": cached,
            "second_turn_ttft_s": t,
            "ttft_ratio_cold_over_second": saved["cold_ttft_s"] / t if t > 0 else float("inf")}


def reuse(url, prompt_words, max_tokens, seed):
    return second_turn(url, max_tokens, first_turn(url, prompt_words, max_tokens, seed, "reuse"))


def save_conversation(url, prompt_words, max_tokens, seed, path):
    """The cold turn of a conversation, saved for continue_conversation."""
    saved = first_turn(url, prompt_words, max_tokens, seed, "restart")
    with open(path, "w") as f:
        json.dump(saved, f)
    return {"cold_prompt_tokens": saved["cold_prompt_tokens"], "cold_ttft_s": saved["cold_ttft_s"]}


def continue_conversation(url, max_tokens, path):
    """The saved conversation's second turn (e.g. against a restarted server)."""
    with open(path) as f:
        return second_turn(url, max_tokens, json.load(f))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="approximate prompt tokens per client")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reuse-tokens", type=int, default=8192, help="approximate tokens of the reuse test (0: skip)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--save-conversation", metavar="FILE",
                    help="only: the cold turn of a --reuse-tokens conversation, saved for --continue-conversation")
    ap.add_argument("--continue-conversation", metavar="FILE",
                    help="only: the second turn of a saved conversation (e.g. after a server restart)")
    a = ap.parse_args()
    out = {"levels": []}
    if a.save_conversation or a.continue_conversation:
        if a.save_conversation:
            r = save_conversation(a.url, int(a.reuse_tokens / 1.3), a.max_tokens, a.seed + 555, a.save_conversation)
            print(f"saved conversation: cold {r['cold_prompt_tokens']} tok ttft {r['cold_ttft_s']*1e3:.1f} ms", flush=True)
        else:
            r = continue_conversation(a.url, a.max_tokens, a.continue_conversation)
            print(f"continued conversation: cold {r['cold_prompt_tokens']} tok ttft {r['cold_ttft_s']*1e3:.1f} ms; "
                  f"second turn {r['second_turn_prompt_tokens']} tok ({r['second_turn_cached_tokens']} cached) ttft "
                  f"{r['second_turn_ttft_s']*1e3:.1f} ms; ratio {r['ttft_ratio_cold_over_second']:.1f}x", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    # about 1.3 tokens per random word with the V4.1 tokenizer (measured figures: usage)
    wpt = 1 / 1.3
    stream_chat(a.url, [{"role": "user", "content": "warm up"}], 4)
    for c in [int(x) for x in a.concurrency.split(",") if x]:
        r = concurrency_level(a.url, c, int(a.prompt_tokens * wpt), a.max_tokens, a.seed + c)
        out["levels"].append(r)
        print(f"concurrency {c:3d}: prompt {r['prompt_tokens']:.0f} tok, ttft median {r['ttft_median_s']*1e3:8.1f} ms "
              f"(max {r['ttft_max_s']*1e3:8.1f}), decode {r['decode_tok_s_per_stream_median']:8.1f} tok/s per stream, "
              f"{r['decode_tok_s_aggregate']:8.1f} tok/s in all; all {c} decoding: {r['steady_deltas_per_s']:8.1f} "
              f"tok/s ({r['steady_step_ms']:.2f} ms per step, {r['steady_window_s']:.2f} s)", flush=True)
    if a.reuse_tokens > 0:
        r = reuse(a.url, int(a.reuse_tokens * wpt), a.max_tokens, a.seed + 999)
        out["reuse"] = r
        print(f"prefix reuse: cold {r['cold_prompt_tokens']} tok ttft {r['cold_ttft_s']*1e3:.1f} ms; second turn "
              f"{r['second_turn_prompt_tokens']} tok ({r['second_turn_cached_tokens']} cached) ttft "
              f"{r['second_turn_ttft_s']*1e3:.1f} ms; ratio {r['ttft_ratio_cold_over_second']:.1f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
