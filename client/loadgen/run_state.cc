#include "client/loadgen/run_state.h"

#include <algorithm>
#include <cstring>
#include <string>

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
                                    std::vector<int64_t>* tickets, int32_t slot) {
  const std::vector<int32_t>& members = state.batches[static_cast<size_t>(batch)];
  const int64_t b = static_cast<int64_t>(members.size());
  const int64_t q_bytes = state.shape.query_bytes(), row_bytes = state.shape.token_bytes();
  v1::DecodeRequest request;
  request.set_request_id(request_id);
  request.set_layer(layer);
  request.set_sm_scale(state.options.sm_scale);
  for (const int32_t s : members) request.add_sequence_ids(state.sequences[static_cast<size_t>(s)].id);
  const bool by_ref = state.slots != nullptr;
  if (by_ref) {
    state.slots->Refer(slot, b, state.options.decode_kv, &request);
  } else {
    request.set_q(state.pool->Slice(b * q_bytes));
    if (state.options.decode_kv) {
      request.set_k(state.pool->Slice(b * row_bytes));
      request.set_v(state.pool->Slice(b * row_bytes));
    }
  }
  const absl::string_view all_q = by_ref ? state.slots->Q(slot, b) : absl::string_view(request.q());
  const absl::string_view all_k = by_ref ? state.slots->K(slot, b) : absl::string_view(request.k());
  const absl::string_view all_v = by_ref ? state.slots->V(slot, b) : absl::string_view(request.v());
  tickets->assign(static_cast<size_t>(b), -1);
  if (state.check != nullptr) {
    for (int64_t i = 0; i < b; ++i) {
      const uint64_t id = state.sequences[static_cast<size_t>(members[static_cast<size_t>(i)])].id;
      if (!state.check->IsSampled(id)) continue;
      const absl::string_view q = all_q.substr(i * q_bytes, q_bytes);
      absl::string_view k, v;
      if (state.options.decode_kv) {
        k = all_k.substr(i * row_bytes, row_bytes);
        v = all_v.substr(i * row_bytes, row_bytes);
      }
      (*tickets)[static_cast<size_t>(i)] = state.check->OnDecodeSent(id, layer, q, k, v);
    }
  }
  return request;
}

absl::Status TakeDecodeResponse(RunState& state, int32_t batch, int32_t layer,
                                const v1::DecodeResponse& response, const std::vector<int64_t>& tickets,
                                int32_t slot) {
  const std::vector<int32_t>& members = state.batches[static_cast<size_t>(batch)];
  const int64_t b = static_cast<int64_t>(members.size());
  const int64_t out_bytes = state.shape.query_bytes(), lse_bytes = state.shape.lse_bytes();
  // By reference the results are in the slot and the response carries none.
  const int64_t want_output = state.slots != nullptr ? 0 : b * out_bytes;
  const int64_t want_lse = state.slots != nullptr ? 0 : b * lse_bytes;
  if (static_cast<int64_t>(response.output().size()) != want_output ||
      static_cast<int64_t>(response.lse().size()) != want_lse) {
    return absl::InternalError(absl::StrCat("Decode response of ", response.output().size(), " output and ",
                                            response.lse().size(), " lse bytes for ", b, " sequences"));
  }
  if (state.check != nullptr &&
      std::any_of(tickets.begin(), tickets.end(), [](int64_t t) { return t >= 0; })) {
    std::string read_output, read_lse;
    absl::string_view output = response.output(), lse = response.lse();
    if (state.slots != nullptr) {
      if (absl::Status s = state.slots->ReadOutputs(slot, b, &read_output, &read_lse); !s.ok()) return s;
      output = read_output;
      lse = read_lse;
    }
    for (int64_t i = 0; i < b; ++i) {
      const int64_t ticket = tickets[static_cast<size_t>(i)];
      if (ticket < 0) continue;
      state.check->OnDecodeDone(ticket, output.substr(i * out_bytes, out_bytes),
                                lse.substr(i * lse_bytes, lse_bytes));
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
