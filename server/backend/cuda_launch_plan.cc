#include "server/backend/cuda_launch_plan.h"

#include <algorithm>
#include <iterator>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {

namespace {

// Whether the runs can be copied straight between the ring and a device buffer.
bool InRing(const std::vector<DeviceRun>& runs, const LaunchPlanOptions& o) {
  if (o.ring == nullptr) return false;
  for (const DeviceRun& run : runs) {
    if (run.host < o.ring || run.bytes < 0 || run.host + run.bytes > o.ring + o.ring_bytes) {
      return false;
    }
  }
  return true;
}

// Moves the cursor past `count` written tokens, as PackTokens does.
void AdvanceCursor(const BackendBatch& batch, int64_t count, TokenCursor* cursor) {
  int64_t done = 0;
  while (done < count) {
    const TokenWrite& w = batch.writes[cursor->write];
    const int64_t n = std::min<int64_t>(count - done, w.num_tokens - cursor->offset);
    done += n;
    cursor->offset += static_cast<int32_t>(n);
    if (cursor->offset == w.num_tokens) {
      ++cursor->write;
      cursor->offset = 0;
    }
  }
}

// Sorts the pieces of rows (a q, output or lse row, or the K or V rows of a run of tokens) by
// the memory they lie in: host pieces into `host` runs, device pieces into `device` runs.
class PieceSorter {
 public:
  PieceSorter(const LaunchPlanOptions& o, std::vector<DeviceRun>* host,
              std::vector<DeviceRun>* device)
      : o_(o), host_(host), device_(device) {
    host_->clear();
    device_->clear();
  }
  void Add(const void* data, int64_t offset, int64_t bytes) {
    if (bytes == 0) return;
    const char* const p = static_cast<const char*>(data);
    const MemoryKind kind = Classify(p, p + bytes);
    if (kind == MemoryKind::kDevice) {
      AddRun(p, offset, bytes, device_);
    } else {
      pageable_ |= kind == MemoryKind::kPageable;
      AddRun(p, offset, bytes, host_);
    }
  }
  bool registered() const { return registered_; }  // a piece in a registered range
  bool pageable() const { return pageable_; }
  bool straddles() const { return straddles_; }    // a piece partly in device memory

 private:
  MemoryKind Classify(const char* p, const char* end) {
    if (o_.ring != nullptr && p >= o_.ring && end <= o_.ring + o_.ring_bytes) {
      return MemoryKind::kPinnedHost;
    }
    const std::vector<MemoryRange>& ranges = *o_.ranges;
    auto next = std::upper_bound(ranges.begin(), ranges.end(), p,
                                 [](const char* x, const MemoryRange& r) { return x < r.begin; });
    if (next != ranges.begin() && p < std::prev(next)->end) {
      const MemoryRange& r = *std::prev(next);
      if (end <= r.end) {
        registered_ = true;
        return r.kind;
      }
      straddles_ |= r.kind == MemoryKind::kDevice;
      return MemoryKind::kPageable;
    }
    straddles_ |= next != ranges.end() && end > next->begin && next->kind == MemoryKind::kDevice;
    return MemoryKind::kPageable;
  }

  const LaunchPlanOptions& o_;
  std::vector<DeviceRun>* const host_;
  std::vector<DeviceRun>* const device_;
  bool registered_ = false;
  bool pageable_ = false;
  bool straddles_ = false;
};

// [p, p + bytes) when it lies inside one range of the backend's own device memory, else null.
const char* OwnDevice(const char* p, int64_t bytes, const LaunchPlanOptions& o) {
  if (p == nullptr || bytes <= 0) return nullptr;
  const std::vector<MemoryRange>& ranges = *o.ranges;
  auto next = std::upper_bound(ranges.begin(), ranges.end(), p,
                               [](const char* x, const MemoryRange& r) { return x < r.begin; });
  if (next == ranges.begin()) return nullptr;
  const MemoryRange& r = *std::prev(next);
  return r.own_device && p + bytes <= r.end ? p : nullptr;
}

// The round's q rows, when they are back to back in the backend's own device memory.
const char* QInPlace(const kernels::Shape& model, const BackendBatch& batch, const Round& r,
                     const LaunchPlanOptions& o) {
  const int32_t ns = r.num_sequences();
  if (ns == 0) return nullptr;
  const char* const first = reinterpret_cast<const char*>(batch.q[r.seq_begin]);
  for (int32_t s = 1; s < ns; ++s) {
    if (reinterpret_cast<const char*>(batch.q[r.seq_begin + s]) !=
        first + int64_t{s} * model.query_bytes()) {
      return nullptr;
    }
  }
  return OwnDevice(first, int64_t{ns} * model.query_bytes(), o);
}

// The K (or V) rows of the round's written tokens, when they are back to back in the
// backend's own device memory.
const char* RowsInPlace(const kernels::Shape& model, const BackendBatch& batch, const Round& r,
                        TokenCursor c, bool k_side, const LaunchPlanOptions& o) {
  const char* first = nullptr;
  int64_t done = 0;
  while (done < r.num_tokens()) {
    const TokenWrite& w = batch.writes[c.write];
    const int64_t n = std::min<int64_t>(r.num_tokens() - done, w.num_tokens - c.offset);
    const char* src = reinterpret_cast<const char*>((k_side ? w.k : w.v) +
                                                    int64_t{c.offset} * model.token_elems());
    if (first == nullptr) first = src;
    if (src != first + done * model.token_bytes()) return nullptr;
    done += n;
    c.offset += static_cast<int32_t>(n);
    if (c.offset == w.num_tokens) {
      ++c.write;
      c.offset = 0;
    }
  }
  return OwnDevice(first, r.num_tokens() * model.token_bytes(), o);
}

// The pieces of a round's rows in the arena, in RowRuns' order (q rows, K rows, V rows),
// leaving out the rows the kernels read in place.
void SortRowPieces(const kernels::Shape& model, const BackendBatch& batch, const RoundPlan& rp,
                   TokenCursor cursor, PieceSorter* sorter) {
  const Round& r = rp.round;
  const RoundLayout& l = rp.layout;
  const int64_t q_bytes = model.query_bytes();
  const int64_t row_elems = model.token_elems();
  const int64_t row_bytes = model.token_bytes();
  for (int32_t s = 0; s < r.num_sequences() && rp.q_in_place == nullptr; ++s) {
    sorter->Add(batch.q[r.seq_begin + s], l.q + int64_t{s} * q_bytes, q_bytes);
  }
  for (const bool k_side : {true, false}) {
    if ((k_side ? rp.k_in_place : rp.v_in_place) != nullptr) continue;
    TokenCursor c = cursor;
    int64_t done = 0;
    const int64_t base = k_side ? l.k_rows : l.v_rows;
    while (done < r.num_tokens()) {
      const TokenWrite& w = batch.writes[c.write];
      const int64_t n = std::min<int64_t>(r.num_tokens() - done, w.num_tokens - c.offset);
      const uint16_t* src = (k_side ? w.k : w.v) + int64_t{c.offset} * row_elems;
      sorter->Add(src, base + done * row_bytes, n * row_bytes);
      done += n;
      c.offset += static_cast<int32_t>(n);
      if (c.offset == w.num_tokens) {
        ++c.write;
        c.offset = 0;
      }
    }
  }
}

// The pieces of a batch's outputs in the output buffer, in OutputRuns' order.
void SortOutputPieces(const kernels::Shape& model, const BackendBatch& batch,
                      PieceSorter* sorter) {
  const int32_t b = batch.plan.batch_size();
  for (int32_t i = 0; i < b; ++i) {
    sorter->Add(batch.output[i], int64_t{i} * model.query_bytes(), model.query_bytes());
  }
  for (int32_t i = 0; i < b; ++i) {
    sorter->Add(batch.lse[i], LseOffset(model, b) + i * model.lse_bytes(), model.lse_bytes());
  }
}

// Whether the decode kernel can write a batch's outputs where the device runs say, with no
// copy after it: one run (output rows, then lse rows, as in the output buffer), or the output
// rows and the lse rows each in one run of their own.
bool KernelWritesDeviceRuns(const kernels::Shape& model, int32_t b,
                            const std::vector<DeviceRun>& runs) {
  if (runs.size() == 1) return true;
  return runs.size() == 2 && runs[0].offset == 0 && runs[0].bytes == b * model.query_bytes() &&
         runs[1].offset == LseOffset(model, b) && runs[1].bytes == b * model.lse_bytes();
}

absl::Status Straddling(absl::string_view what) {
  return absl::InternalError(
      absl::StrCat("a batch's ", what, " row lies partly in registered device memory"));
}

}  // namespace

absl::Status PlanLaunch(const BackendBatch& batch, const StagingCapacity& capacity,
                        const LaunchPlanOptions& options, LaunchPlan* plan) {
  const kernels::Plan& kp = batch.plan;
  const kernels::Shape& model = capacity.model;
  plan->rounds.clear();
  plan->indptr.clear();
  plan->row_runs.clear();
  plan->append_rows.clear();
  plan->out_runs.clear();
  plan->device_runs.clear();
  plan->out_device_runs.clear();
  plan->out_device = false;
  plan->unpack_runs = false;
  const bool registered = options.ranges != nullptr && !options.ranges->empty();
  const absl::Status split =
      SplitRounds(capacity, static_cast<int64_t>(batch.page_copies.size()), WrittenTokens(batch),
                  kp.kv_indptr, &plan->split);
  if (!split.ok()) return split;
  const size_t max_runs = static_cast<size_t>(std::max(options.max_direct_runs, 0));
  TokenCursor cursor;
  for (const Round& r : plan->split) {
    RoundPlan rp;
    rp.round = r;
    const int32_t ns = r.num_sequences();
    if (ns > 0) {
      rp.kv_begin = kp.kv_indptr[r.seq_begin];
      rp.kv_indices = kp.kv_indptr[r.seq_end] - rp.kv_begin;
      rp.rebased_indptr = r.seq_begin > 0;
      if (rp.rebased_indptr) {
        rp.indptr_begin = static_cast<int64_t>(plan->indptr.size());
        for (int32_t s = r.seq_begin; s <= r.seq_end; ++s) {
          plan->indptr.push_back(kp.kv_indptr[s] - static_cast<int32_t>(rp.kv_begin));
        }
      }
    }
    rp.layout = LayoutRound(model, ns, rp.kv_indices, r.num_copies(), r.num_tokens(),
                            capacity.plan_bytes);
    rp.cursor = cursor;
    bool sorted = false;
    if (registered) {
      rp.q_in_place = QInPlace(model, batch, r, options);
      rp.k_in_place = RowsInPlace(model, batch, r, cursor, /*k_side=*/true, options);
      rp.v_in_place = RowsInPlace(model, batch, r, cursor, /*k_side=*/false, options);
      const bool in_place = rp.q_in_place != nullptr || rp.k_in_place != nullptr ||
                            rp.v_in_place != nullptr;
      PieceSorter sorter(options, &plan->scratch_runs, &plan->scratch_device);
      SortRowPieces(model, batch, rp, cursor, &sorter);
      if (sorter.straddles()) return Straddling("q, k or v");
      if (sorter.registered() || in_place) {
        sorted = true;
        rp.device_begin = static_cast<int32_t>(plan->device_runs.size());
        plan->device_runs.insert(plan->device_runs.end(), plan->scratch_device.begin(),
                                 plan->scratch_device.end());
        rp.device_end = static_cast<int32_t>(plan->device_runs.size());
        rp.direct_rows = !sorter.pageable() && plan->scratch_runs.size() <= max_runs;
        rp.packed_runs = !rp.direct_rows;
      }
    }
    // An empty list of runs (a round of page copies only) counts as direct: only its tables
    // travel, in one copy.
    if (!sorted) {
      rp.direct_rows = RowRuns(model, batch, r.seq_begin, ns, r.num_tokens(), cursor, rp.layout,
                               &plan->scratch_runs, max_runs) &&
                       InRing(plan->scratch_runs, options);
    }
    if (rp.direct_rows || rp.packed_runs) {
      rp.runs_begin = static_cast<int32_t>(plan->row_runs.size());
      plan->row_runs.insert(plan->row_runs.end(), plan->scratch_runs.begin(),
                            plan->scratch_runs.end());
      rp.runs_end = static_cast<int32_t>(plan->row_runs.size());
    }
    rp.kernel_appends = options.kernel_appends && ns > 0 &&
                        KernelAppendRows(model, batch, r, &plan->scratch_rows);
    if (rp.kernel_appends) {
      rp.append_begin = static_cast<int64_t>(plan->append_rows.size());
      plan->append_rows.insert(plan->append_rows.end(), plan->scratch_rows.begin(),
                               plan->scratch_rows.end());
    }
    AdvanceCursor(batch, r.num_tokens(), &cursor);
    plan->rounds.push_back(rp);
  }

  const int32_t b = kp.batch_size();
  plan->attention = b > 0;
  plan->output = OutputMode::kCopyAndUnpack;
  if (b > 0 && registered) {
    PieceSorter sorter(options, &plan->out_runs, &plan->out_device_runs);
    SortOutputPieces(model, batch, &sorter);
    if (sorter.straddles()) return Straddling("output or lse");
    if (sorter.registered()) {
      if (plan->out_runs.empty() && options.kernel_writes_outputs &&
          KernelWritesDeviceRuns(model, b, plan->out_device_runs)) {
        plan->output = OutputMode::kKernelWrites;
        plan->out_device = true;
        plan->out_runs.swap(plan->out_device_runs);
      } else if (!sorter.pageable() && plan->out_runs.size() <= max_runs) {
        plan->output = OutputMode::kCopyToBlocks;
      } else {
        plan->unpack_runs = true;
      }
      return absl::OkStatus();
    }
    plan->out_runs.clear();
    plan->out_device_runs.clear();
  }
  if (b > 0 && OutputRuns(model, batch, &plan->out_runs, max_runs) && InRing(plan->out_runs, options)) {
    plan->output = plan->out_runs.size() == 1 && options.kernel_writes_outputs
                       ? OutputMode::kKernelWrites
                       : OutputMode::kCopyToBlocks;
  }
  if (plan->output == OutputMode::kCopyAndUnpack) plan->out_runs.clear();
  return absl::OkStatus();
}

}  // namespace pagedattn
