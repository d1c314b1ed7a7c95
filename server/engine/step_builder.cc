#include "server/engine/step_builder.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"
#include "server/engine/tiers.h"

namespace pagedattn {

namespace k = kernels;

absl::StatusOr<std::unique_ptr<StepBuilder>> StepBuilder::Create(const Options& options,
                                                                 Metrics* metrics) {
  absl::StatusOr<std::unique_ptr<Planner>> planner =
      Planner::Create({.num_layers = options.num_layers,
                       .num_pages = options.num_pages,
                       .page_size = options.model.page_size});
  if (!planner.ok()) return planner.status();
  return std::unique_ptr<StepBuilder>(new StepBuilder(options, *std::move(planner), metrics));
}

void StepBuilder::Build(const Gate& gate, SequenceTable& table, BlockAllocator& allocator,
                        InFlight* in) {
  BackendBatch& batch = in->batch;
  batch.Clear();
  for (auto& item : in->items) {
    item->in_launch = false;
    if (!gate.healthy) {
      item->status = absl::InternalError("the backend failed earlier; the engine is unhealthy");
    } else if (gate.now >= gate.drain_deadline) {
      Reject("shutting_down");
      item->status = absl::UnavailableError("shutting down: drain timeout passed");
    } else if (gate.now >= item->deadline()) {
      // Before the cancel flag: gRPC also cancels a call whose deadline passed, and that call
      // is counted as deadline_exceeded.
      Reject("deadline_exceeded");
      item->status = absl::DeadlineExceededError("deadline passed before the work ran");
    } else if (item->cancelled() != nullptr && item->cancelled()->load()) {
      Reject("cancelled");
      item->status = absl::CancelledError("cancelled before it ran");
    } else if (item->task) {
      item->status = item->task();
    } else {
      item->status = Prepare(table, allocator, *item, *in);
      if (item->status.ok()) {
        item->status = item->is_decode ? AddDecode(table, allocator, item.get(), &batch)
                                       : AddAppend(table, item.get(), &batch);
      }
      if (absl::IsResourceExhausted(item->status)) Reject("pool_exhausted");
      item->in_launch = item->status.ok();
    }
  }
  // Only a batch that writes tokens can use it.
  batch.sequences_distinct = !batch.writes.empty() && SequencesDistinct(*in);
}

absl::Status StepBuilder::Prepare(SequenceTable& table, BlockAllocator& allocator,
                                  const WorkItem& item, const InFlight& in) {
  if (tiers_ == nullptr) return absl::OkStatus();
  if (item.is_decode) {
    return tiers_->PrepareItem(table, allocator, item.decode.sequence_ids, item.decode.layer,
                               item.decode_kv ? 1 : 0, in);
  }
  return tiers_->PrepareItem(table, allocator, absl::MakeConstSpan(&item.append.sequence_id, 1),
                             item.append.layer, item.append.num_tokens, in);
}

int64_t StepBuilder::Slot(int32_t layer, absl::Span<const int32_t> pages, int64_t pos) const {
  const int64_t page_size = options_.model.page_size;
  return planner_->PoolPage(layer, pages[pos / page_size]) * page_size + pos % page_size;
}

absl::Status StepBuilder::AddDecode(SequenceTable& table, BlockAllocator& allocator,
                                    WorkItem* item, BackendBatch* batch) {
  DecodeWork& w = item->decode;
  const bool step = item->decode_kv;
  // Check every sequence, and the pages all of them need, before changing anything. A copy on
  // write is counted for each sequence whose last page is shared, even when two siblings in
  // this request share it (a conservative count: a nearly full pool may refuse a page early).
  int64_t needed = 0;
  table.Prefetch(w.sequence_ids);
  for (uint64_t id : w.sequence_ids) {
    if (step) {
      absl::StatusOr<int64_t> n = table.CheckStep(id, w.layer, 1);
      if (!n.ok()) return n.status();
      needed += *n;
    } else if (!table.Contains(id)) {
      return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
    } else if (table.IsOffloaded(id)) {
      return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " is offloaded"));
    }
  }
  if (needed > allocator.num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("Decode needs ", needed, " free KV pages, ",
                                                     allocator.num_free(), " free"));
  }
  const int64_t b = static_cast<int64_t>(w.sequence_ids.size());
  item->output.request_id = w.request_id;
  const char* q_bytes = w.q.data();
  const char* k_bytes = w.k.data();
  const char* v_bytes = w.v.data();
  char* out_bytes;
  char* lse_bytes;
  if (item->block) {
    char* const base = item->block.data();
    q_bytes = base + item->layout.q;
    k_bytes = base + item->layout.k;
    v_bytes = base + item->layout.v;
    out_bytes = base + item->layout.output;
    lse_bytes = base + item->layout.lse;
  } else {
    if (w.output.is_view()) {
      out_bytes = w.output.mutable_data();
    } else {
      item->output.output.resize(b * options_.model.query_bytes());
      out_bytes = item->output.output.data();
    }
    if (w.lse.is_view()) {
      lse_bytes = w.lse.mutable_data();
    } else {
      item->output.lse.resize(b * options_.model.lse_bytes());
      lse_bytes = item->output.lse.data();
    }
  }
  const auto* q = reinterpret_cast<const uint16_t*>(q_bytes);
  const auto* kk = reinterpret_cast<const uint16_t*>(k_bytes);
  const auto* vv = reinterpret_cast<const uint16_t*>(v_bytes);
  auto* out = reinterpret_cast<uint16_t*>(out_bytes);
  auto* lse = reinterpret_cast<float*>(lse_bytes);
  for (int64_t i = 0; i < b; ++i) {
    const uint64_t id = w.sequence_ids[i];
    int64_t tokens;
    absl::Span<const int32_t> pages;
    if (step) {
      absl::StatusOr<SequenceTable::StepResult> r =
          table.ApplyStep(id, w.layer, 1, &batch->page_copies);
      // Checked above, for all sequences together: failing here would be a bookkeeping bug.
      if (!r.ok()) return absl::InternalError(absl::StrCat("step after check: ", r.status().message()));
      const int64_t row = i * options_.model.token_elems();
      batch->writes.push_back(TokenWrite{kk + row, vv + row, 1,
                                         static_cast<int64_t>(batch->write_slots.size())});
      batch->write_slots.push_back(Slot(w.layer, r->pages, r->first_position));
      tokens = r->visible_tokens;
      pages = r->pages;
    } else {
      table.Touch(id);
      absl::StatusOr<SequenceTable::View> view = table.Get(id);
      tokens = view->length;
      pages = view->pages;
    }
    if (absl::Status s = planner_->AddSequence(w.layer, pages, tokens, &batch->plan); !s.ok()) {
      return absl::InternalError(s.message());
    }
    batch->q.push_back(q + i * options_.model.query_elems());
    batch->output.push_back(out + i * options_.model.query_elems());
    batch->lse.push_back(lse + i * options_.model.num_qo_heads);
  }
  batch->sm_scale = item->sm_scale;
  if (w.wait_word != 0) batch->waits.push_back({w.wait_word, w.wait_token});
  if (w.signal_word != 0) batch->signals.push_back({w.signal_word, w.signal_token});
  return absl::OkStatus();
}

absl::Status StepBuilder::AddAppend(SequenceTable& table, WorkItem* item, BackendBatch* batch) {
  AppendWork& w = item->append;
  absl::StatusOr<SequenceTable::StepResult> r =
      table.ApplyStep(w.sequence_id, w.layer, w.num_tokens, &batch->page_copies);
  if (!r.ok()) return r.status();
  absl::StatusOr<SequenceTable::View> view = table.Get(w.sequence_id);
  batch->writes.push_back(TokenWrite{reinterpret_cast<const uint16_t*>(w.k.data()),
                                     reinterpret_cast<const uint16_t*>(w.v.data()), w.num_tokens,
                                     static_cast<int64_t>(batch->write_slots.size())});
  for (int64_t pos = r->first_position; pos < r->visible_tokens; ++pos) {
    batch->write_slots.push_back(Slot(w.layer, view->pages, pos));
  }
  item->length = r->length;
  return absl::OkStatus();
}

bool StepBuilder::SequencesDistinct(const InFlight& in) {
  // One item alone: its ids are distinct (the service checks each request's).
  if (std::count_if(in.items.begin(), in.items.end(),
                    [](const auto& item) { return item->in_launch; }) == 1) {
    return true;
  }
  keys_.clear();
  for (const auto& item : in.items) {
    if (!item->in_launch) continue;
    if (item->is_decode) {
      for (uint64_t id : item->decode.sequence_ids) keys_.emplace_back(id, item->decode.layer);
    } else {
      keys_.emplace_back(item->append.sequence_id, item->append.layer);
    }
  }
  std::sort(keys_.begin(), keys_.end());
  return std::adjacent_find(keys_.begin(), keys_.end()) == keys_.end();
}

}  // namespace pagedattn
