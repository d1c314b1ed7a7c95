#include "client/loadgen/run_state.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace pagedattn::loadgen {

void RunState::CountError(const absl::Status& status) {
  absl::MutexLock lock(&mu);
  ++errors[absl::StatusCodeToString(status.code())];
}

void RunState::Retire(int32_t batch, const absl::Status& why) {
  absl::MutexLock lock(&mu);
  if (!retired_batches.insert(batch).second) return;
  retired.push_back(absl::StrCat("batch ", batch, ": ", why.ToString()));
}

v1::DecodeRequest MakeDecodeRequest(RunState& state, int32_t batch, int32_t layer, uint64_t request_id,
                                    std::vector<int64_t>* tickets) {
  const std::vector<int32_t>& members = state.batches[static_cast<size_t>(batch)];
  const int64_t b = static_cast<int64_t>(members.size());
  v1::DecodeRequest request;
  request.set_request_id(request_id);
  request.set_layer(layer);
  request.set_sm_scale(state.options.sm_scale);
  for (const int32_t s : members) request.add_sequence_ids(state.sequences[static_cast<size_t>(s)].id);
  request.set_q(state.pool->Slice(b * kQueryBytes));
  if (state.options.decode_kv) {
    request.set_k(state.pool->Slice(b * kKvRowBytes));
    request.set_v(state.pool->Slice(b * kKvRowBytes));
  }
  tickets->assign(static_cast<size_t>(b), -1);
  if (state.check != nullptr) {
    for (int64_t i = 0; i < b; ++i) {
      const uint64_t id = state.sequences[static_cast<size_t>(members[static_cast<size_t>(i)])].id;
      if (!state.check->IsSampled(id)) continue;
      const absl::string_view q = absl::string_view(request.q()).substr(i * kQueryBytes, kQueryBytes);
      absl::string_view k, v;
      if (state.options.decode_kv) {
        k = absl::string_view(request.k()).substr(i * kKvRowBytes, kKvRowBytes);
        v = absl::string_view(request.v()).substr(i * kKvRowBytes, kKvRowBytes);
      }
      (*tickets)[static_cast<size_t>(i)] = state.check->OnDecodeSent(id, layer, q, k, v);
    }
  }
  return request;
}

absl::Status TakeDecodeResponse(RunState& state, int32_t batch, int32_t layer,
                                const v1::DecodeResponse& response, const std::vector<int64_t>& tickets) {
  const std::vector<int32_t>& members = state.batches[static_cast<size_t>(batch)];
  const int64_t b = static_cast<int64_t>(members.size());
  if (static_cast<int64_t>(response.output().size()) != b * kQueryBytes ||
      static_cast<int64_t>(response.lse().size()) != b * kLseBytes) {
    return absl::InternalError(absl::StrCat("Decode response of ", response.output().size(), " output and ",
                                            response.lse().size(), " lse bytes for ", b, " sequences"));
  }
  if (state.check != nullptr) {
    for (int64_t i = 0; i < b; ++i) {
      const int64_t ticket = tickets[static_cast<size_t>(i)];
      if (ticket < 0) continue;
      state.check->OnDecodeDone(ticket, absl::string_view(response.output()).substr(i * kQueryBytes, kQueryBytes),
                                absl::string_view(response.lse()).substr(i * kLseBytes, kLseBytes));
    }
  }
  const int64_t extra = state.options.decode_kv ? 1 : 0;
  const bool measuring = state.measuring.load(std::memory_order_relaxed);
  int64_t attended = 0;
  for (const int32_t s : members) {
    Sequence& seq = state.sequences[static_cast<size_t>(s)];
    attended += seq.length + extra;
    if (extra > 0 && layer == state.num_layers - 1) seq.length += 1;
  }
  if (measuring) {
    state.requests_ok.fetch_add(1, std::memory_order_relaxed);
    state.sequence_decodes.fetch_add(b, std::memory_order_relaxed);
    state.attended_tokens.fetch_add(attended, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

void DropFromCheck(RunState& state, int32_t batch) {
  if (state.check == nullptr) return;
  for (const int32_t s : state.batches[static_cast<size_t>(batch)]) {
    state.check->Drop(state.sequences[static_cast<size_t>(s)].id);
  }
}

}  // namespace pagedattn::loadgen
