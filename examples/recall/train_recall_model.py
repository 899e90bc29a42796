#!/usr/bin/env python3
"""Trains recall-gqa.bin: a small Llama-style GQA model that retrieves what it read long ago.

Filler text is sampled from TinyStories-260K (stories260K.bin, tok512.bin); into it the script inserts
retrieval tasks written in tok512's byte tokens, which stories never use (docs/recall.md; the C++ side
is examples/engine/recall.hpp, which `kvcompress eval --task recall` uses):

  fact     FACT k v1 v2 END        k from KEYS, v1 v2 from VALUES, keys and values distinct per sequence
  passkey  PASS d1 d2 d3 d4 d5 END five distinct digits 0-9
  link     LINK a b END            a, b from KEYS; the fact for b comes later (multi-hop)
  queries  QUERY k FACT k -> v1 v2 END | PASSQ PASS -> d1..d5 END | HOPQ a LINK a -> b FACT b c1 c2 END

Each question ends in the item it asks about as the context wrote it, so that copying the token that
followed it there (an induction head) answers a fact or the passkey. A hop's answer names the key it
passes through, then asks for that key's fact as a fact question does: two retrievals, each of which
copying answers.

Training runs in phases (--phases). A copy phase trains on random tokens in which a random span recurs
at a random place, starting at 32 tokens and moving to the next length once the copies are predicted:
an induction head forms fast at short range, and the longer copies move its matching to the RoPE
pairs that rotate slowly enough to match far apart. Task phases train on the tasks above, lengths
cycled, with one copy batch every --copy-every steps; their loss is on the answer tokens (weight 1) and
on the filler's next token (weight --lm-weight). The rate decays over the last --decay of the task
steps. Deterministic from --seed on one thread count. Writes the llama2.c legacy format (shared
classifier), which examples/engine loads unchanged.

  make recall-model    (its two stages: the Makefile's RECALL_STAGE1 and RECALL_STAGE2)
"""
import argparse
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# Token ids: tok512 keeps ids 3..258 for the bytes 0x00..0xFF.
BOS = 1
FACT, ARROW, END, QUERY, PASS, PASSQ, HOPQ, LINK = 4, 5, 6, 7, 8, 9, 10, 11  # bytes 0x01..0x08
DIGITS = list(range(3 + 0x30, 3 + 0x3A))  # '0'..'9'
KEYS = list(range(3 + 0x80, 3 + 0xC0))  # 64 keys
VALUES = list(range(3 + 0xC0, 3 + 0x100))  # 64 values


# ---- model ----------------------------------------------------------------------------------------
class Model(nn.Module):
    def __init__(self, dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, rope_base=10000.0):
        super().__init__()
        self.cfg = (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)
        self.rope_base = rope_base
        self.dim, self.n_heads, self.n_kv, self.seq_len = dim, n_heads, n_kv_heads, seq_len
        self.hd = dim // n_heads
        kv = self.hd * n_kv_heads
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            L = nn.Module()
            L.an = nn.Parameter(torch.ones(dim))
            L.wq = nn.Linear(dim, dim, bias=False)
            L.wk = nn.Linear(dim, kv, bias=False)
            L.wv = nn.Linear(dim, kv, bias=False)
            L.wo = nn.Linear(dim, dim, bias=False)
            L.fn = nn.Parameter(torch.ones(dim))
            L.w1 = nn.Linear(dim, hidden, bias=False)
            L.w2 = nn.Linear(hidden, dim, bias=False)
            L.w3 = nn.Linear(dim, hidden, bias=False)
            self.layers.append(L)
        self.norm = nn.Parameter(torch.ones(dim))
        freqs = 1.0 / (float(rope_base) ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
        self.register_buffer("cos", torch.cos(ang).float(), persistent=False)
        self.register_buffer("sin", torch.sin(ang).float(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        for L in self.layers:  # GPT-2 style scaled residual projections
            nn.init.normal_(L.wo.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.normal_(L.w2.weight, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def rope(self, x, pos0):  # x: (B, T, H, hd), interleaved pairs as llama2.c
        T = x.shape[1]
        c = self.cos[pos0:pos0 + T][None, :, None, :]
        s = self.sin[pos0:pos0 + T][None, :, None, :]
        xr, xi = x[..., 0::2], x[..., 1::2]
        return torch.stack((xr * c - xi * s, xr * s + xi * c), dim=-1).flatten(-2)

    def forward(self, tok, cache=None, pos0=0):
        """Logits (B, T, V). With `cache` (one [k, v] per layer, each (B, S, Hkv, hd), written in place) the
        tokens sit at positions pos0 .. pos0 + T - 1 and attend to the cache's first pos0 + T rows."""
        B, T = tok.shape
        x = self.emb(tok)
        G = self.n_heads // self.n_kv
        mask = None
        for li, L in enumerate(self.layers):
            h = self.rms(x, L.an)
            q = self.rope(L.wq(h).view(B, T, self.n_heads, self.hd), pos0)
            k = self.rope(L.wk(h).view(B, T, self.n_kv, self.hd), pos0)
            v = L.wv(h).view(B, T, self.n_kv, self.hd)
            if cache is not None:
                cache[li][0][:, pos0:pos0 + T] = k
                cache[li][1][:, pos0:pos0 + T] = v
                k, v = cache[li][0][:, :pos0 + T], cache[li][1][:, :pos0 + T]
            S = k.shape[1]
            if hasattr(F, "scaled_dot_product_attention") and cache is None:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, dim=1),
                                                   v.transpose(1, 2).repeat_interleave(G, dim=1), is_causal=True)
                o = o.transpose(1, 2)
            else:
                # Query head h = kv * G + g reads KV head kv: (B, Hkv, G*T, hd) against (B, Hkv, S, hd).
                qg = (q * (1.0 / math.sqrt(self.hd))).view(B, T, self.n_kv, G, self.hd).permute(0, 2, 3, 1, 4)
                att = qg.reshape(B, self.n_kv, G * T, self.hd) @ k.permute(0, 2, 3, 1)
                if T > 1:
                    if mask is None:
                        i = torch.arange(T, device=tok.device)[:, None] + (S - T)
                        j = torch.arange(S, device=tok.device)[None, :]
                        mask = torch.where(j <= i, 0.0, float("-inf")).to(att.dtype)
                    att = (att.view(B, self.n_kv, G, T, S) + mask).view(B, self.n_kv, G * T, S)
                o = torch.softmax(att, -1) @ v.transpose(1, 2)
                o = o.view(B, self.n_kv, G, T, self.hd).permute(0, 3, 1, 2, 4)
            x = x + L.wo(o.reshape(B, T, self.dim))
            h = self.rms(x, L.fn)
            x = x + L.w2(F.silu(L.w1(h)) * L.w3(h))
        return self.rms(x, self.norm) @ self.emb.weight.t()

    # llama2.c legacy format: 7 int32 header, then the tensors in a fixed order, float32.
    def export(self, path):
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = self.cfg
        with open(path, "wb") as f:
            f.write(struct.pack("7i", dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len))

            def w(t):
                f.write(t.detach().cpu().float().contiguous().numpy().astype("<f4").tobytes())

            w(self.emb.weight)
            for name in ("an", "wq", "wk", "wv", "wo", "fn", "w1", "w2", "w3"):
                for L in self.layers:
                    p = getattr(L, name)
                    w(p if isinstance(p, torch.Tensor) else p.weight)
            w(self.norm)
            w(self.cos[:, :])
            w(self.sin[:, :])

    @staticmethod
    def load(path):
        with open(path, "rb") as f:
            dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("7i", f.read(28))
            data = np.frombuffer(f.read(), dtype="<f4")
        shared = vocab > 0
        vocab = abs(vocab)
        hd = dim // n_heads
        # The RoPE base from the tables' pair 1 (as examples/engine/llama2.hpp reads it): its turn per
        # position at position 1, refined at the last one.
        tables = data[len(data) - seq_len * hd:].reshape(2, seq_len, hd // 2).astype(np.float64)
        turn = math.atan2(tables[1, 1, 1], tables[0, 1, 1])
        last = seq_len - 1
        a = math.atan2(tables[1, last, 1], tables[0, last, 1])
        turn = (a + 2 * math.pi * round((turn * last - a) / (2 * math.pi))) / last
        m = Model(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, rope_base=turn ** (-hd / 2))
        at = 0

        def take(shape):
            nonlocal at
            n = int(np.prod(shape))
            t = torch.from_numpy(data[at:at + n].copy()).view(*shape)
            at += n
            return t

        kv = hd * n_kv
        with torch.no_grad():
            m.emb.weight.copy_(take((vocab, dim)))
            shapes = {"an": (dim,), "wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, dim),
                      "fn": (dim,), "w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
            for name in ("an", "wq", "wk", "wv", "wo", "fn", "w1", "w2", "w3"):
                for L in m.layers:
                    p = getattr(L, name)
                    (p if isinstance(p, torch.Tensor) else p.weight).copy_(take(shapes[name]))
            m.norm.copy_(take((dim,)))
        if not shared:
            raise ValueError(path + ": a separate classifier is not supported here")
        return m


# ---- data -----------------------------------------------------------------------------------------
@torch.no_grad()
def sample_filler(model, n_stories, length, gen, batch=1024):
    """n_stories token streams of `length` sampled at temperature 1 from `model`, each from BOS."""
    out = []
    for b0 in range(0, n_stories, batch):
        nb = min(batch, n_stories - b0)
        tok = torch.full((nb, 1), BOS, dtype=torch.long)
        cache = [[torch.zeros(nb, length, model.n_kv, model.hd) for _ in range(2)] for _ in model.layers]
        seq = [tok]
        for t in range(length - 1):
            logits = model(tok, cache, t)[:, -1].double()
            tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            seq.append(tok)
        out.append(torch.cat(seq, 1).numpy().astype(np.int32))
    stream = np.concatenate(out).reshape(-1)
    return stream[~np.isin(stream, np.array(KEYS + VALUES + list(range(3, 12)) + DIGITS))]


def make_sequence(rng, filler, L, n_facts, n_queries, kinds=None):
    """One training sequence of exactly L tokens and its loss weights' classes
    (0 none, 1 filler next-token, 2 answer)."""
    keys = rng.choice(KEYS, size=n_facts + 2, replace=False)
    vals = [int(v) for v in rng.choice(VALUES, size=2 * n_facts + 2, replace=False)]
    facts = [[FACT, int(keys[f]), vals[2 * f], vals[2 * f + 1], END] for f in range(n_facts)]
    digits = [int(d) for d in rng.choice(DIGITS, size=5, replace=False)]
    a, b = int(keys[n_facts]), int(keys[n_facts + 1])
    c = vals[2 * n_facts:]
    items = facts + [[PASS] + digits + [END]]
    # Queries, each (prompt, answer), distinct within a sequence (a repeated question could copy its
    # earlier answer): the passkey and the hop each with probability 1/2, then distinct facts.
    if kinds is None:
        kinds = [k for k, p in ((1, 0.5), (2, 0.5)) if rng.random() < p]
        kinds += [0] * max(0, min(n_facts, n_queries - len(kinds)))
        kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    fact_order = list(rng.permutation(n_facts))
    qs = []
    for kind in kinds:
        if kind == 0 and n_facts > 0:
            i = int(fact_order.pop())
            qs.append(([QUERY, facts[i][1], FACT, facts[i][1]], facts[i][2:4] + [END]))
        elif kind == 1:
            qs.append(([PASSQ, PASS], digits + [END]))
        else:
            qs.append(([HOPQ, a, LINK, a], [b, FACT, b] + c + [END]))
    link, hopfact = [LINK, a, b, END], [FACT, b, c[0], c[1], END]
    fact_len = sum(len(x) for x in items) + len(link) + len(hopfact)
    while len(qs) > 1 and L - 1 - fact_len - sum(len(p) + len(ans) for p, ans in qs) < 8:
        qs.pop()  # a short sequence asks fewer questions
    n_fill = L - 1 - fact_len - sum(len(p) + len(ans) for p, ans in qs)
    if n_fill < 8:
        raise ValueError("sequence too short for its tasks")
    start = int(rng.integers(0, len(filler) - n_fill))
    fill = filler[start:start + n_fill]
    # Insertion points: the link in the first half of the filler, its fact after it.
    order = list(rng.permutation(len(items)))
    cuts = sorted(int(x) for x in rng.integers(0, n_fill + 1, size=len(items)))
    pl = int(rng.integers(0, n_fill // 2 + 1))
    ph = int(rng.integers(pl, n_fill + 1))
    events = [(cuts[i], 1, items[order[i]]) for i in range(len(items))] + [(pl, 0, link), (ph, 2, hopfact)]
    events.sort(key=lambda e: (e[0], e[1]))
    seq, cls = [BOS], [0]
    at = 0
    for pos, _, item in events:
        seq += list(fill[at:pos]); cls += [1] * (pos - at); at = pos
        seq += item; cls += [0] * len(item)
    seq += list(fill[at:]); cls += [1] * (n_fill - at)
    for p, ans in qs:
        seq += p; cls += [0] * len(p)
        seq += ans; cls += [2] * len(ans)
    assert len(seq) == L
    return np.array(seq, dtype=np.int64), np.array(cls, dtype=np.int64)


def copy_batch(rng, L, B):
    """Induction warm-up: random tokens in which a random span s (8 to L/3 tokens) recurs after a random gap;
    the loss is on the recurrence but its first token. The span's length and place vary, so that only
    copying what followed the current token's earlier occurrence (an induction head) predicts it."""
    x = rng.integers(3, 512, size=(B, L))
    x[:, 0] = BOS
    c = np.zeros((B, L), dtype=np.int64)
    for b in range(B):
        h = int(rng.integers(8, L // 3 + 1))
        p1 = int(rng.integers(1, L - 2 * h + 1))
        p2 = int(rng.integers(p1 + h, L - h + 1))
        x[b, p2:p2 + h] = x[b, p1:p1 + h]
        c[b, p2 + 1:p2 + h] = 2
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(c)


DEFAULT_PHASES = "copy 32,48,64,96,128,192,256,384,512 1500; task 128,256,512 300; task 256,512,1024,2048 600"


def facts_for(L, rng):
    return int(rng.integers(1, max(2, min(16, L // 16)) + 1))


def batch(rng, filler, L, B, max_queries):
    xs, cs = zip(*(make_sequence(rng, filler, L, facts_for(L, rng), int(rng.integers(1, max_queries + 1)))
                   for _ in range(B)))
    return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(cs))


@torch.no_grad()
def accuracy(model, rng, filler, L, n, device):
    """Exact-match accuracy per query kind (fact, passkey, hop), one query per sequence, teacher-forced argmax
    over the answer tokens (equal to greedy decoding's exact match)."""
    hits, counts = np.zeros(3), np.zeros(3)
    model.eval()
    for i in range(n):
        kind = i % 3
        x, c = make_sequence(rng, filler, L, 8 if L >= 1024 else max(1, min(16, L // 48)), 1, kinds=[kind])
        xt = torch.from_numpy(x)[None].to(device)
        pred = model(xt[:, :-1]).argmax(-1)[0].cpu().numpy()
        ans = np.nonzero(c[1:] == 2)[0]
        hits[kind] += float(np.all(pred[ans] == x[1:][ans]))
        counts[kind] += 1
    model.train()
    return hits / np.maximum(counts, 1)


def parse_phases(text):
    """'copy 32 350; task 128,256 400' -> [('copy', [32], 350), ('task', [128, 256], 400)]."""
    phases = []
    for part in text.split(";"):
        kind, lengths, steps = part.split()
        if kind not in ("copy", "task"):
            raise ValueError(f"phase kind must be copy or task, got {kind!r}")
        phases.append((kind, [int(x) for x in lengths.split(",")], int(steps)))
    return phases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--models", default=os.environ.get("KVC_MODEL_DIR", os.path.join(here, "../../../shared/models")))
    ap.add_argument("--out", default=os.path.join(here, "recall-gqa.bin"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rope-base", type=float, default=500000.0,
                    help="RoPE base θ: with 16-dimensional heads, 10000 leaves one pair turning less than a radian "
                         "over 2048 positions, 500000 three")
    ap.add_argument("--phases", default=DEFAULT_PHASES,
                    help="'KIND LENGTHS STEPS; ...': copy (induction warm-up) or task batches, lengths cycled")
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--decay", type=float, default=0.3, help="the last fraction of task steps decays the rate (cosine) to 0")
    ap.add_argument("--copy-every", type=int, default=4, help="in task phases, every this many steps one copy batch (0: none)")
    ap.add_argument("--max-queries", type=int, default=8, help="questions per training sequence: 1 to this many")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--filler-cache", default="", help="an .npy file holding the sampled filler (written when absent)")
    ap.add_argument("--lm-weight", type=float, default=0.1)
    ap.add_argument("--filler-stories", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--eval-lengths", default="512,2048")
    ap.add_argument("--eval-samples", type=int, default=30)
    ap.add_argument("--checkpoint", default="", help="also write the model here at every evaluation")
    ap.add_argument("--init", default="", help="start from this model file instead of a random initialisation")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this many minutes (0: no limit)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    t0 = time.time()
    phases = parse_phases(args.phases)
    total = sum(p[2] for p in phases)

    teacher = Model.load(os.path.join(args.models, "stories260K.bin"))
    gen = torch.Generator().manual_seed(args.seed)
    if args.filler_cache and os.path.exists(args.filler_cache):
        filler, eval_filler = np.load(args.filler_cache), np.load(args.filler_cache + ".eval.npy")
    else:
        filler = sample_filler(teacher, args.filler_stories, 512, gen)
        eval_filler = sample_filler(teacher, 256, 512, torch.Generator().manual_seed(args.seed + 1000))
        if args.filler_cache:
            np.save(args.filler_cache, filler)
            np.save(args.filler_cache + ".eval.npy", eval_filler)
    print(f"filler: {len(filler)} tokens sampled from stories260K in {time.time() - t0:.0f} s", flush=True)

    if args.init:  # continue from a checkpoint (its shape replaces --dim ... --seq-len)
        model = Model.load(args.init).to(dev)
        args.dim, args.hidden, args.layers, args.heads, args.kv_heads, _, args.seq_len = model.cfg
    else:
        model = Model(args.dim, args.hidden, args.layers, args.heads, args.kv_heads, 512, args.seq_len,
                      args.rope_base).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: dim {args.dim} hidden {args.hidden} layers {args.layers} heads {args.heads}/{args.kv_heads} "
          f"seq_len {args.seq_len} RoPE base {model.rope_base:.6g}, {n_params} parameters; {total} steps: "
          f"{args.phases}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    warm = 50
    task_total = sum(p[2] for p in phases if p[0] == "task")
    decay_from = int(task_total * (1 - args.decay))
    step, task_step, done = 0, 0, False

    def evaluate():
        erng = np.random.default_rng(10_000 + args.seed)
        accs = {L: accuracy(model, erng, eval_filler, L, args.eval_samples, dev) for L in eval_lengths}
        print(f"step {step} eval " + " ".join(f"L{L} fact {a[0]:.2f} pass {a[1]:.2f} hop {a[2]:.2f}"
                                                for L, a in accs.items()), flush=True)
        if args.checkpoint:
            model.cpu().export(args.checkpoint)
            model.to(dev)

    for kind, lengths, steps in phases:
        # A copy phase moves to its next length once the copied tokens are predicted (mean accuracy of
        # the last 8 steps >= 0.9), and ends after its last length or `steps` steps; a task phase
        # cycles through its lengths for `steps` steps.
        level, recent = 0, []
        for i in range(steps):
            if args.eval_every and step % args.eval_every == 0 and step > 0:
                evaluate()
            if args.minutes and time.time() - t0 > 60 * args.minutes:
                done = True
                break
            if kind == "copy":
                if len(recent) >= 8 and np.mean(recent[-8:]) >= 0.9:
                    if level + 1 == len(lengths):
                        print(f"step {step} copy: done", flush=True)
                        break
                    level, recent = level + 1, []
                    print(f"step {step} copy: length {lengths[level]}", flush=True)
                L = lengths[level]
            else:
                L = lengths[i % len(lengths)]
            B = max(1, args.tokens_per_step // L)
            if kind == "copy" or (args.copy_every and i % args.copy_every == args.copy_every - 1):
                x, c = copy_batch(rng, L, B)
            else:
                x, c = batch(rng, filler, L, B, args.max_queries)
            x, c = x.to(dev), c.to(dev)
            lr = args.lr * min(1.0, (step + 1) / warm)
            if kind == "task" and task_step >= decay_from:
                lr *= 0.5 * (1 + math.cos(math.pi * (task_step - decay_from) / max(1, task_total - decay_from)))
            for g in opt.param_groups:
                g["lr"] = lr
            logits = model(x[:, :-1])
            tgt, cls = x[:, 1:], c[:, 1:]
            w = torch.where(cls == 2, 1.0, torch.where(cls == 1, args.lm_weight, 0.0))
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="none")
            loss = (nll * w.reshape(-1)).sum() / w.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ans = (cls == 2)
            acc = (logits.argmax(-1)[ans] == tgt[ans]).float().mean().item()
            if kind == "copy":
                recent.append(acc)
            if step % args.log_every == 0:
                print(f"step {step} {kind} L {L} loss {loss.item():.3f} answer-token acc {acc:.2f} lr {lr:.2e} "
                      f"{time.time() - t0:.0f} s", flush=True)
            step += 1
            task_step += kind == "task"
        if done:
            break
    evaluate()
    model.cpu().export(args.out)
    print(f"wrote {args.out} after {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
