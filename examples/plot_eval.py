#!/usr/bin/env python3
"""Quality against ratio for each method, from the JSON of `kvcompress eval --json`.

The recall task (`--task recall`) plots exact-match accuracy, one panel per setting, with the full
cache as a dashed line; the TinyStories protocol plots KL(full || compressed). The bands are the
eval's bootstrap 95% intervals.

  kvcompress eval --task recall --json > recall.json && python3 examples/plot_eval.py recall.json -o recall.png
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def load(path):
    with open(path) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"{path}: expected the non-empty JSON list that kvcompress eval --json writes")
    return rows


def plot(rows, out, title):
    recall = rows[0].get("task") == "recall"
    metric = "accuracy" if recall else "kl"
    settings = sorted({r.get("setting", "") for r in rows}, key=lambda s: (s != "question-last", s))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4.0), squeeze=False, sharey=True)
    methods = []
    for r in rows:
        if r["method"] != "full" and r["method"] not in methods:
            methods.append(r["method"])
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for ax, setting in zip(axes[0], settings):
        here = [r for r in rows if r.get("setting", "") == setting]
        for m in methods:
            pts = sorted((r["ratio"], r[metric]) for r in here if r["method"] == m)
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1]["mean"] for p in pts], "o-", color=colors[m], label=m, lw=1.6, ms=4)
            ax.fill_between(x, [p[1]["lo"] for p in pts], [p[1]["hi"] for p in pts], color=colors[m], alpha=0.15, lw=0)
        full = [r for r in here if r["method"] == "full"]
        if full:
            ax.axhline(full[0][metric]["mean"], color="black", ls="--", lw=1, label="full cache")
        ax.set_xscale("log")
        ratios = sorted({r["ratio"] for r in here if r["method"] != "full"})
        ax.set_xticks(ratios)
        ax.set_xticklabels([f"{x:g}" for x in ratios])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if recall:
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("ratio (entries kept / entries)")
        ax.set_title(setting or title)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact-match accuracy" if recall else "KL(full || compressed), nats")
    if not recall:
        axes[0][0].set_yscale("log")
    axes[0][-1].legend(fontsize=8, loc="lower right" if recall else "upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="output of kvcompress eval --json")
    ap.add_argument("-o", "--out", required=True, help="image to write (PNG)")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    plot(load(args.json), args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
