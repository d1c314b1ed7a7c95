#include "server/backend/cuda_launch_plan.h"

#include <algorithm>

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

}  // namespace

absl::Status PlanLaunch(const BackendBatch& batch, const StagingCapacity& capacity,
                        const LaunchPlanOptions& options, LaunchPlan* plan) {
  const kernels::Plan& kp = batch.plan;
  plan->rounds.clear();
  plan->indptr.clear();
  plan->row_runs.clear();
  plan->append_rows.clear();
  plan->out_runs.clear();
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
    rp.layout = LayoutRound(ns, rp.kv_indices, r.num_copies(), r.num_tokens(),
                            capacity.plan_bytes);
    rp.cursor = cursor;
    // An empty list of runs (a round of page copies only) counts as direct: only its tables
    // travel, in one copy.
    rp.direct_rows = RowRuns(batch, r.seq_begin, ns, r.num_tokens(), cursor, rp.layout,
                             &plan->scratch_runs, max_runs) &&
                     InRing(plan->scratch_runs, options);
    if (rp.direct_rows) {
      rp.runs_begin = static_cast<int32_t>(plan->row_runs.size());
      plan->row_runs.insert(plan->row_runs.end(), plan->scratch_runs.begin(),
                            plan->scratch_runs.end());
      rp.runs_end = static_cast<int32_t>(plan->row_runs.size());
    }
    rp.kernel_appends = options.kernel_appends && ns > 0 &&
                        KernelAppendRows(batch, r, &plan->scratch_rows);
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
  if (b > 0 && OutputRuns(batch, &plan->out_runs, max_runs) && InRing(plan->out_runs, options)) {
    plan->output = plan->out_runs.size() == 1 && options.kernel_writes_outputs
                       ? OutputMode::kKernelWrites
                       : OutputMode::kCopyToBlocks;
  }
  if (plan->output == OutputMode::kCopyAndUnpack) plan->out_runs.clear();
  return absl::OkStatus();
}

}  // namespace pagedattn
