#!/usr/bin/env python3
"""Follow-up questions about real documents through `ridgefill serve`, the history fixed.

  followups.py URL OUT.json [--full] [--ref REF.json]   ask, write every turn's answer
  followups.py --compare REF.json RUN.json [RUN.json…]  agreement with REF, by share

Every document of `data/answers/questions.toml` gets two conversations: its own fact questions
(the first with the document pasted, as `eval --task answers` asks it) and the six broad
questions of `serve_load.py chat`, 40 tokens greedy, `cache_prompt` on. With `--ref` (the
`--full` run's output) each later turn's history holds the reference's replies, not the run's
own, so two runs differ only in what their caches hold. `--full` sends `"fill": false`. Each
turn records `usage.fill_report.filled_attention` (the share of the question's attention on
rows still filled) and `restored_rows`. `--compare` prints ROUGE-L (word LCS F1), identical
answers and identical first sentences against REF, over all follow-ups and by share.
Run the server with `--no-settle`, so that every follow-up meets the rows its first turn filled.
"""
import argparse
import json
import re
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROAD = ["What is this document about?", "Who are the people it names?",
         "Summarise its second paragraph.", "What happens at the end?",
         "Which places does it mention?", "What is the most surprising detail?"]


def conversations():
    d = tomllib.loads((ROOT / "data/answers/questions.toml").read_text())
    for doc in d["document"]:
        text = (ROOT / "data/answers" / doc["file"]).read_text()
        yield "facts", doc["file"], text, [q["ask"] for q in doc["question"]]
        yield "broad", doc["file"], text, BROAD


def post(url, msgs, full):
    body = {"messages": msgs, "max_tokens": 40, "temperature": 0, "cache_prompt": True}
    if full:
        body["fill"] = False
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def ask(a):
    ref = json.loads(Path(a.ref).read_text()) if a.ref else None
    out = []
    for ci, (kind, f, text, qs) in enumerate(conversations()):
        msgs, turns = [{"role": "user", "content": text + "\n\n" + qs[0]}], []
        for k, q in enumerate(qs):
            if k > 0:
                prev = (ref[ci]["turns"] if ref else turns)[k - 1]["text"]
                msgs += [{"role": "assistant", "content": prev}, {"role": "user", "content": q}]
            t = time.time()
            r = post(a.url, msgs, a.full)
            u, fr = r["usage"], r["usage"].get("fill_report") or {}
            turns.append({"q": q, "text": r["choices"][0]["message"]["content"],
                          "secs": time.time() - t, "prompt": u.get("prompt_tokens"),
                          "filled_attention": fr.get("filled_attention"),
                          "restored": fr.get("restored_rows")})
            print(kind, f, k, f"{turns[-1]['secs']:.2f}s", fr.get("filled_attention"),
                  fr.get("restored_rows"), file=sys.stderr)
        out.append({"kind": kind, "file": f, "turns": turns})
    Path(a.out).write_text(json.dumps(out, indent=1))


def rouge_l(a, b):
    a, b = a.split(), b.split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))


def first_sentence(s):
    return re.split(r"(?<=[.!?])\s", s.strip())[0]


def compare(ref_path, runs):
    ref = json.loads(Path(ref_path).read_text())
    data = {r: json.loads(Path(r).read_text()) for r in runs}
    # Follow-ups: every turn but a fact conversation's first (the cold turn).
    keys = [(ci, k) for ci, c in enumerate(ref) for k in range(len(c["turns"]))
            if not (c["kind"] == "facts" and k == 0)]
    share = {key: data[runs[0]][key[0]]["turns"][key[1]]["filled_attention"] for key in keys}
    groups = [("all follow-ups", keys),
              ("share < 5%", [k for k in keys if share[k] is not None and share[k] < 0.05]),
              ("share >= 5%", [k for k in keys if share[k] is not None and share[k] >= 0.05]),
              ("nothing filled", [k for k in keys if share[k] is None])]
    print("| follow-ups | n | " + " | ".join(f"{Path(r).stem}: ROUGE-L / same / first" for r in runs) + " |")
    print("|---|---:|" + "---:|" * len(runs))
    for name, sel in groups:
        cells = []
        for r in runs:
            got = [(data[r][ci]["turns"][k]["text"], ref[ci]["turns"][k]["text"]) for ci, k in sel]
            n = max(1, len(got))
            cells.append(f"{sum(rouge_l(g, w) for g, w in got) / n:.3f} / "
                         f"{sum(g == w for g, w in got)} / "
                         f"{sum(first_sentence(g) == first_sentence(w) for g, w in got)}")
        print(f"| {name} | {len(sel)} | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--full", action="store_true")
    p.add_argument("--ref")
    p.add_argument("--compare", nargs="+", metavar="JSON")
    a = p.parse_args()
    if a.compare:
        if len(a.compare) < 2:
            p.error("--compare needs REF.json and at least one run")
        return compare(a.compare[0], a.compare[1:])
    if not (a.url and a.out):
        p.error("give URL and OUT.json, or --compare")
    ask(a)


if __name__ == "__main__":
    main()
