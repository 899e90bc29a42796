#!/usr/bin/env python3
"""What a Python call costs against the C++ call it stands for, at the benchmark's layer (Llama-3.1-8B:
Hkv 8, Hq 32, d 128, W 32, n 32768, ratio 0.25): kvcompress.compress timed from Python, its keys and
values arrays included, against the library's one-shot run(layer, budget) timed in C++ around the
library call alone, in the same process, alternately. compress reuses its per-thread result rows and
workspace from call to call (the library call inside it, run(layer, budget, out, ws), is shown too),
so its only new memory is the numpy arrays; the one-shot C++ call returns its result in new memory.

    PYTHONPATH=build/python python3 python/bench_overhead.py [--n 32768] [--repeats 9]
"""
import argparse
import statistics
import time

import numpy as np

import kvcompress


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--methods", default="snapkv,selkv")
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((8, a.n, 128), dtype=np.float32)
    values = rng.standard_normal((8, a.n, 128), dtype=np.float32)
    queries = rng.standard_normal((32, 32, 128), dtype=np.float32)
    print(f"n {a.n}, medians of {a.repeats} calls of each, alternately (ms)")
    print(f"{'method':>8}  {'C++ one-shot':>12}  {'Python compress':>15}  {'ratio':>6}  {'library call inside':>19}")
    for method in a.methods.split(","):
        kvcompress._compress_timed(keys, values, queries, method, one_shot=True)  # warm-up
        kvcompress._compress_timed(keys, values, queries, method)
        cpp, outer, inner = [], [], []
        for _ in range(a.repeats):
            r, seconds = kvcompress._compress_timed(keys, values, queries, method, one_shot=True)
            r.keys, r.values
            del r
            cpp.append(seconds)
            t0 = time.perf_counter()
            r, seconds = kvcompress._compress_timed(keys, values, queries, method)
            r.keys, r.values
            outer.append(time.perf_counter() - t0)
            inner.append(seconds)
            del r
        ratio = statistics.median(o / c for o, c in zip(outer, cpp))
        print(f"{method:>8}  {1e3 * statistics.median(cpp):>12.1f}  {1e3 * statistics.median(outer):>15.1f}  "
              f"{ratio:>6.3f}  {1e3 * statistics.median(inner):>19.1f}")


if __name__ == "__main__":
    main()
