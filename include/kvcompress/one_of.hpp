// OneOf<Ps...>: a pipeline slot whose policy is chosen at run time among Ps.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/router/no_route.hpp"
#include "kvcompress/selector/top_k.hpp"
#include "kvcompress/traits.hpp"

#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace kvc {

namespace detail {
template <class P, class T, class = void>
struct validates_layer : std::false_type {};
template <class P, class T>
struct validates_layer<P, T, std::void_t<decltype(std::declval<const P&>().validate(std::declval<const LayerView<T>&>()))>>
    : std::true_type {};
}  // namespace detail

/// A policy for any slot of a Pipeline that runs one of the policies Ps, chosen at run time by its
/// Arguments (`args.policy`, a std::variant<Ps...>; by default the first, with its defaults). One
/// Pipeline<OneOf<...>, OneOf<...>, ...> type then covers every combination of its alternatives and is
/// compiled once, where a Pipeline per combination would be compiled each.
///
/// Results equal those of the Pipeline of the chosen policies: the traits are the conservative union
/// of the alternatives' (PolicyTraits), which costs work, never changes a result, and the pipeline
/// asks the chosen policies whether the window attention and its outputs are needed:
/// - a router that fills the kept keys or a merger that fills the kept values does so after the
///   pipeline's gather, which only it would have saved;
/// - NaN/Inf input is found by the pipeline's own scans unless every alternative covers it.
/// A merger that needs routing (traits::needs_routing) paired at run time with NoRoute fails
/// Pipeline::validate with a message (the compile-time check cannot see the choice).
template <class... Ps>
struct OneOf {
  static_assert(sizeof...(Ps) >= 1, "OneOf needs at least one alternative");

  struct Arguments {
    std::variant<Ps...> policy{};  ///< the chosen policy, with its own Arguments
  };
  Arguments args;

  struct traits : PolicyTraits {
    static constexpr bool needs_mass = (policy_traits<Ps>::needs_mass || ...);
    static constexpr bool needs_window_outputs = (policy_traits<Ps>::needs_window_outputs || ...);
    static constexpr bool covers_keys = (policy_traits<Ps>::covers_keys && ...);
    static constexpr bool covers_values = (policy_traits<Ps>::covers_values && ...);
    static constexpr bool overwrites_selection = (policy_traits<Ps>::overwrites_selection && ...);
    static constexpr bool takes_threads = true;  // passed on to the alternatives that take them
    static constexpr bool keeps_values = (policy_traits<Ps>::keeps_values && ...);
    static constexpr bool reads_kept_keys = (policy_traits<Ps>::reads_kept_keys || ...);
    static constexpr bool reads_kept_values = (policy_traits<Ps>::reads_kept_values || ...);
  };

  /// f(chosen policy).
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), args.policy);
  }

  /// Whether the chosen policy reads the window attention mass (the pipeline runs that stage only then).
  bool needs_mass() const {
    return visit([](const auto& p) { return policy_traits<std::decay_t<decltype(p)>>::needs_mass; });
  }

  /// Whether the chosen policy is P.
  template <class P>
  bool holds() const {
    return std::holds_alternative<P>(args.policy);
  }

  // Every slot's verbs; a Pipeline calls only those of the slot the OneOf is in.
  Status validate() const {
    return visit([](const auto& p) { return p.validate(); });
  }
  Status validate(Index n, Index m) const {
    return visit([&](const auto& p) { return p.validate(n, m); });
  }
  /// Scorer: the chosen scorer's check of the layer, when it has one (ObservedAttention's queries).
  template <class T>
  Status validate(const LayerView<T>& layer) const {
    return visit([&](const auto& p) {
      if constexpr (detail::validates_layer<std::decay_t<decltype(p)>, T>::value) return p.validate(layer);
      else return Status::ok();
    });
  }
  /// Scorer: whether the chosen scorer reads the RoPE arguments (PolicyTraits::reads_rope).
  bool reads_rope() const {
    return visit([](const auto& p) { return policy_traits<std::decay_t<decltype(p)>>::reads_rope; });
  }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    visit([&](const auto& p) { p.score(ctx, out); });
  }

  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out,
              Index threads) const {
    visit([&](const auto& p) {
      if constexpr (policy_traits<std::decay_t<decltype(p)>>::takes_threads)
        p.select(scores, budgets, out, threads);
      else
        p.select(scores, budgets, out);
    });
  }
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out) const {
    select(scores, budgets, out, 1);
  }
  bool shares_positions() const {
    return visit([](const auto& p) { return p.shares_positions(); });
  }

  template <class T>
  void route(const HeadContext<T>& ctx, Routing& routing) const {
    visit([&](const auto& p) { p.route(ctx, routing); });
  }
  /// Router: whether the chosen router routes (is not NoRoute).
  bool routes() const {
    return visit([](const auto& p) { return !std::is_same_v<std::decay_t<decltype(p)>, NoRoute>; });
  }

  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& routing, MergeOutput<compute_t<T>>& out) const {
    visit([&](const auto& p) { p.merge(ctx, routing, out); });
  }
  /// Merger: whether the chosen merger reads Y = A·V (formed in the window stage only then).
  bool needs_window_outputs() const {
    return visit([](const auto& p) { return policy_traits<std::decay_t<decltype(p)>>::needs_window_outputs; });
  }
  /// Merger: whether the chosen merger reads routing.target.
  bool needs_routing() const {
    return visit([](const auto& p) { return policy_traits<std::decay_t<decltype(p)>>::needs_routing; });
  }

  template <class T>
  void compensate(const HeadContext<T>& ctx, const Routing& routing, const MergeOutput<compute_t<T>>& merged,
                  Vector<compute_t<T>>& bias) const {
    visit([&](const auto& p) { p.compensate(ctx, routing, merged, bias); });
  }

  bool keeps_budgets() const {
    return visit([](const auto& p) { return p.keeps_budgets(); });
  }
  template <class Real>
  void allocate(const std::vector<Vector<Real>>& scores, std::vector<Index>& budgets) const {
    visit([&](const auto& p) { p.allocate(scores, budgets); });
  }
};

}  // namespace kvc
