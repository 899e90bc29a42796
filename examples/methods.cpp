// The method registry's one compiled unit: every preset the tool offers is instantiated here only.
#include "methods.hpp"

namespace kvc::cli {

Compressor make_method(const std::string& name, const MethodOptions& o) {
  if (name == "full") return detail::make<FullCache>(o, name);
  if (name == "streaming") return detail::make<StreamingLLM>(o, name);
  if (name == "snapkv") return detail::make<SnapKV>(o, name);
  if (name == "selkv-evict") return detail::make<SelKVEvict>(o, name);
  if (name == "selkv") return detail::make<SelKV>(o, name);
  if (name == "selkv-mergeall") return detail::make<SelKVMergeAll>(o, name);
  if (name == "knorm") return detail::make<KNorm>(o, name);
  if (name == "tova") return detail::make<TOVA>(o, name);
  if (name == "keydiff") return detail::make<KeyDiff>(o, name);
  if (name == "adakv-snapkv") return detail::make<AdaKVSnapKV>(o, name);
  if (name == "adakv-selkv") return detail::make<AdaKVSelKV>(o, name);
  if (name == "grkv") return detail::make<SnapKVGRKV>(o, name);
  if (name == "grkv-selkv") return detail::make<SelKVEvictGRKV>(o, name);
  if (name == "grkv-streaming") return detail::make<StreamingLLMGRKV>(o, name);
  std::string known;
  for (const auto& n : method_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown method '" + name + "' (known: " + known + ")");
}

}  // namespace kvc::cli
