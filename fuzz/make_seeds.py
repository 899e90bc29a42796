#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/ (small files). Run from anywhere; deterministic."""
import math
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- .npy -------------------------------------------------------------------------------------
def npy(dict_text, data, major=1):
    prefix = 10 if major == 1 else 12
    total = (prefix + len(dict_text) + 1 + 63) // 64 * 64
    header = dict_text + " " * (total - prefix - len(dict_text) - 1) + "\n"
    length = struct.pack("<H", len(header)) if major == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([major, 0]) + length + header.encode() + data


def d(descr, shape):
    return "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)


write("npy", "f4_2x3.npy", npy(d("<f4", "(2, 3)"), struct.pack("<6f", 1, -2, 3.5, 0, 1e30, -1e-30)))
write("npy", "f2_4.npy", npy(d("<f2", "(4,)"), struct.pack("<4H", 0x3C00, 0x7BFF, 0x0001, 0x8000)))
write("npy", "i4_2x2.npy", npy(d("<i4", "(2, 2)"), struct.pack("<4i", 1, -1, 2**31 - 1, -2**31)))
write("npy", "i8_1x3.npy", npy(d("<i8", "(1, 3)"), struct.pack("<3q", 1, 2**40 + 5, -7)))
write("npy", "v2_scalar.npy", npy(d("<f4", "()"), struct.pack("<f", 9.0), major=2))
write("npy", "v3_dq.npy", npy('{"shape": (3, 1), "fortran_order": False, "descr": "<f4"}', struct.pack("<3f", 1, 2, 3), major=3))
write("npy", "zero_dim.npy", npy(d("<f4", "(0, 5)"), b""))
write("npy", "wrap_f4.npy", npy(d("<f4", "(2147483648, 2147483648, 1)"), b""))
write("npy", "wrap_i8.npy", npy(d("<i8", "(2305843009213693953,)"), b"\x01" * 8))


# ---- llama2.c checkpoint ----------------------------------------------------------------------
def model(dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared=True, seed=1):
    rng = random.Random(seed)
    hs = dim // heads
    kv = hs * kv_heads
    half = seq_len * (hs // 2)
    counts = [vocab * dim, layers * dim, layers * dim * dim, layers * kv * dim, layers * kv * dim,
              layers * dim * dim, layers * dim, layers * hidden * dim, layers * dim * hidden,
              layers * hidden * dim, dim]
    out = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared else -vocab, seq_len)
    for c in counts:
        out += struct.pack("<%df" % c, *[rng.uniform(-0.5, 0.5) for _ in range(c)])
    real, imag = [], []
    for p in range(seq_len):
        for i in range(hs // 2):
            a = p * 10000.0 ** (-2.0 * i / hs)
            real.append(math.cos(a))
            imag.append(math.sin(a))
    out += struct.pack("<%df" % half, *real) + struct.pack("<%df" % half, *imag)
    if not shared:
        out += struct.pack("<%df" % (vocab * dim), *[rng.uniform(-0.5, 0.5) for _ in range(vocab * dim)])
    return out


write("model", "tiny_shared", model(2, 2, 1, 1, 1, 3, 4))
write("model", "tiny_classifier", model(4, 6, 2, 2, 1, 5, 4, shared=False, seed=2))
write("model", "gqa", model(8, 8, 1, 4, 2, 6, 3, seed=3))
write("model", "header_only", struct.pack("<7i", 2, 2, 1, 1, 1, 3, 4))


# ---- tokenizer ------------------------------------------------------------------------------
def tokenizer(pieces, max_len=None):
    max_len = max_len or max(1, max(len(p) for p in pieces))
    out = struct.pack("<i", max_len)
    for k, p in enumerate(pieces):
        b = p.encode("utf-8") if isinstance(p, str) else p
        out += struct.pack("<fi", -float(k), len(b)) + b
    return out


def tok_input(pieces, text):
    # byte 0: vocab_size = 3 + b % 64; byte 1: text length (mod 32); the text; the tokenizer file.
    t = text.encode("utf-8")
    return bytes([len(pieces) - 3, len(t)]) + t + tokenizer(pieces)


basic = ["<unk>", "<s>", "</s>", " ", "a", "b", "ab", " a", " ab", "<0x41>", "<0xe2>", "<0x82>", "<0xac>", "é"]
write("tokenizer", "basic", tok_input(basic, "ab aba Aé"))
write("tokenizer", "euro", tok_input(basic, "a€b"))
write("tokenizer", "empty_pieces", tok_input(["<unk>", "", "", "", "x"], "xx"))
write("tokenizer", "no_text", tok_input(["<unk>", "<s>", "</s>"], ""))

# ---- layer (FuzzedDataProvider bytes) --------------------------------------------------------
rng = random.Random(25)
for k, n in enumerate([16, 48, 96, 160, 256, 400]):
    write("layer", "random_%d" % k, bytes(rng.randrange(256) for _ in range(n)))
write("layer", "zeros", bytes(64))
write("layer", "ones", bytes([255]) * 128)
