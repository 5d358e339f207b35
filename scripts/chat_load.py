#!/usr/bin/env python3
"""Time to first token per turn of `ridgefill chat` (Python stdlib only), for docs/prefix-reuse.md.

  chat_load.py [--bin PATH] [--doc FILE] [--turns 6] [--tokens 32] [--think S] -- CHAT_ARGS...

Pastes the document (on one line) with the first question, then asks one question a turn,
waiting for each reply and then --think seconds (a user reading and typing: chat settles the
turn's filled rows meanwhile). Each turn's time is chat's own, from reading the message to the
logits of the reply's first token (its RIDGEFILL_CHAT_VERBOSE line); the table adds its prompt,
reused, filled and restored rows. CHAT_ARGS go to `ridgefill chat` (-m, --fill, ...)."""
import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import QUESTIONS  # noqa: E402

TURN = re.compile(r"chat: prompt (\d+) tokens, (\d+) reused from the cache, (\d+) prefilled"
                  r"(?:, (\d+) filled, (\d+) restored)?, (\d+) ms")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/ridgefill")
    p.add_argument("--doc", default="data/answers/prose/verne-80-days-ch3.txt")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--think", type=float, default=0.0)
    p.add_argument("chat_args", nargs="*")
    a = p.parse_args()
    doc = " ".join(open(a.doc, encoding="utf-8").read().split())
    env = {**os.environ, "RIDGEFILL_CHAT_VERBOSE": "1"}
    chat = subprocess.Popen(
        [a.bin, "chat", "-n", str(a.tokens), "--temp", "0", "-c", "8192", *a.chat_args],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=env)
    print("| turn | prompt tokens | reused | filled | restored | time to first token |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in range(a.turns):
        q = QUESTIONS[k % len(QUESTIONS)]
        chat.stdin.write((doc + " " + q if k == 0 else q) + "\n")
        chat.stdin.flush()
        for line in chat.stderr:
            m = TURN.match(line)
            if m:
                break
        else:
            sys.exit(f"chat ended early: {chat.wait()}")
        for line in chat.stderr:  # the reply is done
            if line.startswith("chat: reply "):
                break
        prompt, reused, _, filled, restored, ms = m.groups()
        print(f"| {k + 1} | {prompt} | {reused} | {filled or '—'} | {restored or '—'} | {ms} ms |",
              flush=True)
        time.sleep(a.think)
    chat.stdin.close()
    chat.wait()


if __name__ == "__main__":
    main()
