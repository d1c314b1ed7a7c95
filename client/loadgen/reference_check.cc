#include "client/loadgen/reference_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <numeric>

#include "pagedattn/kernels/decode.h"

namespace pagedattn::loadgen {
namespace {

namespace k = ::pagedattn::kernels;

// The scale of `layer` in a per-layer list; 1 when there is none.
float ScaleOf(const std::vector<float>& scales, int32_t layer) {
  return static_cast<size_t>(layer) < scales.size() ? scales[static_cast<size_t>(layer)] : 1.0f;
}

}  // namespace

Json ReferenceCheck::Result::ToJson(const Options& options) const {
  Json j = Json::Object();
  j.Set("enabled", true);
  j.Set("passed", passed);
  j.Set("sequences", sequences);
  j.Set("decodes_checked", decodes_checked);
  j.Set("failures", failures);
  j.Set("missing", missing);
  j.Set("max_output_rel_l2", max_rel_l2);
  j.Set("max_lse_abs_err", max_lse_abs);
  Json tol = Json::Object();
  tol.Set("output_rel_l2", options.max_rel_l2);
  tol.Set("lse_abs", options.max_lse_abs);
  j.Set("tolerance", std::move(tol));
  j.Set("reference", "kernels::DecodeReferenceF64");
  return j;
}

void ReferenceCheck::Sample(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  Stored& s = stored_[sequence_id];
  s.k.resize(static_cast<size_t>(options_.num_layers));
  s.v.resize(static_cast<size_t>(options_.num_layers));
}

bool ReferenceCheck::IsSampled(uint64_t sequence_id) const {
  absl::MutexLock lock(&mu_);
  return stored_.count(sequence_id) > 0;
}

void ReferenceCheck::Store(absl::string_view bytes, float scale, std::string* to) const {
  const k::Shape& shape = options_.shape;
  const int64_t rows = static_cast<int64_t>(bytes.size()) / shape.token_bytes();
  const size_t at = to->size();
  to->resize(at + static_cast<size_t>(rows * shape.kv_token_bytes()));
  if (rows > 0) k::StoreKvValues(shape, bytes.data(), to->data() + at, rows * shape.token_elems(), scale);
}

void ReferenceCheck::OnAppend(uint64_t sequence_id, int32_t layer, absl::string_view kb,
                              absl::string_view vb) {
  absl::MutexLock lock(&mu_);
  auto it = stored_.find(sequence_id);
  if (it == stored_.end() || !it->second.active || layer < 0 || layer >= options_.num_layers) return;
  Store(kb, ScaleOf(options_.k_scales, layer), &it->second.k[static_cast<size_t>(layer)]);
  Store(vb, ScaleOf(options_.v_scales, layer), &it->second.v[static_cast<size_t>(layer)]);
}

int64_t ReferenceCheck::OnDecodeSent(uint64_t sequence_id, int32_t layer, absl::string_view q,
                                     absl::string_view kb, absl::string_view vb) {
  absl::MutexLock lock(&mu_);
  auto it = stored_.find(sequence_id);
  if (it == stored_.end() || !it->second.active || layer < 0 || layer >= options_.num_layers) return -1;
  std::string& k_rows = it->second.k[static_cast<size_t>(layer)];
  Store(kb, ScaleOf(options_.k_scales, layer), &k_rows);
  Store(vb, ScaleOf(options_.v_scales, layer), &it->second.v[static_cast<size_t>(layer)]);
  if (options_.max_decodes <= 0 || seen_++ % stride_ != 0) return -1;
  if (static_cast<int64_t>(kept_.size()) >= options_.max_decodes) {
    bool erase = true;
    for (auto t = kept_.begin(); t != kept_.end();) {
      t = erase ? kept_.erase(t) : std::next(t);
      erase = !erase;
    }
    stride_ *= 2;
  }
  Kept kept;
  kept.sequence_id = sequence_id;
  kept.layer = layer;
  kept.tokens = static_cast<int64_t>(k_rows.size()) / options_.shape.kv_token_bytes();
  kept.q = std::string(q);
  const int64_t ticket = next_ticket_++;
  kept_.emplace(ticket, std::move(kept));
  return ticket;
}

void ReferenceCheck::OnDecodeDone(int64_t ticket, absl::string_view output, absl::string_view lse) {
  absl::MutexLock lock(&mu_);
  auto it = kept_.find(ticket);
  if (it == kept_.end()) return;  // let go when the check thinned its decodes
  Kept& kept = it->second;
  if (kept.abandoned) return;
  kept.output = std::string(output);
  kept.lse.resize(lse.size() / 4);
  std::memcpy(kept.lse.data(), lse.data(), kept.lse.size() * 4);
  kept.done = true;
}

void ReferenceCheck::Drop(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = stored_.find(sequence_id);
  if (it == stored_.end()) return;
  it->second.active = false;
  for (auto& [ticket, kept] : kept_) {
    if (kept.sequence_id == sequence_id && !kept.done) kept.abandoned = true;
  }
}

ReferenceCheck::Result ReferenceCheck::Verify() {
  absl::MutexLock lock(&mu_);
  const k::Shape& shape = options_.shape;
  Result result;
  result.sequences = static_cast<int64_t>(stored_.size());
  std::vector<double> ref_out(static_cast<size_t>(shape.query_elems())),
      ref_lse(static_cast<size_t>(shape.num_qo_heads));
  std::string padded_k, padded_v;
  for (const auto& [ticket, kept] : kept_) {
    if (kept.abandoned) continue;
    if (!kept.done || static_cast<int64_t>(kept.output.size()) != shape.query_bytes() ||
        kept.lse.size() != static_cast<size_t>(shape.num_qo_heads) ||
        static_cast<int64_t>(kept.q.size()) != shape.query_bytes()) {
      ++result.missing;
      continue;
    }
    const Stored& s = stored_.at(kept.sequence_id);
    const std::string& k_rows = s.k[static_cast<size_t>(kept.layer)];
    const std::string& v_rows = s.v[static_cast<size_t>(kept.layer)];
    // A contiguous cache of the sequence's first `tokens` tokens: pages 0..P-1 in order.
    const int64_t tokens = kept.tokens;
    const int64_t pages = shape.pages_for(tokens);
    const size_t used = static_cast<size_t>(tokens * shape.kv_token_bytes());
    padded_k.assign(static_cast<size_t>(std::max<int64_t>(pages, 1) * shape.page_bytes()), '\0');
    padded_v.assign(padded_k.size(), '\0');
    std::copy_n(k_rows.begin(), used, padded_k.begin());
    std::copy_n(v_rows.begin(), used, padded_v.begin());
    std::vector<int32_t> indices(static_cast<size_t>(pages));
    std::iota(indices.begin(), indices.end(), 0);
    const int32_t indptr[2] = {0, static_cast<int32_t>(pages)};
    const int32_t last_len = tokens == 0 ? 0 : static_cast<int32_t>(tokens - (pages - 1) * shape.page_size);

    k::DecodeArgs args;
    args.q = kept.q.data();
    args.k_cache = padded_k.data();
    args.v_cache = padded_v.data();
    args.kv_indptr = indptr;
    args.kv_indices = indices.data();
    args.kv_last_page_len = &last_len;
    args.batch_size = 1;
    args.num_pages = std::max<int64_t>(pages, 1);
    // The server's own default: 1 / sqrt(head_dim) in double, rounded to float.
    args.sm_scale = options_.sm_scale > 0 ? options_.sm_scale
                                          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
    args.shape = shape;
    if (shape.kv_dtype == k::DType::kFp8E4m3) {
      args.k_scale = ScaleOf(options_.k_scales, kept.layer);
      args.v_scale = ScaleOf(options_.v_scales, kept.layer);
    }
    k::DecodeReferenceF64(args, ref_out.data(), ref_lse.data());

    double diff2 = 0, ref2 = 0;
    for (int64_t i = 0; i < shape.query_elems(); ++i) {
      const double got = k::LoadElem(shape.dtype, kept.output.data(), i);
      const double want = ref_out[static_cast<size_t>(i)];
      diff2 += (got - want) * (got - want);
      ref2 += want * want;
    }
    const double rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    double lse_err = 0;
    for (int32_t h = 0; h < shape.num_qo_heads; ++h) {
      const double want = ref_lse[static_cast<size_t>(h)];
      const double got = kept.lse[static_cast<size_t>(h)];
      const double err = (std::isinf(want) && std::isinf(got) && (want < 0) == (got < 0))
                             ? 0.0
                             : std::fabs(got - want);
      lse_err = std::max(lse_err, std::isnan(err) ? INFINITY : err);
    }
    ++result.decodes_checked;
    result.max_rel_l2 = std::max(result.max_rel_l2, std::isnan(rel_l2) ? INFINITY : rel_l2);
    result.max_lse_abs = std::max(result.max_lse_abs, lse_err);
    if (!(rel_l2 < options_.max_rel_l2) || !(lse_err < options_.max_lse_abs)) ++result.failures;
  }
  result.passed = result.decodes_checked > 0 && result.failures == 0;
  return result;
}

}  // namespace pagedattn::loadgen
