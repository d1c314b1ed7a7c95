#include "server/engine/model_options.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<kernels::DType> ParseDType(std::string_view name) {
  for (const kernels::DType t :
       {kernels::DType::kBf16, kernels::DType::kFp16, kernels::DType::kFp8E4m3}) {
    if (name == kernels::DTypeName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown element type \"", std::string(name), "\" (bf16, fp16 or fp8_e4m3)"));
}

namespace {

// A strict reader of the one JSON object the scales file holds.
class ScalesReader {
 public:
  explicit ScalesReader(std::string_view text) : text_(text) {}

  absl::StatusOr<KvCacheScales> Read() {
    KvCacheScales scales;
    bool seen_k = false, seen_v = false;
    if (!Take('{')) return Error("expected '{'");
    do {
      std::string key;
      if (!String(&key)) return Error("expected a key in quotes");
      if (!Take(':')) return Error("expected ':'");
      std::vector<float>* list = nullptr;
      if (key == "k_scale" && !seen_k) {
        list = &scales.k_scale;
        seen_k = true;
      } else if (key == "v_scale" && !seen_v) {
        list = &scales.v_scale;
        seen_v = true;
      } else {
        return Error(absl::StrCat("unexpected key \"", key, "\" (k_scale and v_scale, once each)"));
      }
      if (absl::Status s = List(list); !s.ok()) return s;
    } while (Take(','));
    if (!Take('}')) return Error("expected ',' or '}'");
    Skip();
    if (pos_ != text_.size()) return Error("text after the object");
    if (!seen_k || !seen_v) return Error("both k_scale and v_scale are needed");
    return scales;
  }

 private:
  void Skip() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Take(char c) {
    Skip();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool String(std::string* out) {
    if (!Take('"')) return false;
    const size_t end = text_.find('"', pos_);
    if (end == std::string_view::npos) return false;
    *out = std::string(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }
  absl::Status List(std::vector<float>* out) {
    if (!Take('[')) return Error("expected '['");
    if (Take(']')) return absl::OkStatus();
    do {
      Skip();
      const std::string rest(text_.substr(pos_, 64));
      char* end = nullptr;
      const double x = std::strtod(rest.c_str(), &end);
      if (end == rest.c_str()) return Error("expected a number");
      pos_ += static_cast<size_t>(end - rest.c_str());
      if (!std::isfinite(x) || !(x > 0.0) || x > 3.0e38) {
        return Error(absl::StrCat("a scale must be finite and > 0, got ", x));
      }
      out->push_back(static_cast<float>(x));
    } while (Take(','));
    if (!Take(']')) return Error("expected ',' or ']'");
    return absl::OkStatus();
  }
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache scales file, at byte ", pos_, ": ", what));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<KvCacheScales> ParseKvCacheScales(std::string_view json, int32_t num_layers) {
  absl::StatusOr<KvCacheScales> scales = ScalesReader(json).Read();
  if (!scales.ok()) return scales.status();
  for (const auto& [name, list] : {std::pair<const char*, const std::vector<float>*>{
                                       "k_scale", &scales->k_scale},
                                   {"v_scale", &scales->v_scale}}) {
    if (static_cast<int32_t>(list->size()) != num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("KV cache scales file: ", name, " has ",
                                                     list->size(), " values for ", num_layers,
                                                     " layers"));
    }
  }
  return scales;
}

}  // namespace pagedattn
