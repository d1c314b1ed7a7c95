#include "server/backend/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {

absl::StatusOr<char*> Backend::OpenDeviceMemory(std::string_view /*ipc_handle*/,
                                               int32_t /*device_id*/, int64_t /*bytes*/) {
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA memory regions need the CUDA backend; this server runs the ", std::string(name()), " backend"));
}

DecodeBlockLayout DecodeBlockLayout::For(const kernels::Shape& model, int64_t num_sequences,
                                         bool with_kv) {
  const int64_t kv_bytes = with_kv ? num_sequences * model.token_bytes() : 0;
  DecodeBlockLayout l;
  l.k = num_sequences * model.query_bytes();
  l.v = l.k + kv_bytes;
  l.output = l.v + kv_bytes;
  l.lse = l.output + num_sequences * model.query_bytes();
  l.bytes = l.lse + num_sequences * model.lse_bytes();
  return l;
}

namespace k = kernels;

namespace {

// Whether a value lies outside [0, limit). Eight at a time without branches, which the
// compiler turns into vector code at -O2: half the time of a loop that returns at the first
// bad page, for the 4,096 pages of a batch of 64 x 4,096 tokens.
bool AnyOutOfRange(const std::vector<int32_t>& values, int64_t limit) {
  const auto top = static_cast<int32_t>(std::clamp<int64_t>(limit, 0, int64_t{1} << 31) - 1);
  const int32_t* v = values.data();
  const size_t n = values.size();
  int32_t out = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) out |= (v[i + j] < 0) | (v[i + j] > top);
  }
  for (; i < n; ++i) out |= (v[i] < 0) | (v[i] > top);
  return out != 0;
}

}  // namespace

absl::Status ValidatePoolShape(const Backend::PoolShape& shape) {
  if (shape.num_layers <= 0 || shape.num_pages <= 0 || shape.max_batch_size <= 0) {
    return absl::InvalidArgumentError("num_layers, num_pages and max_batch_size must be > 0");
  }
  if (int64_t{shape.num_layers} * shape.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("num_layers * num_pages must fit in int32");
  }
  if (const kernels::KernelStatus s = kernels::ValidateShape(shape.model); !s.ok()) {
    return absl::InvalidArgumentError(s.message);
  }
  for (const std::vector<float>* scales : {&shape.k_scales, &shape.v_scales}) {
    if (!scales->empty() && static_cast<int32_t>(scales->size()) != shape.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("KV cache scales: ", scales->size(),
                                                     " values for ", shape.num_layers, " layers"));
    }
    for (const float x : *scales) {
      if (!std::isfinite(x) || !(x > 0.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV cache scales must be finite and > 0, got ", x));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBatch(const BackendBatch& batch, const Backend::PoolShape& shape) {
  if (absl::Status s = ValidateBatchShape(batch, shape); !s.ok()) return s;
  return ValidatePoolPages(batch, shape);
}

absl::Status ValidateBatchShape(const BackendBatch& batch, const Backend::PoolShape& shape) {
  const int64_t pool_pages = int64_t{shape.num_layers} * shape.num_pages;
  for (const PageCopy& c : batch.page_copies) {
    if (c.src < 0 || c.src >= shape.num_pages || c.dst < 0 || c.dst >= shape.num_pages) {
      return absl::InternalError(absl::StrCat("page copy ", c.src, " -> ", c.dst, " out of range"));
    }
  }
  const int64_t num_slots = pool_pages * shape.model.page_size;
  for (const TokenWrite& w : batch.writes) {
    if (w.num_tokens < 0 || w.slot_begin < 0 ||
        w.slot_begin + w.num_tokens > static_cast<int64_t>(batch.write_slots.size()) ||
        (w.num_tokens > 0 && (w.k == nullptr || w.v == nullptr))) {
      return absl::InternalError("malformed token write");
    }
  }
  for (int64_t s : batch.write_slots) {
    if (s < 0 || s >= num_slots) return absl::InternalError(absl::StrCat("slot ", s, " out of range"));
  }
  const kernels::Plan& plan = batch.plan;
  const int32_t b = plan.batch_size();
  if (b > shape.max_batch_size) {
    return absl::InternalError(absl::StrCat("batch of ", b, " > max_batch_size"));
  }
  if (static_cast<int32_t>(plan.kv_indptr.size()) != b + 1 || plan.kv_indptr[0] != 0 ||
      plan.kv_indptr[b] != static_cast<int64_t>(plan.kv_indices.size()) ||
      static_cast<int32_t>(batch.q.size()) != b || static_cast<int32_t>(batch.output.size()) != b ||
      static_cast<int32_t>(batch.lse.size()) != b) {
    return absl::InternalError("malformed plan");
  }
  for (int32_t i = 0; i < b; ++i) {
    if (plan.kv_indptr[i + 1] < plan.kv_indptr[i] || plan.kv_last_page_len[i] < 1 ||
        plan.kv_last_page_len[i] > shape.model.page_size || batch.q[i] == nullptr ||
        batch.output[i] == nullptr || batch.lse[i] == nullptr) {
      return absl::InternalError("malformed plan");
    }
  }
  if (b > 0 && !(batch.sm_scale > 0.0f)) return absl::InternalError("sm_scale must be > 0");
  return absl::OkStatus();
}

absl::Status ValidatePoolPages(const BackendBatch& batch, const Backend::PoolShape& shape) {
  const int64_t pool_pages = int64_t{shape.num_layers} * shape.num_pages;
  if (AnyOutOfRange(batch.plan.kv_indices, pool_pages)) {
    for (int32_t page : batch.plan.kv_indices) {
      if (page < 0 || page >= pool_pages) {
        return absl::InternalError(absl::StrCat("pool page ", page, " out of range"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
