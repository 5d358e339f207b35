#!/usr/bin/env python3
"""Load measurements of a running `ridgefill serve` (Python stdlib only), for docs/BENCHMARKS.md.

  serve_load.py URL streams   [--tokens N] [--clients 1,8] [--temperature T]
      aggregate decode tokens/s of N concurrent streamed requests, against one stream
  serve_load.py URL longprompt [--prompt-tokens 4096] [--streams 4]
      a long prompt arrives while STREAMS streams decode: their longest pause between tokens
  serve_load.py URL ttft [--prompt-tokens 8192] [--batch 4]
      time to first token of BATCH simultaneous long prompts, with and without skip-and-fill
  serve_load.py URL chat [--doc FILE] [--turns 6] [--tokens 32] [--think S] [--plain]
      a chat about a document, one question a turn: each turn's time to first token (as the
      client sees it) with prefix reuse on and off, full and skip-and-fill, beside a cold
      prefill of only that turn's new text; --think pauses S seconds before each later turn
      (a user reading and typing: an idle ridgefill server settles filled rows meanwhile)

URL is the server's base, e.g. http://127.0.0.1:8080. Requests use ignore_eos so every stream
generates exactly --tokens tokens."""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def events(url, path, body):
    """POSTs a streamed request to path; yields each server-sent chunk as JSON."""
    req = urllib.request.Request(
        url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            yield chunk


def stream(url, body, out):
    """POSTs a streamed completion; appends (time, text) per chunk to out; returns usage."""
    usage = None
    for chunk in events(url, "/v1/completions", body):
        text = chunk["choices"][0].get("text", "")
        if text:
            out.append((time.perf_counter(), text))
        usage = chunk.get("usage") or usage
    return usage


def run_parallel(url, bodies):
    """Runs the requests at once; returns per request (chunk times, usage)."""
    results = [None] * len(bodies)

    def one(i):
        times = []
        usage = stream(url, bodies[i], times)
        results[i] = (times, usage)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def filler(n_words, seed):
    words = "the river ran past an old mill where seven workers kept the stones turning".split()
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n_words))


def streams(a):
    rows = []
    for clients in [int(c) for c in a.clients.split(",")]:
        bodies = [
            {"prompt": f"Story {i}: " + filler(40, i), "max_tokens": a.tokens, "temperature": a.temperature,
             "seed": i, "ignore_eos": True}
            for i in range(clients)
        ]
        res = run_parallel(a.url, bodies)
        # Decode phase: from the last first token to the last token, tokens after each first.
        start = max(r[0][0][0] for r in res)
        end = max(r[0][-1][0] for r in res)
        tokens = sum(sum(1 for t, _ in r[0] if t > start) for r in res)
        agg = tokens / (end - start)
        rows.append((clients, agg))
        print(f"{clients} streams x {a.tokens} tokens: aggregate decode {agg:.1f} tok/s")
    if len(rows) > 1:
        print(f"ratio {rows[-1][0]} streams / {rows[0][0]}: {rows[-1][1] / rows[0][1]:.2f}x")


def longprompt(a):
    bodies = [
        {"prompt": f"Note {i}: " + filler(30, i), "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True}
        for i in range(a.streams)
    ]
    results = [None] * a.streams
    threads = []
    for i in range(a.streams):
        def one(i=i):
            times = []
            stream(a.url, bodies[i], times)
            results[i] = times
        threads.append(threading.Thread(target=one))
        threads[-1].start()
    time.sleep(a.delay)
    # Words of the filler are about one token each.
    long_body = {"prompt": filler(a.prompt_tokens, 3), "max_tokens": 4, "temperature": 0, "fill": not a.no_fill}
    t0 = time.perf_counter()
    lt = []
    usage = stream(a.url, long_body, lt)
    t1 = time.perf_counter()
    for t in threads:
        t.join()
    gaps = []
    for times in results:
        during = [t for t, _ in times if t0 - 1 <= t <= t1 + 1]
        gaps += [b - a_ for a_, b in zip(during, during[1:])]
    all_gaps = [b - a_ for times in results for a_, b in zip([t for t, _ in times], [t for t, _ in times][1:])]
    print(f"long prompt: {usage['prompt_tokens']} tokens, fill {usage['fill']}, prefill {usage['prefill_ms']:.0f} ms, TTFT {usage['ttft_ms']:.0f} ms")
    print(f"{a.streams} streams: median gap {1e3 * statistics.median(all_gaps):.1f} ms, "
          f"longest gap while it prefilled {1e3 * max(gaps):.1f} ms")


def ttft(a):
    for fill in [False, True]:
        bodies = [
            {"prompt": filler(a.prompt_tokens, i), "max_tokens": 1, "temperature": 0, "fill": fill}
            for i in range(a.batch)
        ]
        res = run_parallel(a.url, bodies)
        t = [r[1]["ttft_ms"] for r in res]
        used = all(r[1]["fill"] for r in res)
        print(f"fill {fill} (ran: {used}): batch {a.batch} x {res[0][1]['prompt_tokens']} tokens: "
              f"TTFT mean {statistics.mean(t):.0f} ms, last {max(t):.0f} ms")


def chat_stream(url, body):
    """POSTs a streamed chat completion; returns (seconds to the first content, text, usage)."""
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    for chunk in events(url, "/v1/chat/completions", body):
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter() - t0
            text += chunk["choices"][0]["delta"]["content"]
        usage = chunk.get("usage") or usage
    return (first or time.perf_counter() - t0), text, usage


QUESTIONS = [
    "What is this document about?",
    "Who are the people it names?",
    "Summarise its second paragraph.",
    "What happens at the end?",
    "Which places does it mention?",
    "What is the most surprising detail?",
    "Give it a short title.",
    "What would you ask its author?",
]


def chat_plain(a, doc):
    """The same conversation against any OpenAI-compatible server (llama-server, llama-cpp-python),
    with only the standard fields and `cache_prompt` (llama-server's; others ignore it)."""
    msgs = [{"role": "user", "content": doc + "\n\n" + QUESTIONS[0]}]
    print("| turn | prompt tokens | time to first token | cached tokens |")
    print("|---:|---:|---:|---:|")
    for k in range(a.turns):
        body = {"messages": msgs, "max_tokens": a.tokens, "temperature": 0, "cache_prompt": True}
        t, text, u = chat_stream(a.url, body)
        u = u or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", "—")
        print(f"| {k + 1} | {u.get('prompt_tokens', '—')} | {1e3 * t:.0f} ms | {cached} |")
        msgs = msgs + [{"role": "assistant", "content": text},
                       {"role": "user", "content": QUESTIONS[(k + 1) % len(QUESTIONS)]}]
        time.sleep(a.think)


def chat(a):
    doc = open(a.doc, encoding="utf-8").read()
    if a.plain:
        return chat_plain(a, doc)
    runs = {}
    for fill in [False, True]:
        for reuse in [True, False]:
            # A tag of its own, so no conversation reuses another's cache.
            tag = f"Conversation {len(runs) + 1}.\n\n"
            msgs = [{"role": "user", "content": tag + doc + "\n\n" + QUESTIONS[0]}]
            rows = []
            for k in range(a.turns):
                body = {"messages": msgs, "max_tokens": a.tokens, "temperature": 0,
                        "fill": fill, "cache_prompt": reuse}
                t, text, u = chat_stream(a.url, body)
                restored = (u.get("fill_report") or {}).get("restored_rows")
                rows.append((t, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                             restored))
                msgs = msgs + [{"role": "assistant", "content": text},
                               {"role": "user", "content": QUESTIONS[(k + 1) % len(QUESTIONS)]}]
                time.sleep(a.think)
            runs[(fill, reuse)] = rows
    # A cold prefill of each turn's new tokens alone: the turn's question (after the first turn,
    # the previous reply and the question) as a fresh conversation.
    cold = [None]
    for k in range(1, a.turns):
        body = {"messages": [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                "max_tokens": a.tokens, "temperature": 0, "fill": False, "cache_prompt": False}
        cold.append(chat_stream(a.url, body)[0])
    print("| turn | prompt tokens | full, reuse | full, no reuse | fill, reuse | fill, no reuse | cold prefill of the new tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for k in range(a.turns):
        cells = []
        for key in [(False, True), (False, False), (True, True), (True, False)]:
            t, n, c, r = runs[key][k]
            more = f", {r} restored" if r else ""
            cells.append(f"{1e3 * t:.0f} ms ({c} cached{more})")
        c = "—" if cold[k] is None else f"{1e3 * cold[k]:.0f} ms"
        print(f"| {k + 1} | {runs[(False, True)][k][1]} | " + " | ".join(cells) + f" | {c} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("mode", choices=["streams", "longprompt", "ttft", "chat"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--clients", default="1,8")
    p.add_argument("--temperature", type=float, default=0.0, help="streams: sampling temperature (0: greedy)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--delay", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--no-fill", action="store_true", help="longprompt: full prefill for the long prompt")
    p.add_argument("--doc", default="data/answers/prose/verne-80-days-ch3.txt", help="chat: the document")
    p.add_argument("--turns", type=int, default=6, help="chat: questions about the document")
    p.add_argument("--think", type=float, default=0.0,
                   help="chat: seconds between a reply and the next question")
    p.add_argument("--plain", action="store_true",
                   help="chat: another OpenAI-compatible server (llama-server): standard fields only, one conversation")
    a = p.parse_args()
    {"streams": streams, "longprompt": longprompt, "ttft": ttft, "chat": chat}[a.mode](a)


if __name__ == "__main__":
    main()
