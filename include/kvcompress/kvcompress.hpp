// kvcompress: compress a transformer layer's KV cache after prefill. The umbrella header.
//
//   #include <kvcompress/kvcompress.hpp>
//   auto layer  = kvc::LayerView<float>{keys, values, queries};   // zero-copy views of your cache
//   auto result = kvc::SelKV{}.run(layer, kvc::Budget::ratio(0.25));
//   kvc::compact_into(result, keys_out, values_out);               // and result.heads[g].bias
#pragma once
#include "kvcompress/core.hpp"

#include "kvcompress/attention/decode_attention.hpp"
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/compensator/compensators.hpp"
#include "kvcompress/linalg/conjugate_gradient.hpp"
#include "kvcompress/merger/cache_merge.hpp"
#include "kvcompress/merger/gated_merge.hpp"
#include "kvcompress/merger/nearest_key_merge.hpp"
#include "kvcompress/merger/ridge.hpp"
#include "kvcompress/pipeline.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/decoding.hpp"
#include "kvcompress/metrics.hpp"
#include "kvcompress/model.hpp"
#include "kvcompress/one_of.hpp"
#include "kvcompress/presets.hpp"
#include "kvcompress/result.hpp"
#include "kvcompress/rope.hpp"
#include "kvcompress/traits.hpp"
#include "kvcompress/router/bucket_router.hpp"
#include "kvcompress/scorer/scorers.hpp"
#include "kvcompress/selector/top_k.hpp"
