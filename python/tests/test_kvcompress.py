"""Tests of the kvcompress Python module: bit-for-bit equality with the kvcompress tool on the same .npy
files, strided and float16 inputs read in place, the Compressor, decode_attention, and every error path.

Run by ctest (python_tests) with PYTHONPATH=<build>/python and KVC_TOOL=<build>/examples/kvcompress."""
import math
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import kvcompress as kc

TOOL = os.environ.get("KVC_TOOL")
HKV, HQ, N, D, W = 2, 4, 300, 32, 16


def layer(seed=0, hkv=HKV, hq=HQ, n=N, d=D, w=W, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((hkv, n, d), dtype=np.float32)
    v = rng.standard_normal((hkv, n, d), dtype=np.float32)
    q = rng.standard_normal((hq, w, d), dtype=np.float32)
    return k.astype(dtype), v.astype(dtype), q.astype(dtype)


def output_projection(seed=0, dim=24, dtype=np.float32):
    """A layer's W_o [dim][HQ * D]."""
    return np.random.default_rng(seed + 100).standard_normal((dim, HQ * D), dtype=np.float32).astype(dtype)


def bits(a):
    """The array's bit patterns, so that equality is exact (also for -0.0 and NaN)."""
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 8: np.uint64}[a.dtype.itemsize])


def same(r1, r2):
    np.testing.assert_array_equal(r1.lengths, r2.lengths)
    np.testing.assert_array_equal(r1.positions, r2.positions)
    for f in ("keys", "values", "bias"):
        np.testing.assert_array_equal(bits(getattr(r1, f)), bits(getattr(r2, f)), err_msg=f)
    assert r1.next_position == r2.next_position


def cli(tmp_path, k, v, q, method, ratio=None, budget=None, wo=None, **options):
    """The tool's `compress` on the same arrays saved as .npy: positions, keys, values, bias."""
    if TOOL is None:
        pytest.skip("KVC_TOOL is not set (ctest sets it to the kvcompress tool)")
    for name, a in (("K", k), ("V", v), ("Q", q)):
        np.save(tmp_path / f"{name}.npy", a)
    args = [TOOL, "compress", "--keys", str(tmp_path / "K.npy"), "--values", str(tmp_path / "V.npy"),
            "--queries", str(tmp_path / "Q.npy"), "--method", method, "--out", str(tmp_path / "out")]
    if wo is not None:
        np.save(tmp_path / "Wo.npy", wo)
        args += ["--wo", str(tmp_path / "Wo.npy")]
    if ratio is not None:
        args += ["--ratio", repr(ratio)]
    if budget is not None:
        args += ["--budget", str(budget)]
    for key, value in options.items():
        flag = "--" + key.rstrip("_").replace("_", "-")
        args.append(f"{flag}={'on' if value else 'off'}" if isinstance(value, bool) else f"{flag}={value}")
    subprocess.run(args, check=True, capture_output=True)
    return [np.load(tmp_path / "out" / f"{f}.npy") for f in ("positions", "keys", "values", "bias")]


def assert_equals_cli(r, expected):
    pos, keys, values, bias = expected
    assert pos.dtype == np.int32 and r.positions.dtype == np.int64
    np.testing.assert_array_equal(r.positions, pos)
    np.testing.assert_array_equal(bits(r.keys), bits(keys))
    np.testing.assert_array_equal(bits(r.values), bits(values))
    np.testing.assert_array_equal(bits(r.bias), bits(bias))


# ---- equal to the tool -----------------------------------------------------------------------------

@pytest.mark.parametrize("method", kc.methods)
def test_every_method_equals_the_tool(tmp_path, method):
    k, v, q = layer(1, w=N if method == "observed-attention" else W)  # H2O reads every prefill query
    wo = output_projection(1) if method.startswith("critical") else None  # CriticalKV reads W_o
    r = kc.compress(k, v, q, method, ratio=0.25, wo=wo)
    assert_equals_cli(r, cli(tmp_path, k, v, q, method, ratio=0.25, wo=wo))
    m = N if method == "full" else int(0.25 * N)
    np.testing.assert_array_equal(r.lengths, np.load(tmp_path / "out" / "lengths.npy"))
    if method.startswith("adakv") or method == "critical-adakv":  # ragged: HKV * m entries in all
        assert r.lengths.sum() == HKV * m and r.lengths.min() >= 1
        m = r.lengths.max()
    elif method == "threshold":  # ragged: the count is the outcome, capped by m
        assert r.lengths.max() <= m and r.lengths.min() >= 1
        m = r.lengths.max()
    else:
        np.testing.assert_array_equal(r.lengths, [m] * HKV)
    assert r.positions.shape == (HKV, m) and r.keys.shape == (HKV, m, D) and r.bias.shape == (HKV, m)
    assert set(r.diagnostics) >= {"kept", "evicted", "merged", "dropped", "gate_mean", "cg_status"}
    np.testing.assert_array_equal(r.diagnostics["kept"], r.lengths)


OPTIONED = [
    ("streaming", dict(sinks=8), 0.1),
    ("snapkv", dict(pool=7, recent=8, pooling="max", selection="shared"), 0.3),
    ("knorm", dict(recent=4, sinks=2), 0.5),
    ("selkv", dict(alpha=0.25, r_max=4.0, bucket=16, route="window-mass"), 0.25),
    ("selkv", dict(route="global", selection="per-head", reposition=True), 0.25),
    ("selkv-mergeall", dict(route="co-attention", pool=1), 0.2),
    ("grkv", dict(lambda_=0.1, beta=0.5, steps=3, safeguard=True), 0.25),
    ("grkv-selkv", dict(steps=1, safeguard=False), 0.4),
    ("tova", dict(merger="soft-gate", compensator="log-ratio", bucket=8), 0.25),
    ("snapkv", dict(scorer="keydiff", merger="ridge", lambda_=0.05), 0.3),
    ("expected-attention", dict(rope_base=500000.0), 0.25),
    ("snapkv", dict(reposition=True, rope_base=1e6), 0.25),
]


@pytest.mark.parametrize("method,options,ratio", OPTIONED)
def test_options_equal_the_tool(tmp_path, method, options, ratio):
    k, v, q = layer(2)
    r = kc.compress(k, v, q, method, ratio=ratio, **options)
    assert_equals_cli(r, cli(tmp_path, k, v, q, method, ratio=ratio, **options))


def test_rope_base_is_the_keys_rope():
    # Repositioning rotates the kept keys by their position change at the given base; expected-attention
    # rotates its query statistics by it: another base, other keys and other scores.
    k, v, q = layer(4)
    for method, extra in (("snapkv", dict(reposition=True)), ("expected-attention", {})):
        default = kc.compress(k, v, q, method, ratio=0.25, **extra)
        same = kc.compress(k, v, q, method, ratio=0.25, rope_base=10000.0, **extra)
        other = kc.compress(k, v, q, method, ratio=0.25, rope_base=500000.0, **extra)
        np.testing.assert_array_equal(bits(same.keys), bits(default.keys))
        assert not np.array_equal(other.keys, default.keys) or not np.array_equal(other.positions, default.positions)


@pytest.mark.parametrize("method", ["selkv", "snapkv"])
def test_merge_maps_equal_the_tools_explain(tmp_path, method):
    k, v, q = layer(3)
    r = kc.compress(k, v, q, method, ratio=0.25, record_merges=True)
    expected = cli(tmp_path, k, v, q, method, ratio=0.25)
    assert_equals_cli(r, expected)  # recording changes no result
    if TOOL is not None:
        subprocess.run([TOOL, "compress", "--keys", str(tmp_path / "K.npy"), "--values", str(tmp_path / "V.npy"),
                        "--queries", str(tmp_path / "Q.npy"), "--method", method, "--ratio", "0.25",
                        "--out", str(tmp_path / "ex"), "--explain", "0"], check=True, capture_output=True)
    m = r.merges
    for f in ("evicted", "target", "gate"):
        np.testing.assert_array_equal(m[f], np.load(tmp_path / "ex" / f"merge_{f}.npy"), err_msg=f)
    np.testing.assert_array_equal(m["count"], N - r.lengths)
    for g in range(HKV):  # evicted and kept positions partition 0..N-1
        e = m["evicted"][g][: m["count"][g]]
        assert sorted(np.concatenate([e, r.positions[g]]).tolist()) == list(range(N))
    if method == "snapkv":  # routes nothing
        assert (m["target"] == -1).all() and (m["gate"] == 0).all()
    else:
        assert (m["target"] >= 0).any()
    with pytest.raises(ValueError, match="record_merges=True"):
        kc.compress(k, v, q, method, ratio=0.25).merges
    c = kc.Compressor(method, record_merges=True)
    np.testing.assert_array_equal(c.compress(k, v, q, ratio=0.25).merges["target"], m["target"])


def test_swapped_stages_equal_the_preset_that_composes_them():
    k, v, q = layer(4)
    same(kc.compress(k, v, q, "snapkv", ratio=0.25, merger="ridge"), kc.compress(k, v, q, "grkv", ratio=0.25))
    same(kc.compress(k, v, q, "selkv-evict", ratio=0.25, merger="soft-gate", compensator="log-ratio"),
         kc.compress(k, v, q, "selkv", ratio=0.25))
    with pytest.raises(ValueError, match="--merger must be one of"):
        kc.compress(k, v, q, "snapkv", ratio=0.25, merger="nearest")


def test_options_change_the_result():
    k, v, q = layer(3)
    a = kc.compress(k, v, q, "selkv", ratio=0.25)
    b = kc.compress(k, v, q, "selkv", ratio=0.25, alpha=0.1)
    assert not np.array_equal(a.bias, b.bias)


def test_budget_in_tokens_equals_the_tool(tmp_path):
    k, v, q = layer(4)
    r = kc.compress(k, v, q, "snapkv", budget=50)
    assert_equals_cli(r, cli(tmp_path, k, v, q, "snapkv", budget=50))
    assert r.keys.shape == (HKV, 50, D)


def test_default_method_and_ratio_are_the_tools(tmp_path):
    k, v, q = layer(5)
    r = kc.compress(k, v, q)
    assert_equals_cli(r, cli(tmp_path, k, v, q, "selkv"))
    assert r.keys.shape[1] == int(0.25 * N)


def test_float16_inputs_equal_the_tool(tmp_path):
    k, v, q = layer(6, dtype=np.float16)
    for method in ("snapkv", "selkv", "grkv"):
        r = kc.compress(k, v, q, method, ratio=0.25)
        assert r.keys.dtype == np.float32
        assert_equals_cli(r, cli(tmp_path, k, v, q, method, ratio=0.25))


def test_per_head_budgets_pad_shorter_heads():
    k, v, q = layer(7)
    r = kc.compress(k, v, q, "snapkv", budget=[40, 60])
    np.testing.assert_array_equal(r.lengths, [40, 60])
    assert r.positions.shape == (2, 60)
    assert (r.positions[0, 40:] == -1).all() and (r.positions[0, :40] >= 0).all()
    assert not r.keys[0, 40:].any() and not r.bias[0, 40:].any()
    alone = kc.compress(k[1:], v[1:], q[2:], "snapkv", budget=60)
    np.testing.assert_array_equal(r.positions[1], alone.positions[0])
    r2 = kc.compress(k, v, q, "snapkv", budget=np.array([40, 60]))
    same(r, r2)


def test_threads_give_the_same_bits():
    k, v, q = layer(8, hkv=4, hq=8)
    for method in ("snapkv", "selkv", "grkv"):
        same(kc.compress(k, v, q, method, threads=1), kc.compress(k, v, q, method, threads=3))


def test_compress_timed_is_compress():
    k, v, q = layer(25)
    r, seconds = kc._compress_timed(k, v, q, "snapkv", budget=64)
    same(r, kc.compress(k, v, q, "snapkv", budget=64))
    assert 0 < seconds < 10


@pytest.mark.parametrize("method", ["snapkv", "selkv", "grkv", "adakv-selkv"])
def test_compress_equals_the_one_shot_library_call(method):
    # compress reuses its per-thread buffers; the one-shot run(layer, budget) gets new memory each time
    for seed, dtype, n in ((26, np.float32, N), (27, np.float16, 200), (28, np.float32, 2 * N)):
        k, v, q = layer(seed, n=n, dtype=dtype)
        r, seconds = kc._compress_timed(k, v, q, method, ratio=0.3, one_shot=True)
        same(r, kc.compress(k, v, q, method, ratio=0.3))
        assert 0 < seconds < 10


def test_results_of_compress_are_independent_of_later_calls():
    k, v, q = layer(29)
    r1 = kc.compress(k, v, q, "selkv", ratio=0.25)
    kept = {f: np.copy(getattr(r1, f)) for f in ("positions", "keys", "values", "bias", "lengths")}
    k2, v2, q2 = layer(30)
    r2 = kc.compress(k2, v2, q2, "selkv", ratio=0.25)  # the same shapes: the same buffers underneath
    r3 = kc.compress(*layer(31, n=2 * N), "snapkv", ratio=0.5)  # larger
    kc.release_buffers()
    r4 = kc.compress(k2, v2, q2, "selkv", ratio=0.25)  # buffers made anew
    for f, a in kept.items():
        np.testing.assert_array_equal(bits(getattr(r1, f)), bits(a), err_msg=f)
    same(r2, r4)
    assert not np.shares_memory(r1.keys, r2.keys) and not np.shares_memory(r2.values, r4.values)
    assert r3.keys.shape == (HKV, N, D)
    same(r1, kc.compress(k, v, q, "selkv", ratio=0.25))


# ---- strided inputs, read in place ----------------------------------------------------------------

def test_token_major_and_sliced_views_equal_contiguous():
    k, v, q = layer(9)
    ref = kc.compress(k, v, q, "selkv", ratio=0.25)
    # llama.cpp's [n][H][d] buffers, seen as [H][n][d]
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    vt = np.ascontiguousarray(v.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not kt.flags.c_contiguous
    same(ref, kc.compress(kt, vt, q, "selkv", ratio=0.25))
    # every other token of a longer cache, and a head dim padded to 48 in memory
    big = np.zeros((HKV, 2 * N, 48), np.float32)
    big[:, ::2, :D] = k
    qpad = np.zeros((HQ, W, 48), np.float32)
    qpad[..., :D] = q
    same(ref, kc.compress(big[:, ::2, :D], v, qpad[..., :D], "selkv", ratio=0.25))


def test_strided_float16_equals_contiguous_float16():
    k, v, q = layer(10, dtype=np.float16)
    ref = kc.compress(k, v, q, "snapkv")
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    same(ref, kc.compress(kt, v, q, "snapkv"))


def test_inputs_are_not_copied():
    k, v, q = layer(11, n=4096)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    kc.compress(kt, v, q, "snapkv")  # warm up (imports, first allocations)
    tracemalloc.start()
    r = kc.compress(kt, v, q, "snapkv")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.lengths[0] == 1024
    out = r.keys.nbytes + r.values.nbytes  # the result's arrays, made during the call
    assert peak < out + k.nbytes // 4, f"numpy allocated {peak} bytes during the call: an input was copied"


# ---- Compressor -------------------------------------------------------------------------------------

def test_compressor_equals_compress_and_reuses_its_arrays():
    k, v, q = layer(12)
    c = kc.Compressor("selkv", alpha=0.3)
    assert c.method == "selkv" and c.threads == 1
    r1 = c.compress(k, v, q, ratio=0.25)
    same(r1, kc.compress(k, v, q, "selkv", ratio=0.25, alpha=0.3))
    keys1 = r1.keys
    bytes1 = c.workspace_bytes
    assert bytes1 > 0
    k2, v2, q2 = layer(13)
    tracemalloc.start()
    r2 = c.compress(k2, v2, q2, ratio=0.25)
    keys2 = r2.keys
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert np.shares_memory(keys1, keys2), "same shapes: the keys array is reused"
    assert peak < keys2.nbytes, "no numpy array allocated by a reused call"
    assert c.workspace_bytes == bytes1
    same(r2, kc.compress(k2, v2, q2, "selkv", ratio=0.25, alpha=0.3))
    with pytest.raises(RuntimeError, match="overwritten by a later call"):
        r1.positions
    # float16 and new shapes through the same Compressor
    kh, vh, qh = layer(14, n=200, dtype=np.float16)
    same(c.compress(kh, vh, qh, budget=30), kc.compress(kh, vh, qh, "selkv", budget=30, alpha=0.3))


def test_compressor_rejects_a_bad_option_when_made():
    with pytest.raises(ValueError, match="option --alpha does not apply to method 'snapkv'"):
        kc.Compressor("snapkv", alpha=0.5)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        kc.Compressor("nope")


# ---- decode attention -------------------------------------------------------------------------------

def decode_reference(q, k, v, bias, lengths, scale):
    hq, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros((hq, d))
    for h in range(hq):
        kv = h // g
        t = lengths[kv]
        logits = scale * (k[kv, :t].astype(np.float64) @ q[h].astype(np.float64))
        b = np.zeros(t)
        m = min(bias.shape[1], t)
        b[:m] = bias[kv, :m]
        logits += b
        p = np.exp(logits - logits.max())
        out[h] = (p / p.sum()) @ v[kv, :t].astype(np.float64)
    return out


def test_decode_attention_over_a_compressed_cache():
    k, v, q = layer(15)
    r = kc.compress(k, v, q, "selkv", budget=[50, 70], selection="per-head")
    assert r.bias.any()
    # the compressed entries plus 3 appended tokens per head, in a cache of capacity 80
    cache_k = np.zeros((HKV, 80, D), np.float32)
    cache_v = np.zeros((HKV, 80, D), np.float32)
    new = np.random.default_rng(16).standard_normal((2, HKV, 3, D), dtype=np.float32)
    lengths = r.lengths + 3
    for g in range(HKV):
        m = r.lengths[g]
        cache_k[g, :m], cache_v[g, :m] = r.keys[g, :m], r.values[g, :m]
        cache_k[g, m:m + 3], cache_v[g, m:m + 3] = new[0, g], new[1, g]
    bias = r.bias.copy()  # zeros beyond each head's length: the appended tokens there get bias 0 too
    qd = np.random.default_rng(17).standard_normal((HQ, D), dtype=np.float32)
    out = kc.decode_attention(qd, cache_k, cache_v, bias, lengths)
    assert out.shape == (HQ, D) and out.dtype == np.float32
    np.testing.assert_allclose(out, decode_reference(qd, cache_k, cache_v, bias, lengths, 1 / math.sqrt(D)),
                               rtol=1e-5, atol=1e-5)
    # no bias, every entry, another scale; float16 caches
    out = kc.decode_attention(qd, cache_k, cache_v, scale=0.5)
    ref = decode_reference(qd, cache_k, cache_v, np.zeros((HKV, 0)), [80] * HKV, 0.5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    out16 = kc.decode_attention(qd, cache_k.astype(np.float16), cache_v.astype(np.float16), bias, lengths)
    ref16 = decode_reference(qd, cache_k.astype(np.float16), cache_v.astype(np.float16), bias, lengths, 1 / math.sqrt(D))
    np.testing.assert_allclose(out16, ref16, rtol=1e-4, atol=1e-4)


# ---- errors -----------------------------------------------------------------------------------------

def raises(exc, pattern, fn, *args, **kwargs):
    with pytest.raises(exc, match=pattern):
        fn(*args, **kwargs)


def test_input_errors():
    k, v, q = layer(18)
    c = kc.compress
    raises(ValueError, r"keys: expected 3 dimensions \[Hkv\]\[n\]\[d\], got shape \(2, 300\)", c, k[:, :, 0], v, q)
    raises(ValueError, "keys: dtype float64 is not supported", c, k.astype(np.float64), v, q)
    raises(ValueError, "values: dtype int32 is not supported", c, k, v.astype(np.int32), q)
    raises(ValueError, "dtype >f4 is not supported", c, k.astype(">f4"), v, q)
    raises(ValueError, "keys and queries must have the same dtype", c, k, v, q.astype(np.float16))
    raises(ValueError, "negative strides", c, k[:, ::-1], v, q)
    raises(ValueError, "last axis .* must be contiguous", c, k, v[:, :, ::2], q[:, :, ::2])
    odd = np.frombuffer(np.zeros(HKV * N * D * 4 + 4, np.uint8), np.float32, HKV * N * D, offset=2).reshape(HKV, N, D)
    raises(ValueError, "keys: data is not aligned to its 4-byte elements", c, odd, v, q)
    skew = np.lib.stride_tricks.as_strided(k, shape=(HKV, N, D), strides=(N * D * 4, D * 4 + 2, 4))
    raises(ValueError, "stride 130 bytes of axis 1 is not a multiple of the element size 4", c, skew, v, q)
    raises(ValueError, "values: shape .* differs from keys", c, k, v[:, :200], q)
    raises(ValueError, r"query heads \(3\) must be a multiple of KV heads \(2\)", c, k, v, q[:3])
    raises(ValueError, "queries.dim = 16 differs from keys.dim = 32", c, k, v, q[:, :, :16])
    raises(ValueError, "every dimension must be positive", c, k[:, :0], v[:, :0], q)
    raises(ValueError, "strides alias", c, np.broadcast_to(k[:1], k.shape), v, q)
    bad = k.copy()
    bad[1, 7, 3] = np.nan
    raises(ValueError, r"keys\[1\]\[7\]\[3\] is not finite", c, bad, v, q, "knorm")
    raises(ValueError, "ObservedAttention needs the queries of all n = 300 prefill positions", c, k, v, q,
           "observed-attention")
    raises(TypeError, "expected a numpy array", c, "keys", v, q)
    raises(TypeError, "keys: expected a numpy array or a tensor with __array__, got list", c, k.tolist(), v, q)


def test_method_and_option_errors():
    k, v, q = layer(19)
    c = kc.compress
    raises(ValueError, r"unknown method 'snapKV' \(known: full, streaming", c, k, v, q, "snapKV")
    raises(ValueError, "option --alpha does not apply to method 'snapkv'", c, k, v, q, "snapkv", alpha=0.3)
    raises(ValueError, "option --bucket does not apply to method 'grkv'", c, k, v, q, "grkv", bucket=8)
    raises(ValueError, "option --lambda does not apply to method 'selkv'", c, k, v, q, "selkv", lambda_=0.1)
    raises(ValueError, "option --pool does not apply to method 'full'", c, k, v, q, "full", pool=3)
    raises(ValueError, "option --rope-base does not apply to method 'snapkv'", c, k, v, q, "snapkv", rope_base=5e5)
    raises(ValueError, "rope.theta must be > 0", c, k, v, q, "expected-attention", rope_base=-1.0)
    raises(TypeError, "unknown option 'ratoi'", c, k, v, q, ratoi=0.3)
    raises(TypeError, "give either lambda or lambda_", c, k, v, q, "grkv", **{"lambda": 0.1, "lambda_": 0.2})
    raises(TypeError, "pool expects an integer, got float", c, k, v, q, "snapkv", pool=5.0)
    raises(TypeError, "pool expects an integer, got bool", c, k, v, q, "snapkv", pool=True)
    raises(TypeError, "alpha expects a number, got str", c, k, v, q, "selkv", alpha="0.5")
    raises(ValueError, "alpha expects a finite number", c, k, v, q, "selkv", alpha=float("nan"))
    raises(TypeError, "route expects a string", c, k, v, q, "selkv", route=1)
    raises(TypeError, "safeguard expects True or False", c, k, v, q, "grkv", safeguard=1)
    raises(ValueError, "--pooling must be avg, max or none, got 'mean'", c, k, v, q, "snapkv", pooling="mean")
    raises(ValueError, "--route must be key-cosine", c, k, v, q, "selkv", route="nearest")
    raises(ValueError, "--selection must be shared or per-head", c, k, v, q, "selkv", selection="each")
    # the library's own range checks
    raises(ValueError, "selector.pool_kernel must be odd and >= 1 when pooling, got 4", c, k, v, q, "snapkv", pool=4)
    raises(ValueError, "selector.recent must be >= 0, got -1", c, k, v, q, "snapkv", recent=-1)
    raises(ValueError, r"compensator.r_max must be 0 \(off\) or >= 1, got 0.5", c, k, v, q, "selkv", r_max=0.5)
    raises(ValueError, r"router.bucket must be >= 0 \(0 = global\), got -2", c, k, v, q, "selkv", bucket=-2)
    raises(ValueError, "steps", c, k, v, q, "grkv", steps=100000)
    assert c(k, v, q, "snapkv", pool=None).lengths[0] == 75  # None leaves an option unset


def test_budget_and_thread_errors():
    k, v, q = layer(20)
    c = kc.compress
    raises(ValueError, "give either ratio or budget, not both", c, k, v, q, ratio=0.5, budget=10)
    raises(ValueError, r"budget ratio must be in \(0, 1\], got 1.5", c, k, v, q, ratio=1.5)
    raises(ValueError, r"budget ratio must be in \(0, 1\], got 0", c, k, v, q, ratio=0.0)
    raises(ValueError, "budget resolves to 0 tokens", c, k, v, q, ratio=0.001)
    raises(ValueError, "budget must be a positive token count, got 0", c, k, v, q, budget=0)
    raises(ValueError, r"budgets has 3 entries, expected one per KV head \(2\)", c, k, v, q, budget=[1, 2, 3])
    raises(ValueError, r"budgets\[1\] = -4: must be >= 1", c, k, v, q, budget=[5, -4])
    raises(TypeError, "budget expects an integer", c, k, v, q, budget=10.0)
    raises(TypeError, "ratio expects a number", c, k, v, q, ratio="0.5")
    raises(ValueError, "threads must be >= 1, got 0", c, k, v, q, threads=0)
    raises(ValueError, "threads must be >= 1", kc.Compressor, "snapkv", threads=-1)
    raises(TypeError, "threads expects an integer, got str", c, k, v, q, threads="2")


def test_decode_attention_errors():
    k, v, q = layer(21)
    qd = q[:, 0]
    d = kc.decode_attention
    raises(ValueError, r"q: expected 2 dimensions \[Hq\]\[d\]", d, q, k, v)
    raises(ValueError, "q has 16 columns, keys.dim = 32", d, qd[:, :16], k, v)
    raises(ValueError, r"query heads \(3\) must be a positive multiple of KV heads \(2\)", d, qd[:3], k, v)
    raises(ValueError, "q: dtype float64", d, qd.astype(np.float64), k, v)
    raises(ValueError, "values: shape .* differs from keys", d, qd, k, v[:, :10])
    raises(ValueError, r"bias: expected shape \[Hkv\]\[m\]", d, qd, k, v, np.zeros((3, 5), np.float32))
    raises(ValueError, "bias has 301 entries per head, more than the 300 of keys", d, qd, k, v,
           np.zeros((HKV, N + 1), np.float32))
    raises(ValueError, r"lengths: expected 2 entries", d, qd, k, v, None, [5])
    raises(ValueError, r"lengths\[1\] = 0 is outside \[1, 300\]", d, qd, k, v, None, [5, 0])
    raises(ValueError, r"lengths\[0\] = 301 is outside", d, qd, k, v, None, [301, 5])
    raises(TypeError, "lengths expects an integer, got float", d, qd, k, v, None, [1.5, 5])
    raises(ValueError, "attention.scale must be finite and >= 0", d, qd, k, v, scale=-1.0)
    raises(ValueError, "attention.softcap", d, qd, k, v, softcap=float("inf"))


def test_compressor_used_by_two_threads_at_once_is_an_error():
    k, v, q = layer(22, n=16384, hkv=4, hq=16, w=32, d=64)
    c = kc.Compressor("grkv")
    errors, started = [], threading.Event()

    def run():
        started.set()
        try:
            c.compress(k, v, q)
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    time.sleep(0.05)  # the worker is inside compress by now, the GIL released
    try:
        c.compress(k, v, q)
    except RuntimeError as e:
        errors.append(str(e))
    worker.join()
    assert len(errors) == 1 and "running in another thread" in errors[0], errors


# ---- the GIL ----------------------------------------------------------------------------------------

def test_gil_is_released_during_compression():
    k, v, q = layer(23, n=16384, hkv=4, hq=16, w=32, d=64)
    t0 = time.perf_counter()
    kc.compress(k, v, q, "grkv")
    alone = time.perf_counter() - t0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (kc.compress(k, v, q, "grkv"), done.set()))
    ticks = []
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    gaps = np.diff(ticks) if len(ticks) > 1 else np.array([alone])
    # With the GIL held this thread would stall for the whole call.
    assert gaps.max() < 0.5 * max(alone, 0.05), f"longest stall {gaps.max():.3f} s of a {alone:.3f} s call"


# ---- torch --------------------------------------------------------------------------------------------

def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    k, v, q = layer(24)
    ref = kc.compress(k, v, q, "selkv")
    tk, tv, tq = (torch.from_numpy(a) for a in (k, v, q))
    same(ref, kc.compress(tk, tv, tq, "selkv"))
    tkt = tk.transpose(0, 1).contiguous().transpose(0, 1)  # token-major storage, as a view
    assert not tkt.is_contiguous()
    same(ref, kc.compress(tkt, tv, tq, "selkv"))
    r16 = kc.compress(tk.half(), tv.half(), tq.half(), "snapkv")
    same(r16, kc.compress(k.astype(np.float16), v.astype(np.float16), q.astype(np.float16), "snapkv"))
    back = torch.from_numpy(ref.keys)
    assert back.shape == (HKV, ref.lengths[0], D)
    raises(TypeError, None, kc.compress, tk.bfloat16(), tv.bfloat16(), tq.bfloat16())  # numpy has no bfloat16
    raises(RuntimeError, None, kc.compress, tk.requires_grad_(), tv, tq)  # torch refuses .numpy() with grad


# ---- the documentation's examples ----------------------------------------------------------------------

SOURCE = os.environ.get("KVC_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize("page", ["README.md", "docs/python.md"])
def test_documentation_python_examples_run(tmp_path, page):
    with open(os.path.join(SOURCE, page), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, f"{page} has a ```python example"
    for code in blocks:
        if "import torch" in code:
            pytest.importorskip("torch")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=os.environ.copy(), timeout=120)


def test_documented_method_list_is_the_modules():
    with open(os.path.join(SOURCE, "docs/python.md"), encoding="utf-8") as f:
        text = f.read()
    found = re.search(r"`kvcompress\.methods` lists them \(`([^`]*)`", text, re.S)
    assert found, "docs/python.md lists the methods as `kvcompress.methods` lists them (`...`"
    assert found.group(1).split() == list(kc.methods)


def test_output_projection_wo():
    k, v, q = layer(2)
    wo = output_projection(2)
    r = kc.compress(k, v, q, "criticalkv", ratio=0.25, wo=wo)
    assert r.lengths.tolist() == [int(0.25 * N)] * HKV
    # float16 W_o is converted; a Compressor takes it per call; other methods ignore a valid one.
    same(kc.compress(k, v, q, "criticalkv", ratio=0.25, wo=wo.astype(np.float16)),
         kc.compress(k, v, q, "criticalkv", ratio=0.25, wo=wo.astype(np.float16).astype(np.float32)))
    same(kc.Compressor("criticalkv").compress(k, v, q, ratio=0.25, wo=wo), r)
    same(kc.compress(k, v, q, "snapkv", ratio=0.25, wo=wo), kc.compress(k, v, q, "snapkv", ratio=0.25))
    same(kc.compress(k, v, q, "snapkv", ratio=0.25, wo=wo, scorer="criticalkv"), r)
    with pytest.raises(ValueError, match="output_projection"):
        kc.compress(k, v, q, "criticalkv", ratio=0.25)
    with pytest.raises(ValueError, match="output_projection: shape"):
        kc.compress(k, v, q, "criticalkv", ratio=0.25, wo=wo[:, 1:])
    with pytest.raises(ValueError, match="rank 2"):
        kc.compress(k, v, q, "criticalkv", ratio=0.25, wo=wo[0])
