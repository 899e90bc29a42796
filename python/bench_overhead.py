#!/usr/bin/env python3
"""What a Python call adds to the library call it makes: kvcompress.compress timed from Python against
the C++ run(layer, budget) inside the same call (timed in C++ around the library call alone), at the
benchmark's layer (Llama-3.1-8B: Hkv 8, Hq 32, d 128, W 32, n 32768, ratio 0.25). The difference is
the binding: input checks, options, the result object. Making the keys and values arrays (a copy of
the kept entries, done on first access) is timed separately.

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
    print(f"n {a.n}, medians of {a.repeats} calls (ms)")
    print(f"{'method':>8}  {'C++ call':>8}  {'Python call':>11}  {'ratio':>6}  {'+ keys, values arrays':>21}")
    for method in a.methods.split(","):
        kvcompress._compress_timed(keys, values, queries, method)  # warm-up
        inner, outer, arrays = [], [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            r, seconds = kvcompress._compress_timed(keys, values, queries, method)
            t1 = time.perf_counter()
            r.keys, r.values
            t2 = time.perf_counter()
            inner.append(seconds)
            outer.append(t1 - t0)
            arrays.append(t2 - t1)
        ratio = statistics.median(o / i for o, i in zip(outer, inner))
        print(f"{method:>8}  {1e3 * statistics.median(inner):>8.1f}  {1e3 * statistics.median(outer):>11.1f}  "
              f"{ratio:>6.3f}  {1e3 * statistics.median(arrays):>21.1f}")


if __name__ == "__main__":
    main()
