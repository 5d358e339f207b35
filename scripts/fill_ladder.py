#!/usr/bin/env python3
"""Reads off the self-check ladder from one `eval --json` run, for a range of thresholds.

A ladder (`--max-fill-error E --fill-deeper B,C`) runs a prompt at the first split whose
self-check error is at most E, else exactly. Each stage computes exactly what the standalone
split computes (same exact rows, same spans, same maps), so the ladder's answer to a prompt is the
answer of the split it stops at, and one run of `eval --fill A,B,C --methods full,fill --json`
(methods `fill`, `fill@B`, `fill@C`) holds every threshold's outcome. Prefill time of a ladder
stop: that split's measured prefill time, plus for every split passed over the exact pass it
wasted (its exact rows through its upper layers, estimated as exact-row share x upper-layer share
x full prefill's time). A real ladder run checks the estimate.

With `--min-coverage C` a prompt also passes over a split that has a deeper one behind it when
its span coverage there (the spans' share of the question's attention to filled rows, reported
since the coverage check) is below C; such a prompt wastes nothing (it is sent on before the
exact pass).

Usage: python3 scripts/fill_ladder.py RUN.json [--thresholds 0.4,0.45,...] [--layers 30]
       [--min-coverage 0.5]
Works on `--task answers` (ROUGE-L against full) and `--task ruler` (RULER's score) runs.
"""
import argparse
import json
import re


def splits_of(methods, first_split):
    """Method name -> split, shallowest first: `fill` is the run's first file."""
    out = []
    for m in methods:
        if m == "fill":
            out.append((first_split, m))
        elif (g := re.fullmatch(r"fill@(\d+)", m)):
            out.append((int(g.group(1)), m))
    return sorted(out)


def items(run):
    """Per prompt: {method: (quality, prefill_secs, report, prompt_tokens)}, and a label."""
    if run.get("task") == "answers":
        for q in run["answers"]:
            yield q["kind"], {
                m: (a["rouge_l"], a["prefill_secs"], a.get("fill"), q["prompt_tokens"])
                for m, a in q["answers"].items()
            }
        return
    by_key = {}
    for row in run["results"]:
        for i, a in enumerate(row["answers"]):
            key = (row["task"], row["length"], i)
            by_key.setdefault(key, {})[row["method"]] = (
                a["score"],
                a["prefill_secs"],
                a.get("fill"),
                a["prompt_tokens"],
            )
    for (task, length, _), per in sorted(by_key.items()):
        yield f"{task}@{length}", per


def waste(report, tokens, split, layers, full_secs):
    """Estimated seconds a passed-over split spent on its exact pass."""
    if not report or not tokens:
        return 0.0
    exact = (tokens - report["filled"]) / tokens
    return exact * (layers - split) / layers * full_secs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--thresholds", default="0.35,0.4,0.45,0.5,0.55,0.6,0.7,inf")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--min-coverage", type=float, default=0.0)
    a = p.parse_args()
    run = json.load(open(a.run))
    prompts = list(items(run))
    methods = prompts[0][1].keys()
    ladder = splits_of(methods, run["split"])
    print(f"{len(prompts)} prompts; ladder {' -> '.join(str(s) for s, _ in ladder)} -> exact")
    print()
    if a.min_coverage > 0:
        print(f"--min-coverage {a.min_coverage} before every split but the last")
        print()
    print("| --max-fill-error | quality | prefill speed-up | stops at " +
          " / ".join(f"s{s}" for s, _ in ladder) + " / exact |")
    print("|---:|---:|---:|---:|")
    for t in [float(x) for x in a.thresholds.split(",")]:
        quality, secs, full_secs = 0.0, 0.0, 0.0
        stops = [0] * (len(ladder) + 1)
        for _, per in prompts:
            fq, fs, _, tokens = per["full"]
            full_secs += fs
            spent = 0.0
            for k, (split, m) in enumerate(ladder):
                q, s, rep, _ = per[m]
                cov = rep.get("coverage") if rep else None
                broad = k + 1 < len(ladder) and cov is not None and cov < a.min_coverage
                if broad:
                    continue
                err = rep["error"] if rep and rep["error"] is not None else 0.0
                if err <= t:
                    quality += q
                    secs += spent + s
                    stops[k] += 1
                    break
                spent += waste(rep, tokens, split, a.layers, fs)
            else:
                quality += fq
                secs += spent + fs
                stops[-1] += 1
        n = len(prompts)
        print(f"| {t} | {quality / n:.3f} | {full_secs / secs:.2f}x | " +
              " / ".join(str(c) for c in stops) + " |")
    print()
    print("Per split alone:")
    for split, m in ladder:
        q = sum(per[m][0] for _, per in prompts) / len(prompts)
        s = sum(per[m][1] for _, per in prompts)
        f = sum(per["full"][1] for _, per in prompts)
        errs = sorted(per[m][2]["error"] for _, per in prompts if per[m][2] and per[m][2]["error"] is not None)
        med = errs[len(errs) // 2] if errs else float("nan")
        print(f"  s{split}: quality {q:.3f}, speed-up {f / s:.2f}x, median self-check error {med:.3f}")


if __name__ == "__main__":
    main()
