#include "server/engine/admission.h"

#include <cassert>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "server/backend/copy_list.h"

namespace pagedattn {

void Admission::Decode(DecodeWork work, Engine::DecodeDone done) {
  const int64_t b = static_cast<int64_t>(work.sequence_ids.size());
  assert(b > 0 && static_cast<int64_t>(work.q.size()) == b * model_.query_bytes());
  assert(work.k.size() == work.v.size() &&
         (work.k.empty() || static_cast<int64_t>(work.k.size()) == b * model_.token_bytes()));
  assert(work.sm_scale > 0.0f);
  auto item = std::make_unique<WorkItem>();
  item->is_decode = true;
  item->num_sequences = static_cast<int32_t>(b);
  item->sm_scale = work.sm_scale;
  item->sync_group = work.sync_group;
  item->decode_kv = !work.k.empty();
  item->decode = std::move(work);
  item->decode_done = std::move(done);
  ReceiveIntoBlock(item.get());
  Enqueue(std::move(item));
}

void Admission::Append(AppendWork work, Engine::AppendDone done) {
  assert(work.num_tokens > 0 &&
         static_cast<int64_t>(work.k.size()) == work.num_tokens * model_.token_bytes() &&
         work.v.size() == work.k.size());
  auto item = std::make_unique<WorkItem>();
  item->is_decode = false;
  item->num_sequences = 1;
  item->sm_scale = 0.0f;  // no attention: fits any batch
  item->append = std::move(work);
  item->append_done = std::move(done);
  Enqueue(std::move(item));
}

void Admission::Task(std::function<absl::Status()> task,
                     std::function<void(absl::Status)> done) {
  auto item = std::make_unique<WorkItem>();
  item->is_decode = false;
  item->num_sequences = batcher_->options().max_batch_size;
  item->sm_scale = 0.0f;
  item->task = std::move(task);
  item->task_done = std::move(done);
  Enqueue(std::move(item));
}

void Admission::ReceiveIntoBlock(WorkItem* item) {
  DecodeWork& w = item->decode;
  // Only a request that carries all its tensors itself: views stay where the client put them.
  if (w.q.is_view() || w.k.is_view() || w.v.is_view() || w.output.is_view() || w.lse.is_view()) {
    return;
  }
  const DecodeBlockLayout l =
      DecodeBlockLayout::For(model_, static_cast<int64_t>(w.sequence_ids.size()), item->decode_kv);
  HostBlock block = backend_->TakeHostBlock(l.bytes);
  if (metrics_ != nullptr) metrics_->RecordDecodeReceive(static_cast<bool>(block));
  if (!block) return;
  const absl::Time begin = absl::Now();
  // The block's next reader is the device (a DMA), so the stores skip the caches.
  CopyForDevice(block.data() + l.q, w.q.data(), w.q.size());
  if (item->decode_kv) {
    CopyForDevice(block.data() + l.k, w.k.data(), w.k.size());
    CopyForDevice(block.data() + l.v, w.v.data(), w.v.size());
  }
  if (metrics_ != nullptr) {
    metrics_->RecordStage(Metrics::Stage::kReceive, absl::ToDoubleSeconds(absl::Now() - begin));
  }
  w.q.ReleaseInline();
  w.k.ReleaseInline();
  w.v.ReleaseInline();
  item->block = std::move(block);
  item->layout = l;
}

void Admission::Enqueue(std::unique_ptr<WorkItem> item) {
  if (closed()) {
    if (metrics_ != nullptr) metrics_->RecordRejected("shutting_down");
    item->status = absl::UnavailableError("shutting down");
    item->Complete();
    return;
  }
  std::unique_ptr<BatchItem> queued = std::move(item);
  queued_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status s = batcher_->Enqueue(&queued); !s.ok()) {
    queued_.fetch_sub(1, std::memory_order_relaxed);
    if (metrics_ != nullptr) {
      metrics_->RecordRejected(batcher_->closed() ? "shutting_down" : "queue_full");
    }
    auto* back = static_cast<WorkItem*>(queued.get());
    back->status = std::move(s);
    back->Complete();
    return;
  }
  if (metrics_ != nullptr) metrics_->SetQueueDepth(batcher_->depth());
}

}  // namespace pagedattn
