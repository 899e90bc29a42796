// Checks on whole results shared by the pipeline tests.
#pragma once

#include <catch2/catch.hpp>

#include <kvcompress/result.hpp>

#include <cstddef>

namespace kvc::test {

/// Every field of two results is bit-identical.
template <class Real>
void check_identical(const kvc::LayerResult<Real>& x, const kvc::LayerResult<Real>& y) {
  REQUIRE(x.heads.size() == y.heads.size());
  CHECK(x.next_position == y.next_position);
  CHECK(x.shared_positions == y.shared_positions);
  CHECK(x.window_product == y.window_product);
  for (std::size_t g = 0; g < x.heads.size(); ++g) {
    INFO("head " << g);
    CHECK(x.heads[g].positions == y.heads[g].positions);
    CHECK(x.heads[g].keys == y.heads[g].keys);
    CHECK(x.heads[g].values == y.heads[g].values);
    CHECK(x.heads[g].bias == y.heads[g].bias);
    CHECK(x.heads[g].diagnostics.merged == y.heads[g].diagnostics.merged);
    CHECK(x.heads[g].diagnostics.gate_mean == y.heads[g].diagnostics.gate_mean);
  }
}

}  // namespace kvc::test
