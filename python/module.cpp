// The Python module `kvcompress`: compress(), Compressor, Result and decode_attention() over numpy
// arrays (and anything numpy.asarray turns into one without a copy, such as CPU torch tensors).
// Inputs are read in place through strided views; the GIL is released while the library runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "runner.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace kvc::python {
namespace {

using cli::BudgetSpec;
using cli::make_runner;
using cli::Runner;

// ---- inputs ---------------------------------------------------------------------------------------

/// An ndarray, or numpy.asarray of an array-like (a CPU torch tensor gives a view of its memory).
py::array as_array(py::handle obj, const char* name) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  if (!py::hasattr(obj, "__array__") && !py::hasattr(obj, "__array_interface__"))
    throw py::type_error(std::string(name) + ": expected a numpy array or a tensor with __array__, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  return py::module_::import("numpy").attr("asarray")(obj);
}

enum class Dtype { f32, f16 };

/// A rank-3 float32/float16 array seen in place: its strides in elements, the last one unit.
struct Input {
  py::array array;  // holds the memory for the duration of the call
  Dtype dtype = Dtype::f32;
  Index shape[3] = {0, 0, 0};
  Index strides[3] = {0, 0, 0};

  template <class T>
  TensorView<const T> view() const {
    return {static_cast<const T*>(array.data()), shape[0], shape[1], shape[2], strides[0], strides[1]};
  }
};

std::string shape_string(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dtype_name(const py::dtype& dt) { return py::str(py::handle(dt)); }

Dtype element_type(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  const bool native = dt.attr("isnative").cast<bool>();
  if (dt.kind() == 'f' && native && dt.itemsize() == 4) return Dtype::f32;
  if (dt.kind() == 'f' && native && dt.itemsize() == 2) return Dtype::f16;
  throw py::value_error(std::string(name) + ": dtype " + dtype_name(dt) +
                        " is not supported: pass float32 or float16 in native byte order (inputs are read in "
                        "place, never converted)");
}

Input input(py::handle obj, const char* name, const char* layout) {
  Input in;
  in.array = as_array(obj, name);
  const py::array& a = in.array;
  if (a.ndim() != 3)
    throw py::value_error(std::string(name) + ": expected 3 dimensions " + layout + ", got shape " + shape_string(a));
  in.dtype = element_type(a, name);
  const py::ssize_t item = a.itemsize();
  if (reinterpret_cast<std::uintptr_t>(a.data()) % static_cast<std::uintptr_t>(item) != 0)
    throw py::value_error(std::string(name) + ": data is not aligned to its " + std::to_string(item) +
                          "-byte elements; pass numpy.require(a, requirements='A')");
  for (int k = 0; k < 3; ++k) {
    in.shape[k] = static_cast<Index>(a.shape(k));
    const py::ssize_t s = a.strides(k);
    if (s < 0)
      throw py::value_error(std::string(name) + ": negative strides (a reversed view) are not supported; pass "
                            "numpy.ascontiguousarray(...)");
    if (s % item != 0)
      throw py::value_error(std::string(name) + ": stride " + std::to_string(s) + " bytes of axis " + std::to_string(k) +
                            " is not a multiple of the element size " + std::to_string(item));
    in.strides[k] = static_cast<Index>(s / item);
  }
  if (in.shape[2] > 1 && in.strides[2] != 1)
    throw py::value_error(std::string(name) + ": the last axis (dim) must be contiguous, got a stride of " +
                          std::to_string(a.strides(2)) + " bytes for " + std::to_string(item) + "-byte elements");
  return in;
}

template <class T>
LayerView<T> layer_of(const Input& k, const Input& v, const Input& q) {
  return {k.view<T>(), v.view<T>(), q.view<T>()};
}

void same_dtype(const Input& a, const char* an, const Input& b, const char* bn) {
  if (a.dtype != b.dtype)
    throw py::value_error(std::string(an) + " and " + bn + " must have the same dtype, got " +
                          dtype_name(a.array.dtype()) + " and " + dtype_name(b.array.dtype()));
}

// ---- options --------------------------------------------------------------------------------------

const char* const kOptionNames =
    "pool, pooling, recent, sinks, bucket, route, selection, alpha, r_max, lambda (or lambda_), lambda_mode, holdout_every, beta, steps, block_size, block_score, "
    "safeguard, reposition, rope_base, threshold, scorer, merger, compensator, allocation, record_merges";

std::string type_name(py::handle v) { return py::str(py::type::of(v).attr("__name__")); }

Index as_int(const std::string& key, py::handle v) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
    throw py::type_error(key + " expects an integer, got " + type_name(v));
  const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!index) {  // e.g. an array of several elements (which has __index__)
    PyErr_Clear();
    throw py::type_error(key + " expects an integer, got " + type_name(v));
  }
  const long long x = PyLong_AsLongLong(index.ptr());
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<Index>(x);
}

double as_number(const std::string& key, py::handle v) {
  if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyIndex_Check(v.ptr()) || py::hasattr(v, "__float__")) ||
      PyUnicode_Check(v.ptr()))
    throw py::type_error(key + " expects a number, got " + type_name(v));
  const double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  if (!std::isfinite(x)) throw py::value_error(key + " expects a finite number, got " + std::to_string(x));
  return x;
}

std::string as_text(const std::string& key, py::handle v) {
  if (!PyUnicode_Check(v.ptr())) throw py::type_error(key + " expects a string, got " + type_name(v));
  return v.cast<std::string>();
}

bool as_flag(const std::string& key, py::handle v) {
  if (!PyBool_Check(v.ptr())) throw py::type_error(key + " expects True or False, got " + type_name(v));
  return v.ptr() == Py_True;
}

/// The layer's output projection W_o (wo=, [D][Hq·d], read by criticalkv) as float32 rows, or none.
using Projection = std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>>;
Projection projection_of(py::handle wo) {
  if (wo.is_none()) return std::nullopt;
  auto w = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(wo);
  if (!w) throw py::type_error("wo: expected a float array [D][Hq*d], got " + type_name(wo));
  if (w.ndim() != 2)
    throw py::value_error("wo: expected shape [D][Hq*d] (rank 2), got rank " + std::to_string(w.ndim()));
  return w;
}
template <class T>
void attach(LayerView<T>& layer, const Projection& w) {
  if (w) layer.output_projection = {w->data(), w->shape(0), w->shape(1), w->shape(1)};
}

/// The CLI's method options from keyword arguments (`--r-max` is r_max); None leaves one unset.
cli::MethodOptions method_options(const py::kwargs& kwargs) {
  cli::MethodOptions o;
  bool has_lambda = false;
  for (const auto& item : kwargs) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (v.is_none()) continue;
    if (key == "pool") o.pool = as_int(key, v);
    else if (key == "recent") o.recent = as_int(key, v);
    else if (key == "sinks") o.sinks = as_int(key, v);
    else if (key == "bucket") o.bucket = as_int(key, v);
    else if (key == "steps") o.steps = as_int(key, v);
    else if (key == "holdout_every") o.holdout_every = as_int(key, v);
    else if (key == "block_size") o.block_size = as_int(key, v);
    else if (key == "block_score") o.block_score = as_text(key, v);
    else if (key == "lambda_mode") o.lambda_mode = as_text(key, v);
    else if (key == "pooling") o.pooling = as_text(key, v);
    else if (key == "route") o.route = as_text(key, v);
    else if (key == "selection") o.selection = as_text(key, v);
    else if (key == "scorer") o.scorer = as_text(key, v);
    else if (key == "merger") o.merger = as_text(key, v);
    else if (key == "compensator") o.compensator = as_text(key, v);
    else if (key == "allocation") o.allocation = as_text(key, v);
    else if (key == "alpha") o.alpha = as_number(key, v);
    else if (key == "r_max") o.r_max = as_number(key, v);
    else if (key == "threshold") o.threshold = as_number(key, v);
    else if (key == "beta") o.beta = as_number(key, v);
    else if (key == "lambda" || key == "lambda_") {
      if (has_lambda) throw py::type_error("give either lambda or lambda_, not both");
      has_lambda = true;
      o.lambda = as_number(key, v);
    } else if (key == "safeguard") o.safeguard = as_flag(key, v);
    else if (key == "reposition") o.reposition = as_flag(key, v);
    else if (key == "rope_base") o.rope_base = as_number(key, v);
    else if (key == "record_merges") o.record_merges = as_flag(key, v);
    else throw py::type_error("unknown option '" + key + "' (options: " + kOptionNames + ")");
  }
  return o;
}

Index thread_count(py::handle v) {
  const Index t = as_int("threads", v);
  if (t < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(t));
  return t;
}

/// ratio=, or budget= (one count, or one per KV head); neither gives the CLI's default ratio 0.25.
BudgetSpec budget_spec(py::handle ratio, py::handle budget) {
  BudgetSpec b;
  if (!ratio.is_none() && !budget.is_none()) throw py::value_error("give either ratio or budget, not both");
  if (!budget.is_none()) {
    if (py::isinstance<py::array>(budget) && py::reinterpret_borrow<py::array>(budget).ndim() == 1) {
      b.per_head = true;
      for (const auto& x : budget.attr("tolist")()) b.budgets.push_back(as_int("budget", x));
    } else if (PyIndex_Check(budget.ptr()) || PyBool_Check(budget.ptr())) {
      b.budget = Budget::tokens(as_int("budget", budget));
    } else if (py::isinstance<py::sequence>(budget) && !PyUnicode_Check(budget.ptr())) {
      b.per_head = true;
      for (const auto& x : py::reinterpret_borrow<py::sequence>(budget)) b.budgets.push_back(as_int("budget", x));
    } else {
      throw py::type_error("budget expects an integer or a sequence of integers (one per KV head), got " + type_name(budget));
    }
  } else if (!ratio.is_none()) {
    b.budget = Budget::ratio(as_number("ratio", ratio));
  }
  return b;
}

// ---- results --------------------------------------------------------------------------------------

/// A compressed layer and the numpy arrays made from it. A Compressor keeps one and overwrites it on
/// each call (its arrays too, when the shapes repeat); generation tells a Result whether it is current.
struct Store {
  LayerResult<float> result;
  Index tokens = 0;  // n of the input
  Index dim = 0;
  bool merges = false;  // the run recorded merge maps (record_merges=True)
  std::uint64_t generation = 0;
  enum Field { kPositions, kKeys, kValues, kBias, kLengths, kFields };
  py::object arrays[kFields];
  std::uint64_t filled[kFields] = {~0ull, ~0ull, ~0ull, ~0ull, ~0ull};
};

class Result {
 public:
  explicit Result(std::shared_ptr<Store> store) : store_(std::move(store)), generation_(store_->generation) {}

  py::array positions() {
    return field<std::int64_t>(Store::kPositions, {heads(), width()}, [&](std::int64_t* p) {
      for (Index g = 0; g < heads(); ++g) {
        const auto& h = res().heads[g];
        for (Index i = 0; i < width(); ++i) p[g * width() + i] = i < h.size() ? h.positions[i] : -1;
      }
    });
  }
  py::array keys() { return rows(Store::kKeys, false); }
  py::array values() { return rows(Store::kValues, true); }
  py::array bias() {
    return field<float>(Store::kBias, {heads(), width()}, [&](float* p) {
      for (Index g = 0; g < heads(); ++g) {
        const auto& h = res().heads[g];
        for (Index i = 0; i < width(); ++i) p[g * width() + i] = i < h.size() ? h.bias[i] : 0.0f;
      }
    });
  }
  py::array lengths() {
    return field<std::int64_t>(Store::kLengths, {heads()}, [&](std::int64_t* p) {
      for (Index g = 0; g < heads(); ++g) p[g] = res().heads[g].size();
    });
  }
  Index next_position() { return res().next_position; }
  bool shared_positions() { return res().shared_positions; }
  Index tokens() {
    check();
    return store_->tokens;
  }

  /// Per-head diagnostics: one numpy array of length Hkv per field of kvc::HeadDiagnostics.
  py::dict diagnostics() {
    const auto& hs = res().heads;
    const Index H = heads();
    py::array_t<std::int64_t> kept(H), evicted(H), merged(H), dropped(H), cg_iterations(H);
    py::array_t<double> gate_mean(H), before(H), after(H), residual(H);
    py::array_t<bool> key_rejected(H), value_rejected(H);
    py::list status;
    for (Index g = 0; g < H; ++g) {
      const HeadDiagnostics& d = hs[g].diagnostics;
      kept.mutable_at(g) = d.kept;
      evicted.mutable_at(g) = d.evicted;
      merged.mutable_at(g) = d.merged;
      dropped.mutable_at(g) = d.dropped;
      cg_iterations.mutable_at(g) = d.cg_iterations;
      gate_mean.mutable_at(g) = d.gate_mean;
      before.mutable_at(g) = d.window_error_before;
      after.mutable_at(g) = d.window_error_after;
      residual.mutable_at(g) = d.cg_residual;
      key_rejected.mutable_at(g) = d.key_step_rejected;
      value_rejected.mutable_at(g) = d.value_step_rejected;
      status.append(to_string(d.cg_status));
    }
    py::dict out;
    out["kept"] = kept;
    out["evicted"] = evicted;
    out["merged"] = merged;
    out["dropped"] = dropped;
    out["gate_mean"] = gate_mean;
    out["window_error_before"] = before;
    out["window_error_after"] = after;
    out["cg_iterations"] = cg_iterations;
    out["cg_residual"] = residual;
    out["cg_status"] = py::module_::import("numpy").attr("array")(status);
    out["key_step_rejected"] = key_rejected;
    out["value_step_rejected"] = value_rejected;
    return out;
  }

  /// Where each head's evicted entries went (record_merges=True): per KV head, in ascending position,
  /// each evicted entry's position, the kept position it was routed to (-1: not routed) and its gate,
  /// padded to the longest head with -1, -1 and 0; "count" holds each head's number of entries.
  py::dict merges() {
    const auto& hs = res().heads;
    if (!store_->merges)
      throw py::value_error("this result has no merge maps: pass record_merges=True to compress or Compressor");
    const Index H = heads();
    std::size_t e = 0;
    for (const auto& h : hs) e = std::max(e, h.merges.evicted.size());
    const auto E = static_cast<py::ssize_t>(e);
    py::array_t<std::int64_t> evicted({H, E}), target({H, E}), count(H);
    py::array_t<float> gate({H, E});
    for (Index g = 0; g < H; ++g) {
      const MergeMap<float>& mm = hs[g].merges;
      count.mutable_at(g) = static_cast<std::int64_t>(mm.evicted.size());
      for (py::ssize_t i = 0; i < E; ++i) {
        const bool in = static_cast<std::size_t>(i) < mm.evicted.size();
        evicted.mutable_at(g, i) = in ? mm.evicted[static_cast<std::size_t>(i)] : -1;
        target.mutable_at(g, i) = in ? mm.target[static_cast<std::size_t>(i)] : -1;
        gate.mutable_at(g, i) = in ? mm.gate[static_cast<std::size_t>(i)] : 0.0f;
      }
    }
    py::dict out;
    out["evicted"] = evicted;
    out["target"] = target;
    out["gate"] = gate;
    out["count"] = count;
    return out;
  }

  std::string repr() {
    if (store_->generation != generation_) return "<kvcompress.Result overwritten by a later Compressor call>";
    return "<kvcompress.Result: " + std::to_string(heads()) + " KV heads, kept " + std::to_string(width()) + " of " +
           std::to_string(store_->tokens) + " tokens, next_position " + std::to_string(res().next_position) + ">";
  }

 private:
  void check() const {
    if (store_->generation != generation_)
      throw std::runtime_error(
          "this Result was overwritten by a later call of its Compressor (a Compressor keeps one result); "
          "copy the arrays you keep, e.g. numpy.copy(result.keys), before calling it again");
  }
  const LayerResult<float>& res() const {
    check();
    return store_->result;
  }
  Index heads() const { return static_cast<Index>(res().heads.size()); }
  Index width() const { return res().max_size(); }

  /// The array of a field: filled once per generation, into the Store's array when its shape matches.
  template <class Scalar, class Fill>
  py::array field(Store::Field f, std::vector<py::ssize_t> shape, Fill&& fill) {
    check();
    py::object& slot = store_->arrays[f];
    if (store_->filled[f] == generation_) return slot;
    bool reuse = slot && py::isinstance<py::array_t<Scalar>>(slot);
    if (reuse) {
      const py::array a = slot;
      reuse = a.ndim() == static_cast<py::ssize_t>(shape.size()) && std::equal(shape.begin(), shape.end(), a.shape());
    }
    if (!reuse) slot = py::array_t<Scalar>(shape);
    auto arr = py::reinterpret_borrow<py::array_t<Scalar>>(slot);
    fill(arr.mutable_data());
    store_->filled[f] = generation_;
    return slot;
  }

  py::array rows(Store::Field f, bool values) {
    const Index d = store_->dim;
    return field<float>(f, {heads(), width(), d}, [&](float* p) {
      const Index w = width();
      for (Index g = 0; g < heads(); ++g) {
        const auto& h = res().heads[g];
        const RowMatrix<float>& M = values ? h.values : h.keys;
        float* dst = p + g * w * d;
        if (M.cols() != d || M.rows() < h.size())
          throw std::runtime_error("kvcompress: a head's result matrix has an unexpected shape");
        std::memcpy(dst, M.data(), sizeof(float) * static_cast<std::size_t>(h.size() * d));  // row-major (m_g, d)
        std::memset(dst + h.size() * d, 0, sizeof(float) * static_cast<std::size_t>((w - h.size()) * d));
      }
    });
  }

  std::shared_ptr<Store> store_;
  std::uint64_t generation_;
};

// ---- compress and Compressor -----------------------------------------------------------------------

struct LayerInputs {
  Input keys, values, queries;
};

LayerInputs layer_inputs(py::handle keys, py::handle values, py::handle queries) {
  LayerInputs in{input(keys, "keys", "[Hkv][n][d]"), input(values, "values", "[Hkv][n][d]"),
                 input(queries, "queries", "[Hq][W][d]")};
  same_dtype(in.keys, "keys", in.values, "values");
  same_dtype(in.keys, "keys", in.queries, "queries");
  return in;
}

/// compress()'s library result and workspace, one per thread, reused from call to call: the library
/// writes the kept rows into memory it already holds, and only the numpy arrays of the keys and values
/// are new. New pages cost far more than rewriting held ones (docs/performance.md, "One-shot calls pay
/// for fresh pages"). release_buffers() frees them.
struct CallScratch {
  LayerResult<float> result;
  Workspace<float> ws;
};
CallScratch& call_scratch() {
  static thread_local CallScratch scratch;
  return scratch;
}

/// compress(); with `seconds`, the time of the library call alone (python/bench_overhead.py). With
/// `one_shot`, the library's one-shot run(layer, budget) instead, which returns its result in new memory
/// (the C++ call that compress stands for; the same bits).
Result compress_impl(py::handle keys, py::handle values, py::handle queries, const std::string& method,
                     py::handle ratio, py::handle budget, py::handle threads, py::handle wo, const py::kwargs& kwargs,
                     double* seconds, bool one_shot = false) {
  const LayerInputs in = layer_inputs(keys, values, queries);
  const Projection w = projection_of(wo);
  const cli::MethodOptions options = method_options(kwargs);
  const Index t = thread_count(threads);
  const BudgetSpec b = budget_spec(ratio, budget);
  auto store = std::make_shared<Store>();
  store->tokens = in.keys.shape[1];
  store->dim = in.keys.shape[2];
  store->merges = options.record_merges;
  CallScratch& scratch = call_scratch();
  const auto run = [&](const auto& runner, auto layer) {
    attach(layer, w);
    py::gil_scoped_release nogil;
    const auto t0 = std::chrono::steady_clock::now();
    if (one_shot) store->result = runner->run(layer, b);
    else runner->run(layer, b, scratch.result, scratch.ws);
    if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (in.keys.dtype == Dtype::f32)
    run(make_runner<float>(method, options, t), layer_of<float>(in.keys, in.values, in.queries));
  else
    run(make_runner<Eigen::half>(method, options, t), layer_of<Eigen::half>(in.keys, in.values, in.queries));
  if (one_shot) return Result(std::move(store));
  // The result moves to the Store; its keys and values become numpy arrays now, and their row
  // buffers go back to the scratch for the next call.
  std::swap(store->result, scratch.result);
  Result r(store);
  r.keys();
  r.values();
  scratch.result.heads.resize(store->result.heads.size());
  for (std::size_t g = 0; g < store->result.heads.size(); ++g) {
    scratch.result.heads[g].keys.swap(store->result.heads[g].keys);
    scratch.result.heads[g].values.swap(store->result.heads[g].values);
  }
  return r;
}

Result compress(py::handle keys, py::handle values, py::handle queries, const std::string& method, py::handle ratio,
                py::handle budget, py::handle threads, py::handle wo, const py::kwargs& kwargs) {
  return compress_impl(keys, values, queries, method, ratio, budget, threads, wo, kwargs, nullptr);
}

py::tuple compress_timed(py::handle keys, py::handle values, py::handle queries, const std::string& method,
                         py::handle ratio, py::handle budget, py::handle threads, py::handle wo, bool one_shot,
                         const py::kwargs& kwargs) {
  double seconds = 0;
  Result r = compress_impl(keys, values, queries, method, ratio, budget, threads, wo, kwargs, &seconds, one_shot);
  return py::make_tuple(std::move(r), seconds);
}

/// Frees compress()'s per-thread buffers (CallScratch) of the calling thread.
void release_buffers() { call_scratch() = CallScratch(); }

/// A method with its options, its result and its workspace kept from call to call: with repeating
/// shapes and one thread, the library call allocates no more after the first than the C++ preset's
/// reused run(layer, budget, out, ws) does, and the result's arrays are refilled in place.
class Compressor {
 public:
  Compressor(const std::string& method, py::handle threads, const py::kwargs& kwargs)
      : method_(method), threads_(thread_count(threads)), store_(std::make_shared<Store>()) {
    const cli::MethodOptions options = method_options(kwargs);
    store_->merges = options.record_merges;
    f32_ = make_runner<float>(method, options, threads_);
    f16_ = make_runner<Eigen::half>(method, options, threads_);
  }

  Result compress(py::handle keys, py::handle values, py::handle queries, py::handle ratio, py::handle budget,
                  py::handle wo) {
    const LayerInputs in = layer_inputs(keys, values, queries);
    const Projection w = projection_of(wo);
    const BudgetSpec b = budget_spec(ratio, budget);
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock())
      throw std::runtime_error("this Compressor is running in another thread: use one Compressor per thread");
    ++store_->generation;  // earlier Results are stale from here on, whether or not this call succeeds
    store_->tokens = in.keys.shape[1];
    store_->dim = in.keys.shape[2];
    if (in.keys.dtype == Dtype::f32) {
      auto layer = layer_of<float>(in.keys, in.values, in.queries);
      attach(layer, w);
      py::gil_scoped_release nogil;
      f32_->run(layer, b, store_->result, ws_);
    } else {
      auto layer = layer_of<Eigen::half>(in.keys, in.values, in.queries);
      attach(layer, w);
      py::gil_scoped_release nogil;
      f16_->run(layer, b, store_->result, ws_);
    }
    return Result(store_);
  }

  const std::string& method() const { return method_; }
  Index threads() const { return threads_; }
  std::size_t workspace_bytes() const { return ws_.bytes(); }

 private:
  std::string method_;
  Index threads_;
  std::unique_ptr<Runner<float>> f32_;
  std::unique_ptr<Runner<Eigen::half>> f16_;
  Workspace<float> ws_;
  std::shared_ptr<Store> store_;
  std::mutex busy_;
};

// ---- decode attention ------------------------------------------------------------------------------

/// out[h] = softmax(scale·q_h·K_gᵀ + bias_g)·V_g over the first lengths[g] entries of KV head g = h / G.
template <class T>
void decode_heads(const RowMatrix<float>& q, const Input& keys, const Input& values, const float* bias, Index bias_len,
                  Index bias_stride, const std::vector<Index>& lengths, const AttentionArguments& args, float* out) {
  const TensorView<const T> K = keys.view<T>(), V = values.view<T>();
  const Index H = K.heads, d = K.dim, G = q.rows() / H;
  RowMatrix<float> qg(G, d), og(G, d);
  for (Index g = 0; g < H; ++g) {
    const Index len = lengths[static_cast<std::size_t>(g)];
    const TensorView<const T> kg{K.row(g, 0), 1, len, d, K.head_stride, K.token_stride};
    const TensorView<const T> vg{V.row(g, 0), 1, len, d, V.head_stride, V.token_stride};
    const BiasView<float> bg{bias ? bias + g * bias_stride : nullptr, 1, std::min(bias_len, len), bias_stride};
    qg = q.middleRows(g * G, G);
    decode_attention(qg, kg, vg, bg, args, og);
    std::memcpy(out + g * G * d, og.data(), sizeof(float) * static_cast<std::size_t>(G * d));
  }
}

py::array decode(py::handle q_obj, py::handle keys_obj, py::handle values_obj, py::handle bias_obj,
                 py::handle lengths_obj, double scale, double softcap) {
  const Input keys = input(keys_obj, "keys", "[Hkv][t][d]"), values = input(values_obj, "values", "[Hkv][t][d]");
  same_dtype(keys, "keys", values, "values");
  const Index H = keys.shape[0], t = keys.shape[1], d = keys.shape[2];
  if (values.shape[0] != H || values.shape[1] != t || values.shape[2] != d)
    throw py::value_error("values: shape " + shape_string(values.array) + " differs from keys " + shape_string(keys.array));
  if (H <= 0 || t <= 0 || d <= 0)
    throw py::value_error("keys: every dimension must be positive, got shape " + shape_string(keys.array));
  const py::array q_in = as_array(q_obj, "q");
  if (q_in.ndim() != 2) throw py::value_error("q: expected 2 dimensions [Hq][d], got shape " + shape_string(q_in));
  element_type(q_in, "q");
  const auto q_arr = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(q_in);
  const Index Hq = q_arr.shape(0);
  if (q_arr.shape(1) != d)
    throw py::value_error("q has " + std::to_string(q_arr.shape(1)) + " columns, keys.dim = " + std::to_string(d));
  if (Hq <= 0 || Hq % H != 0)
    throw py::value_error("query heads (" + std::to_string(Hq) + ") must be a positive multiple of KV heads (" +
                          std::to_string(H) + ")");
  const RowMatrix<float> q = Eigen::Map<const RowMatrix<float>>(q_arr.data(), Hq, d);

  py::array_t<float, py::array::c_style | py::array::forcecast> bias;
  Index bias_len = 0;
  if (!bias_obj.is_none()) {
    const py::array b_in = as_array(bias_obj, "bias");
    if (b_in.ndim() != 2 || b_in.shape(0) != H)
      throw py::value_error("bias: expected shape [Hkv][m] with Hkv = " + std::to_string(H) + ", got " + shape_string(b_in));
    if (b_in.shape(1) > t)
      throw py::value_error("bias has " + std::to_string(b_in.shape(1)) + " entries per head, more than the " +
                            std::to_string(t) + " of keys");
    bias = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(b_in);
    if (!bias) throw py::error_already_set();
    bias_len = b_in.shape(1);
  }
  std::vector<Index> lengths(static_cast<std::size_t>(H), t);
  if (!lengths_obj.is_none()) {
    const py::list l = py::module_::import("numpy").attr("asarray")(lengths_obj).attr("tolist")();
    if (static_cast<Index>(l.size()) != H)
      throw py::value_error("lengths: expected " + std::to_string(H) + " entries (one per KV head), got " +
                            std::to_string(l.size()));
    for (Index g = 0; g < H; ++g) {
      const Index len = as_int("lengths", l[static_cast<std::size_t>(g)]);
      if (len < 1 || len > t)
        throw py::value_error("lengths[" + std::to_string(g) + "] = " + std::to_string(len) + " is outside [1, " +
                              std::to_string(t) + "]");
      lengths[static_cast<std::size_t>(g)] = len;
    }
  }
  AttentionArguments args;
  args.scale = scale;
  args.softcap = softcap;
  py::array_t<float> out({Hq, d});
  float* o = out.mutable_data();
  const float* b = bias ? bias.data() : nullptr;
  {
    py::gil_scoped_release nogil;
    if (keys.dtype == Dtype::f32) decode_heads<float>(q, keys, values, b, bias_len, bias_len, lengths, args, o);
    else decode_heads<Eigen::half>(q, keys, values, b, bias_len, bias_len, lengths, args, o);
  }
  return out;
}

}  // namespace
}  // namespace kvc::python

PYBIND11_MODULE(kvcompress, m) {
  using namespace kvc::python;
  m.doc() = "KV-cache compression (SelKV, GRKV, SnapKV, StreamingLLM, KNorm) over numpy arrays and torch tensors.";
  m.attr("__version__") = kvc::version_string();
  m.attr("methods") = kvc::cli::method_names();

  py::class_<Result>(m, "Result", "A compressed layer: positions, keys, values, bias, lengths, diagnostics.")
      .def_property_readonly("positions", &Result::positions, "int64 [Hkv][m]: kept original positions, ascending (-1 pads a shorter head)")
      .def_property_readonly("keys", &Result::keys, "float32 [Hkv][m][d]: compressed keys (zeros pad a shorter head)")
      .def_property_readonly("values", &Result::values, "float32 [Hkv][m][d]: compressed values")
      .def_property_readonly("bias", &Result::bias, "float32 [Hkv][m]: additive decode-time logit bias")
      .def_property_readonly("lengths", &Result::lengths, "int64 [Hkv]: entries kept per KV head")
      .def_property_readonly("next_position", &Result::next_position, "RoPE position of the next token (n, or m when repositioned)")
      .def_property_readonly("shared_positions", &Result::shared_positions, "every head kept the same positions")
      .def_property_readonly("tokens", &Result::tokens, "n, the tokens of the input")
      .def_property_readonly("diagnostics", &Result::diagnostics, "per-head diagnostics: a dict of arrays of length Hkv")
      .def_property_readonly("merges", &Result::merges,
                             "with record_merges=True: where evicted entries went, a dict of [Hkv][e] arrays evicted,\n"
                             "target (-1: not routed) and gate, padded with -1, -1, 0; count [Hkv]")
      .def("__repr__", &Result::repr);

  m.def("compress", &compress, py::arg("keys"), py::arg("values"), py::arg("queries"), py::arg("method") = "selkv",
        py::kw_only(), py::arg("ratio") = py::none(), py::arg("budget") = py::none(), py::arg("threads") = 1,
        py::arg("wo") = py::none(),
        "Compresses one layer: keys, values [Hkv][n][d], queries [Hq][W][d] (float32 or float16, any strides).\n"
        "ratio= or budget= (an int, or one per KV head); options as the CLI's (r_max for --r-max);\n"
        "wo= the layer's output projection [D][Hq*d] (criticalkv, critical-adakv).");

  m.def("_compress_timed", &compress_timed, py::arg("keys"), py::arg("values"), py::arg("queries"),
        py::arg("method") = "selkv", py::kw_only(), py::arg("ratio") = py::none(), py::arg("budget") = py::none(),
        py::arg("threads") = 1, py::arg("wo") = py::none(), py::arg("one_shot") = false,
        "As compress; returns (result, seconds of the library call alone), for python/bench_overhead.py.\n"
        "one_shot=True calls the library's one-shot run(layer, budget) (new memory) instead.");

  m.def("release_buffers", &release_buffers,
        "Frees the buffers compress() keeps for the calling thread between calls (the library's result rows\n"
        "and workspace of its last call); the next call allocates them again.");

  py::class_<Compressor>(m, "Compressor", "A method with its options; keeps its result and workspace between calls.")
      .def(py::init<const std::string&, py::handle, const py::kwargs&>(), py::arg("method") = "selkv", py::kw_only(),
           py::arg("threads") = 1)
      .def("compress", &Compressor::compress, py::arg("keys"), py::arg("values"), py::arg("queries"), py::kw_only(),
           py::arg("ratio") = py::none(), py::arg("budget") = py::none(), py::arg("wo") = py::none(),
           "As kvcompress.compress; the Result is overwritten by the next call.")
      .def_property_readonly("method", &Compressor::method)
      .def_property_readonly("threads", &Compressor::threads)
      .def_property_readonly("workspace_bytes", &Compressor::workspace_bytes);

  m.def("decode_attention", &decode, py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("bias") = py::none(),
        py::arg("lengths") = py::none(), py::kw_only(), py::arg("scale") = 0.0, py::arg("softcap") = 0.0,
        "One decode step: q [Hq][d] over keys, values [Hkv][t][d] (the first lengths[g] entries of head g),\n"
        "bias [Hkv][m] added to the logits of the first m entries. Returns float32 [Hq][d].");
}
