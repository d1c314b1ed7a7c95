#include "server/backend/cuda_staging.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pagedattn {

namespace k = kernels;

namespace {

int64_t AlignUp(int64_t n) {
  constexpr int64_t a = RoundLayout::kAlignment;
  return (n + a - 1) / a * a;
}

}  // namespace

StagingCapacity StagingCapacity::For(const Backend::PoolShape& shape, int64_t staged_tokens) {
  StagingCapacity c;
  c.max_sequences = shape.max_batch_size;
  c.max_page_copies = shape.max_batch_size;
  c.max_tokens = std::max<int64_t>(staged_tokens, shape.max_batch_size);
  c.max_kv_indices = std::min<int64_t>(shape.max_batch_size, shape.num_layers) * shape.num_pages;
  c.model = shape.model;
  return c;
}

int64_t StagingCapacity::ArenaBytes() const {
  return LayoutRound(model, max_sequences, max_kv_indices, max_page_copies, max_tokens,
                     plan_bytes)
      .bytes;
}

int64_t StagingCapacity::OutputBytes() const {
  return pagedattn::OutputBytes(model, max_sequences);
}

RoundLayout LayoutRound(const k::Shape& model, int32_t sequences, int64_t kv_indices,
                        int64_t copies, int64_t tokens, int64_t plan_bytes) {
  RoundLayout l;
  int64_t at = 0;
  const int64_t row_bytes = model.token_bytes();
  l.q = at;
  at = AlignUp(at + int64_t{sequences} * model.query_bytes());
  l.k_rows = at;
  at = AlignUp(at + tokens * row_bytes);
  l.v_rows = at;
  at = AlignUp(at + tokens * row_bytes);
  l.indices = at;
  at = AlignUp(at + kv_indices * static_cast<int64_t>(sizeof(int32_t)));
  l.copies = at;
  at = AlignUp(at + copies * static_cast<int64_t>(sizeof(PageCopy)));
  l.slots = at;
  at = AlignUp(at + tokens * static_cast<int64_t>(sizeof(int64_t)));
  l.plan = at;
  l.bytes = at + plan_bytes;
  return l;
}

absl::Status SplitRounds(const StagingCapacity& cap, int64_t num_copies, int64_t num_tokens,
                         const std::vector<int32_t>& kv_indptr, std::vector<Round>* rounds) {
  rounds->clear();
  const int32_t num_seqs = kv_indptr.empty() ? 0 : static_cast<int32_t>(kv_indptr.size()) - 1;
  if (num_seqs > cap.max_sequences) {
    return absl::InternalError(absl::StrCat("batch of ", num_seqs, " sequences > capacity ",
                                            cap.max_sequences));
  }
  for (int32_t s = 0; s < num_seqs; ++s) {
    if (kv_indptr[s + 1] - kv_indptr[s] > cap.max_kv_indices) {
      return absl::InternalError(absl::StrCat("sequence of ", kv_indptr[s + 1] - kv_indptr[s],
                                              " pages > staging capacity ", cap.max_kv_indices));
    }
  }
  int64_t c = 0, t = 0;
  int32_t s = 0;
  while (c < num_copies || t < num_tokens || s < num_seqs) {
    Round r;
    r.copy_begin = c;
    c = std::min(num_copies, c + cap.max_page_copies);
    r.copy_end = c;
    r.token_begin = t;
    if (c == num_copies) t = std::min(num_tokens, t + cap.max_tokens);
    r.token_end = t;
    r.seq_begin = s;
    if (c == num_copies && t == num_tokens) {
      const int64_t first = kv_indptr[s];
      while (s < num_seqs && kv_indptr[s + 1] - first <= cap.max_kv_indices) ++s;
    }
    r.seq_end = s;
    rounds->push_back(r);
  }
  return absl::OkStatus();
}

int64_t WrittenTokens(const BackendBatch& batch) {
  int64_t n = 0;
  for (const TokenWrite& w : batch.writes) n += w.num_tokens;
  return n;
}

void PackTokens(const k::Shape& model, const BackendBatch& batch, int64_t count,
                TokenCursor* cursor, int64_t* slots, uint16_t* k_rows, uint16_t* v_rows,
                CopyList* copies) {
  const int64_t row_elems = model.token_elems();
  const int64_t row_bytes = model.token_bytes();
  int64_t done = 0;
  while (done < count) {
    const TokenWrite& w = batch.writes[cursor->write];
    const int64_t n = std::min<int64_t>(count - done, w.num_tokens - cursor->offset);
    if (n > 0) {
      if (slots != nullptr) {
        copies->Add(slots + done, batch.write_slots.data() + w.slot_begin + cursor->offset,
                    n * sizeof(int64_t));
      }
      if (k_rows != nullptr) {
        copies->Add(k_rows + done * row_elems, w.k + int64_t{cursor->offset} * row_elems,
                    n * row_bytes);
      }
      if (v_rows != nullptr) {
        copies->Add(v_rows + done * row_elems, w.v + int64_t{cursor->offset} * row_elems,
                    n * row_bytes);
      }
      done += n;
      cursor->offset += static_cast<int32_t>(n);
    }
    if (cursor->offset == w.num_tokens) {
      ++cursor->write;
      cursor->offset = 0;
    }
  }
}

bool KernelAppendRows(const k::Shape& model, const BackendBatch& batch, const Round& r,
                      std::vector<int32_t>* rows) {
  if (!batch.sequences_distinct || r.num_tokens() == 0) return false;
  const kernels::Plan& plan = batch.plan;
  rows->assign(r.num_sequences(), -1);
  int64_t t = r.token_begin;
  for (int32_t s = r.seq_begin; s < r.seq_end && t < r.token_end; ++s) {
    const int32_t end = plan.kv_indptr[s + 1];
    if (end == plan.kv_indptr[s]) continue;
    const int64_t last_slot =
        int64_t{plan.kv_indices[end - 1]} * model.page_size + plan.kv_last_page_len[s] - 1;
    if (batch.write_slots[t] == last_slot) {
      (*rows)[s - r.seq_begin] = static_cast<int32_t>(t - r.token_begin);
      ++t;
    }
  }
  return t == r.token_end;
}

void AddRun(const void* host, int64_t offset, int64_t bytes, std::vector<DeviceRun>* runs) {
  if (bytes == 0) return;
  char* const h = const_cast<char*>(static_cast<const char*>(host));
  if (!runs->empty()) {
    DeviceRun& last = runs->back();
    if (last.host + last.bytes == h && last.offset + last.bytes == offset) {
      last.bytes += bytes;
      return;
    }
  }
  runs->push_back(DeviceRun{h, offset, bytes});
}

bool RowRuns(const k::Shape& model, const BackendBatch& batch, int32_t seq_begin, int32_t ns,
             int64_t count, TokenCursor cursor, const RoundLayout& l,
             std::vector<DeviceRun>* runs, size_t max_runs) {
  runs->clear();
  const int64_t q_bytes = model.query_bytes();
  const int64_t row_elems = model.token_elems();
  const int64_t row_bytes = model.token_bytes();
  for (int32_t s = 0; s < ns; ++s) {
    AddRun(batch.q[seq_begin + s], l.q + int64_t{s} * q_bytes, q_bytes, runs);
    if (runs->size() > max_runs) return false;
  }
  // K rows of all `count` tokens, then their V rows: two walks from the same cursor.
  for (const bool k_side : {true, false}) {
    TokenCursor c = cursor;
    int64_t done = 0;
    const int64_t base = k_side ? l.k_rows : l.v_rows;
    while (done < count) {
      const TokenWrite& w = batch.writes[c.write];
      const int64_t n = std::min<int64_t>(count - done, w.num_tokens - c.offset);
      const uint16_t* src = (k_side ? w.k : w.v) + int64_t{c.offset} * row_elems;
      AddRun(src, base + done * row_bytes, n * row_bytes, runs);
      if (runs->size() > max_runs) return false;
      done += n;
      c.offset += static_cast<int32_t>(n);
      if (c.offset == w.num_tokens) {
        ++c.write;
        c.offset = 0;
      }
    }
  }
  return true;
}

bool OutputRuns(const k::Shape& model, const BackendBatch& batch, std::vector<DeviceRun>* runs,
                size_t max_runs) {
  runs->clear();
  const int32_t b = batch.plan.batch_size();
  const int64_t q_bytes = model.query_bytes();
  const int64_t lse_bytes = model.lse_bytes();
  for (int32_t i = 0; i < b; ++i) {
    AddRun(batch.output[i], int64_t{i} * q_bytes, q_bytes, runs);
    if (runs->size() > max_runs) return false;
  }
  for (int32_t i = 0; i < b; ++i) {
    AddRun(batch.lse[i], LseOffset(model, b) + i * lse_bytes, lse_bytes, runs);
    if (runs->size() > max_runs) return false;
  }
  return true;
}

int64_t PagesThatFit(int64_t budget_bytes, int64_t fixed_bytes, int64_t bytes_per_page,
                     int32_t num_layers) {
  if (budget_bytes <= fixed_bytes || bytes_per_page <= 0 || num_layers <= 0) return 0;
  const int64_t pages = (budget_bytes - fixed_bytes) / bytes_per_page;
  return std::min<int64_t>(pages, std::numeric_limits<int32_t>::max() / num_layers);
}

}  // namespace pagedattn
