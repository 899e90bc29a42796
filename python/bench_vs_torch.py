#!/usr/bin/env python3
"""Times kvcompress.compress("snapkv") against SnapKV written in PyTorch (CPU) the way kvpress computes
it, on the same arrays, with 1 and 2 threads each.

The PyTorch version: repeat_kv (the keys of each KV head repeated for its G query heads), attention of
the last W queries over all n keys (causal inside the window), float32 softmax, mean over the window,
avg_pool1d with kernel 5, mean over the group, the window itself kept (its scores padded with the
maximum), top-k, gather of the kept keys and values. kvcompress's SnapKV makes the same selection
(sinks 0, recent 32 = W, pool 5; its tie-breaking and the order of the kept entries differ). Both
sides produce contiguous compressed keys and values; the kvcompress time includes making those numpy
arrays. "its product" is torch's Q·Kᵀ over the repeated keys alone, the one step both sides share.

    PYTHONPATH=build/python python3 python/bench_vs_torch.py            # Llama-3.1-8B layer, n = 32768
    PYTHONPATH=build/python python3 python/bench_vs_torch.py --n 4096 --repeats 3
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

import kvcompress


def snapkv_torch(torch, keys, values, queries, ratio, kernel=5):
    """SnapKV as kvpress computes it; keys, values [1][Hkv][n][d], queries [1][Hq][W][d]."""
    F = torch.nn.functional
    _, hkv, n, d = keys.shape
    hq, w = queries.shape[1], queries.shape[2]
    group = hq // hkv
    # repeat_kv: [1][Hkv][n][d] -> [1][Hq][n][d]
    key_states = keys[:, :, None].expand(1, hkv, group, n, d).reshape(1, hq, n, d)
    logits = torch.matmul(queries, key_states.transpose(2, 3)) / math.sqrt(d)  # [1][Hq][W][n]
    causal = torch.full((w, w), float("-inf")).triu(1)
    logits[..., -w:] += causal
    attn = F.softmax(logits, dim=-1, dtype=torch.float32)
    scores = attn[..., :-w].mean(dim=-2)  # [1][Hq][n - W]
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(1, hkv, group, n - w).mean(dim=2)  # [1][Hkv][n - W]
    scores = F.pad(scores, (0, w), value=scores.max().item())  # the window is always kept
    kept = int(n * ratio)
    positions = scores.topk(kept, dim=-1).indices
    index = positions.unsqueeze(-1).expand(-1, -1, -1, d)
    return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous(), positions


def blas_in_use():
    """The BLAS library this process loaded (torch's), and OpenBLAS's kernel choice when it is OpenBLAS:
    the comparison depends on both (Debian's reference BLAS is several times slower; an OpenBLAS that
    does not know the CPU falls back to slower kernels)."""
    import ctypes
    import os
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "blas" in os.path.basename(path):
                paths.add(os.path.realpath(path))
    if not paths:
        return "no BLAS library loaded"
    names = []
    for path in sorted(paths):
        name = path
        if "openblas" in path:
            try:
                lib = ctypes.CDLL(path)
                lib.openblas_get_corename.restype = ctypes.c_char_p
                name += f" (OpenBLAS kernels: {lib.openblas_get_corename().decode()})"
            except (OSError, AttributeError):
                pass
        names.append(name)
    return ", ".join(names)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def snapkv_kvcompress(keys, values, queries, ratio, threads):
    r = kvcompress.compress(keys, values, queries, "snapkv", ratio=ratio, threads=threads)
    return r.keys, r.values


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--w", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each side's timed ones")
    a = p.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_vs_torch: torch is not installed (Debian: apt-get install python3-torch)", file=sys.stderr)
        return 2

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((a.hkv, a.n, a.d), dtype=np.float32)
    values = rng.standard_normal((a.hkv, a.n, a.d), dtype=np.float32)
    queries = rng.standard_normal((a.hq, a.w, a.d), dtype=np.float32)
    tk, tv, tq = (torch.from_numpy(x)[None] for x in (keys, values, queries))  # the same memory

    # The two make the same selection (up to ties): compare the kept position sets of one head.
    with torch.no_grad():
        _, _, positions = snapkv_torch(torch, tk, tv, tq, a.ratio)
    r = kvcompress.compress(keys, values, queries, "snapkv", ratio=a.ratio)
    agree = len(set(positions[0, 0].tolist()) & set(r.positions[0].tolist())) / r.lengths[0]

    print(f"SnapKV, Hkv {a.hkv}, Hq {a.hq}, d {a.d}, W {a.w}, n {a.n}, ratio {a.ratio}; "
          f"kvcompress {kvcompress.__version__}, torch {torch.__version__}; median of {a.repeats} calls after {a.warmup} untimed")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical; BLAS: {blas_in_use()}")
    print(f"kept positions in common (head 0): {agree:.3f}")
    print(f"{'threads':>7}  {'torch (ms)':>10}  {'its product (ms)':>16}  {'kvcompress (ms)':>15}  {'speed-up':>8}")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        with torch.no_grad():
            for _ in range(a.warmup):
                snapkv_torch(torch, tk, tv, tq, a.ratio)
            t_torch = median_seconds(lambda: snapkv_torch(torch, tk, tv, tq, a.ratio), a.repeats)
            key_states = tk[:, :, None].expand(1, a.hkv, a.hq // a.hkv, a.n, a.d).reshape(1, a.hq, a.n, a.d)
            t_product = median_seconds(lambda: torch.matmul(tq, key_states.transpose(2, 3)), a.repeats)
            del key_states
        for _ in range(a.warmup):
            snapkv_kvcompress(keys, values, queries, a.ratio, threads)
        t_kvc = median_seconds(lambda: snapkv_kvcompress(keys, values, queries, a.ratio, threads), a.repeats)
        print(f"{threads:>7}  {1e3 * t_torch:>10.1f}  {1e3 * t_product:>16.1f}  {1e3 * t_kvc:>15.1f}  "
              f"{t_torch / t_kvc:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
