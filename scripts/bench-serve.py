#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (pagoda serve, llama-cpp-python's server, vLLM).

C concurrent clients each send R streaming /v1/completions requests back to back (greedy, a fixed
max_tokens, prompts from a fixed list), and the run reports output tokens/s over the whole run and
the mean and p50/p90 time to first token (first chunk carrying text). Output tokens are counted as
streamed chunks with text (one token each in both servers), and checked against `usage` where the
server sends it.

    python scripts/bench-serve.py --base-url http://127.0.0.1:8000/v1 --model M --concurrency 16

Needs the `openai` package (tests/server_openai_python.rs makes a venv with it under
~/.cache/pagoda/venv-openai).
"""

import argparse
import asyncio
import json
import statistics
import time

import openai

TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "the last day of summer in a small village",
    "a dragon who is afraid of heights",
    "two friends crossing a desert",
    "a detective in a city of clocks",
    "a child who can talk to trees",
    "a ship lost in the fog",
]


def prompt(i):
    return f"Here is a long story about {TOPICS[i % len(TOPICS)]}.\n\nOnce upon a time,"


async def one_request(client, args, i, results):
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    stream = await client.completions.create(
        model=args.model,
        prompt=prompt(i),
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True} if args.usage else None,
    )
    async for c in stream:
        if c.choices and c.choices[0].text:
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
        if getattr(c, "usage", None):
            usage = c.usage.completion_tokens
    results.append(
        {"ttft": ttft, "chunks": chunks, "usage": usage, "e2e": time.perf_counter() - t0}
    )


async def client_loop(client, args, c, results):
    for r in range(args.rounds):
        await one_request(client, args, c * args.rounds + r, results)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--usage", action="store_true", help="ask for stream_options.include_usage")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    client = openai.AsyncOpenAI(
        base_url=args.base_url, api_key="none", timeout=3600, max_retries=0
    )
    # Warm-up (first-request costs stay out of the numbers).
    await one_request(client, args, 0, [])
    results = []
    t0 = time.perf_counter()
    await asyncio.gather(
        *(client_loop(client, args, c, results) for c in range(args.concurrency))
    )
    wall = time.perf_counter() - t0
    tokens = sum(r["chunks"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) >= 2 else [float("nan")] * 9
    report = {
        "label": args.label,
        "concurrency": args.concurrency,
        "requests": len(results),
        "max_tokens": args.max_tokens,
        "output_tokens": tokens,
        "usage_tokens": sum(r["usage"] for r in results if r["usage"] is not None) or None,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "mean_ttft_s": round(statistics.mean(ttfts), 3) if ttfts else None,
        "p50_ttft_s": round(q[4], 3),
        "p90_ttft_s": round(q[8], 3),
        "mean_e2e_s": round(statistics.mean(r["e2e"] for r in results), 3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
