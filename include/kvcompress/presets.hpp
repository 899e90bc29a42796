// Presets: the published methods as one-line compositions of policies. Each template argument of
// TopK / BucketRouter is that method's default; all of them stay adjustable through Arguments.
//
//   TopK<sinks, recent, avg-pool kernel, granularity>      BucketRouter<bucket, statistic>
//   TopChunks<chunk, sinks, recent, avg-pool kernel, granularity>
#pragma once
#include "kvcompress/compensator/compensators.hpp"
#include "kvcompress/merger/cache_merge.hpp"
#include "kvcompress/merger/gated_merge.hpp"
#include "kvcompress/merger/nearest_key_merge.hpp"
#include "kvcompress/merger/ridge.hpp"
#include "kvcompress/pipeline.hpp"
#include "kvcompress/router/bucket_router.hpp"
#include "kvcompress/scorer/critical_attention.hpp"
#include "kvcompress/scorer/expected_attention.hpp"
#include "kvcompress/scorer/key_diversity.hpp"
#include "kvcompress/scorer/lag_relative.hpp"
#include "kvcompress/scorer/last_query_attention.hpp"
#include "kvcompress/scorer/local_leverage.hpp"
#include "kvcompress/scorer/observed_attention.hpp"
#include "kvcompress/scorer/scorers.hpp"
#include "kvcompress/selector/threshold.hpp"
#include "kvcompress/selector/top_blocks.hpp"
#include "kvcompress/selector/top_chunks.hpp"
#include "kvcompress/selector/top_k.hpp"

namespace kvc {

/// No compression: keeps every token unchanged (the reference run, "full").
using FullCache = Pipeline<Position, KeepAll, NoRoute, Drop, NoCompensation>;

/// StreamingLLM: 4 attention sinks + the most recent tokens. Needs no window attention.
using StreamingLLM = Pipeline<Position, TopK<4, 0, 0>, NoRoute, Drop, NoCompensation>;

/// SnapKV: window attention mass, average-pooled (kernel 5), per KV head; the observation window
/// (pass W = 32 queries) is kept as the recent tokens.
using SnapKV = Pipeline<AttentionMass, TopK<0, 32, 5>, NoRoute, Drop, NoCompensation>;

/// SelKV selection only: attention × value norm, pool 5, recent 16, shared across KV heads.
using SelKVEvict = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, NoRoute, Drop, NoCompensation>;

/// SelKV: the above + key-cosine routing in 32-token buckets, soft cosine gate, α·log R bias (α 0.5).
using SelKV = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, BucketRouter<32>, SoftGate,
                       AttentionRatio>;

/// SelKV with every evicted token merged (g = 1): the ablation of the soft gate.
using SelKVMergeAll = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, BucketRouter<32>, MergeAll,
                               AttentionRatio>;

/// KNorm: keep low-norm keys (plus the recent window), per KV head.
using KNorm = Pipeline<KeyNorm, TopK<0, 32, 0>, NoRoute, Drop, NoCompensation>;

/// TOVA: the attention of the last window query (group mean), per KV head; the last token is kept.
using TOVA = Pipeline<LastQueryAttention, TopK<0, 1, 0>, NoRoute, Drop, NoCompensation>;

/// KeyDiff: keep the keys least similar to the head's mean key direction, per KV head.
using KeyDiff = Pipeline<KeyDiversity, TopK<>, NoRoute, Drop, NoCompensation>;

/// CUR (CurDKV as kvpress computes it): key × value squared norms normalised in 16-token windows,
/// per KV head; the scorer gives its 4 sinks the top score.
using CUR = Pipeline<LocalLeverage, TopK<>, NoRoute, Drop, NoCompensation>;

/// LagKV: each 128-token partition ranked against the next one, per KV head; the scorer ranks its
/// 4 sinks, then the unscored tail (newest first), above every partition.
using LagKV = Pipeline<LagRelative, TopK<>, NoRoute, Drop, NoCompensation>;

/// Expected Attention: the attention expected from future queries (a Gaussian fitted to the window
/// queries, rotated to the next 512 positions) times the value norm, per KV head; the scorer gives
/// its 4 sinks the top score. Reads the keys' RoPE from Arguments::reposition (layout, theta).
using ExpectedAttentionEvict = Pipeline<ExpectedAttention, TopK<>, NoRoute, Drop, NoCompensation>;

/// H2O (kvpress ObservedAttentionPress): the attention each token received from every prefill query,
/// averaged over the queries that see it, per KV head. Needs all n prefill queries as the window.
using H2O = Pipeline<ObservedAttention, TopK<>, NoRoute, Drop, NoCompensation>;

/// ChunkKV over SnapKV: SnapKV's scores, pooling and recent window, then whole 20-token chunks by
/// their mean score, the same positions for every KV head.
using ChunkKV = Pipeline<AttentionMass, TopChunks<20, 0, 32, 5>, NoRoute, Drop, NoCompensation>;

/// Threshold (kvpress's ThresholdPress over SnapKV's scores): every token whose window attention mass
/// reaches τ (selector.threshold, default 0.02), and the 64 newest; the budget caps the count.
using Threshold = Pipeline<AttentionMass, ThresholdSelect<64>, NoRoute, Drop, NoCompensation>;

/// AdaKV over SnapKV: the layer's Hkv·m entries shared out by one top-k over every head's window
/// mass (each head keeps at least a fifth of m), then SnapKV's selection per head.
using AdaKVSnapKV = Pipeline<AttentionMass, TopK<0, 32, 5>, NoRoute, Drop, NoCompensation, AdaKV>;

/// AdaKV over SelKV: SelKV's scores, routing, soft gate and bias with per-head selection (shared
/// selection needs equal budgets).
using AdaKVSelKV = Pipeline<ValueWeighted, TopK<0, 16, 5>, BucketRouter<32>, SoftGate, AttentionRatio, AdaKV>;

/// CriticalKV over SnapKV (kvpress CriticalKVPress): half of each head's budget by SnapKV's pooled
/// window mass, the rest by (mass + ε)·‖W_o v‖₁. Needs the layer's output_projection W_o.
using CriticalKV = Pipeline<CriticalAttention, TopK<0, 32, 0>, NoRoute, Drop, NoCompensation>;

/// CriticalAdaKV: AdaKV's allocation over CriticalKV's scores, then CriticalKV's selection per head.
using CriticalAdaKV = Pipeline<CriticalAttention, TopK<0, 32, 0>, NoRoute, Drop, NoCompensation, AdaKV>;

/// SnapKV's eviction, each evicted value folded into the kept token of most similar key (global
/// key-cosine routing), weighted by that cosine and the value norms (kvpress MergingPress).
using SnapKVNearestKey = Pipeline<AttentionMass, TopK<0, 32, 5>, BucketRouter<0>, NearestKeyMerge, NoCompensation>;

/// SnapKV's eviction, each evicted value spread over the next 32 kept tokens with weight
/// min(a_e / mean window mass, 1) (CaM, in expectation).
using SnapKVCAM = Pipeline<AttentionMass, TopK<0, 32, 5>, NoRoute, CacheMerge, NoCompensation>;

/// GRKV after SnapKV eviction (the paper's main setting): ridge re-fit of the kept values, then keys.
using SnapKVGRKV = Pipeline<AttentionMass, TopK<0, 32, 5>, NoRoute, RidgeMerge, NoCompensation>;

/// GRKV after SelKV's shared selection.
using SelKVEvictGRKV = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, NoRoute, RidgeMerge, NoCompensation>;

/// GRKV after StreamingLLM eviction (sinks + recent).
using StreamingLLMGRKV = Pipeline<Position, TopK<4, 0, 0>, NoRoute, RidgeMerge, NoCompensation>;

}  // namespace kvc
