#include "server/engine/tiers.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include <sys/mman.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {

namespace k = kernels;

namespace {

// Calls f(i, j) for every longest stretch [i, j) of `pages` whose ids are consecutive.
template <typename F>
void ForEachStretch(absl::Span<const int32_t> pages, F&& f) {
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    f(i, j);
    i = j;
  }
}

// Runs of consecutive pages of one layer of `pages` (token order), each pointing at the matching
// bytes of k/v (page i of the list at k + i * page_bytes).
void AppendRuns(int32_t layer, absl::Span<const int32_t> pages, char* k_base, char* v_base,
                int64_t page_bytes, std::vector<PageRun>* runs) {
  ForEachStretch(pages, [&](size_t i, size_t j) {
    runs->push_back(PageRun{layer, pages[i], static_cast<int32_t>(j - i),
                            k_base + static_cast<int64_t>(i) * page_bytes,
                            v_base + static_cast<int64_t>(i) * page_bytes});
  });
}

// Runs for tokens [first, first + count) of one layer of a sequence on `pages`, whose rows lie
// packed at k/v (row t at k + (t - first) * row_bytes): one run per stretch of consecutive
// pages, starting mid-page and ending mid-page where the tokens do.
void AppendTokenRuns(int32_t layer, absl::Span<const int32_t> pages, int64_t first, int64_t count,
                     const k::Shape& model, const char* k_rows, const char* v_rows, bool on_device,
                     std::vector<PageRun>* runs) {
  const int64_t page_size = model.page_size;
  const int64_t row_bytes = model.page_bytes() / page_size;
  const int64_t end = first + count;
  for (int64_t t = first; t < end;) {
    const int64_t p = t / page_size;
    const int64_t last = (end - 1) / page_size;
    int64_t q = p;
    while (q < last && pages[q + 1] == pages[q] + 1) ++q;
    const int64_t stop = std::min(end, (q + 1) * page_size);
    const int64_t skip = (t - first) * row_bytes;
    runs->push_back(PageRun{layer, pages[p], static_cast<int32_t>(q - p + 1),
                            const_cast<char*>(k_rows) + skip, const_cast<char*>(v_rows) + skip,
                            (t % page_size) * row_bytes, (stop - t) * row_bytes, on_device});
    t = stop;
  }
}

// An export reads committed tokens only: FAILED_PRECONDITION for a sequence mid-step.
absl::Status BetweenSteps(const SequenceTable::View& view, uint64_t id) {
  if (view.step_tokens == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "sequence ", id, " is mid-step (next layer ", view.next_layer, "): export between steps"));
}

}  // namespace

absl::Status SequenceData::Allocate(int32_t layers, int64_t tokens, const k::Shape& model,
                                    bool prefault) {
  length = tokens;
  num_layers = layers;
  page_size = model.page_size;
  page_bytes = model.page_bytes();
  num_pages = model.pages_for(tokens);
  const int64_t total = 2 * int64_t{layers} * layer_bytes();
  bytes.reset();
  if (total > 0) {
    const size_t size = static_cast<size_t>(total);
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (prefault ? MAP_POPULATE : 0);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p != MAP_FAILED) bytes.reset(static_cast<char*>(p));
    bytes.get_deleter().size = size;
  }
  if (total > 0 && bytes == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", total, " bytes for a sequence copy"));
  }
  return absl::OkStatus();
}

void HostMappingDeleter::operator()(char* p) const { munmap(p, size); }

std::shared_ptr<const SequenceSource> SequenceSource::Of(std::shared_ptr<const SequenceData> data) {
  auto source = std::make_shared<SequenceSource>();
  source->length = data->length;
  source->num_layers = data->num_layers;
  if (data->length > 0) {
    for (int32_t layer = 0; layer < data->num_layers; ++layer) {
      source->spans.push_back({layer, 0, data->length, data->k(layer), data->v(layer), false});
    }
  }
  source->holders.push_back(std::move(data));
  return source;
}

absl::StatusOr<std::unique_ptr<Tiers>> Tiers::Create(const Options& options, Backend* backend,
                                                     Metrics* metrics) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend is null");
  if (options.num_layers <= 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (options.host_pages < 0 || options.host_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("host_pages must be in [0, 2^31)");
  }
  if (options.offload_lru && options.host_pages == 0) {
    return absl::InvalidArgumentError("the lru offload policy needs a host tier (host_pages > 0)");
  }
  char* memory = nullptr;
  std::unique_ptr<BlockAllocator> allocator;
  if (options.host_pages > 0) {
    absl::StatusOr<std::unique_ptr<BlockAllocator>> a =
        BlockAllocator::Create({.num_pages = options.host_pages});
    if (!a.ok()) return a.status();
    allocator = *std::move(a);
    absl::StatusOr<char*> m =
        backend->AllocateHostMemory(2 * int64_t{options.num_layers} * options.host_pages * options.model.page_bytes());
    if (!m.ok()) return m.status();
    memory = *m;
  }
  if (metrics != nullptr) metrics->SetHostTier(options.host_pages, options.host_pages, 0);
  return std::unique_ptr<Tiers>(new Tiers(options, backend, metrics, memory, std::move(allocator)));
}

Tiers::Tiers(const Options& options, Backend* backend, Metrics* metrics, char* host_memory,
             std::unique_ptr<BlockAllocator> host_allocator)
    : options_(options),
      backend_(backend),
      metrics_(metrics),
      host_memory_(host_memory),
      host_allocator_(std::move(host_allocator)) {}

char* Tiers::HostK(int32_t layer, int32_t host_page) const {
  return host_memory_ + (int64_t{layer} * options_.host_pages + host_page) * options_.model.page_bytes();
}

char* Tiers::HostV(int32_t layer, int32_t host_page) const {
  return HostK(layer, host_page) + int64_t{options_.num_layers} * options_.host_pages * options_.model.page_bytes();
}

absl::Status Tiers::Failed(absl::Status s) {
  if (!s.ok() && options_.backend_failed) options_.backend_failed(s);
  return s;
}

std::vector<PageRun> Tiers::HostRuns(std::vector<SequenceTable::PageMove> moves) const {
  std::sort(moves.begin(), moves.end(),
            [](const auto& a, const auto& b) { return a.device < b.device; });
  std::vector<PageRun> runs;
  for (int32_t layer = 0; layer < options_.num_layers; ++layer) {
    for (size_t i = 0; i < moves.size();) {
      size_t j = i + 1;
      while (j < moves.size() && moves[j].device == moves[j - 1].device + 1 &&
             moves[j].host == moves[j - 1].host + 1) {
        ++j;
      }
      runs.push_back(PageRun{layer, moves[i].device, static_cast<int32_t>(j - i),
                             HostK(layer, moves[i].host), HostV(layer, moves[i].host)});
      i = j;
    }
  }
  return runs;
}

absl::Status Tiers::Offload(SequenceTable& table, uint64_t id) {
  std::vector<SequenceTable::PageMove> moves;
  if (absl::Status s = table.Offload(id, &moves); !s.ok()) return s;
  if (!moves.empty()) {
    if (absl::Status s = Failed(backend_->ReadPages(HostRuns(moves))); !s.ok()) return s;
  }
  if (metrics_ != nullptr) {
    metrics_->RecordOffload(static_cast<int64_t>(moves.size()) * 2 * options_.num_layers * options_.model.page_bytes());
  }
  return absl::OkStatus();
}

absl::Status Tiers::Restore(SequenceTable& table, uint64_t id) {
  if (!table.IsOffloaded(id)) return absl::OkStatus();
  const absl::Time begin = absl::Now();
  std::vector<SequenceTable::PageMove> moves;
  if (absl::Status s = table.Restore(id, &moves); !s.ok()) return s;
  if (!moves.empty()) {
    if (absl::Status s = Failed(backend_->WritePages(HostRuns(moves))); !s.ok()) return s;
  }
  if (metrics_ != nullptr) {
    metrics_->RecordRestore(static_cast<int64_t>(moves.size()) * 2 * options_.num_layers * options_.model.page_bytes());
    metrics_->RecordStage(Metrics::Stage::kRestore, absl::ToDoubleSeconds(absl::Now() - begin));
  }
  return absl::OkStatus();
}

absl::Status Tiers::MakeRoom(SequenceTable& table, BlockAllocator& allocator, int64_t pages,
                             const absl::flat_hash_set<uint64_t>& exclude,
                             const absl::flat_hash_set<int32_t>& keep_pages) {
  if (!options_.offload_lru) {
    return absl::ResourceExhaustedError(absl::StrCat("need ", pages, " more free KV pages, ",
                                                     allocator.num_free(), " free"));
  }
  absl::StatusOr<std::vector<uint64_t>> plan = table.PlanOffload(pages, exclude, keep_pages);
  if (!plan.ok()) return plan.status();
  for (uint64_t victim : *plan) {
    // Planned against both tiers' free pages: failing here is a bookkeeping bug or a device error.
    if (absl::Status s = Offload(table, victim); !s.ok()) {
      return absl::IsInternal(s) ? s : absl::InternalError(absl::StrCat("planned offload: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Tiers::PrepareItem(SequenceTable& table, BlockAllocator& allocator,
                                absl::Span<const uint64_t> ids, int32_t layer, int32_t num_tokens,
                                const InFlight& batch) {
  if (!has_host_tier()) return absl::OkStatus();
  const bool step = num_tokens > 0;
  // A step past layer 0 takes no pages, and an offloaded sequence is never mid-step: the item's
  // own checks refuse it.
  if (step && layer != 0) return absl::OkStatus();
  int64_t needed = 0;
  bool any_offloaded = false;
  for (uint64_t id : ids) {
    absl::StatusOr<SequenceTable::View> view = table.Get(id);
    if (!view.ok()) return absl::OkStatus();  // NOT_FOUND from the item's own checks
    if (view->offloaded) {
      any_offloaded = true;
      absl::StatusOr<int64_t> restore = table.RestoreCost(id);
      needed += *restore;
      if (step) {
        // The step's own pages after the restore, and a copy on write of a partial last page
        // that the restore may share (counted always: conservative).
        const int64_t page_size = options_.model.page_size;
        needed += options_.model.pages_for(view->length + num_tokens) -
                  static_cast<int64_t>(view->pages.size()) + (view->length % page_size != 0 ? 1 : 0);
      }
    } else if (step) {
      absl::StatusOr<int64_t> n = table.CheckStep(id, layer, num_tokens);
      if (!n.ok()) return absl::OkStatus();  // the item's own checks say why
      needed += *n;
    }
  }
  if (!any_offloaded && (needed <= allocator.num_free() || !options_.offload_lru)) {
    return absl::OkStatus();
  }
  if (needed > allocator.num_free()) {
    absl::flat_hash_set<uint64_t> exclude(ids.begin(), ids.end());
    for (const auto& item : batch.items) {
      if (item->task) continue;
      if (item->is_decode) {
        exclude.insert(item->decode.sequence_ids.begin(), item->decode.sequence_ids.end());
      } else {
        exclude.insert(item->append.sequence_id);
      }
    }
    // Pages whose holders stay: the sources of this batch's copies on write (read at launch; a
    // page freed now could be taken and written by a restore at once, before that), and the
    // pages the item's restores share through links (the costs above count on them).
    absl::flat_hash_set<int32_t> keep;
    for (const PageCopy& c : batch.batch.page_copies) keep.insert(c.src);
    for (uint64_t id : ids) table.LinkedDevicePages(id, &keep);
    if (absl::Status s = MakeRoom(table, allocator, needed - allocator.num_free(), exclude, keep);
        !s.ok()) {
      return s;
    }
  }
  for (uint64_t id : ids) {
    if (absl::Status s = Restore(table, id); !s.ok()) {
      return absl::IsInternal(s) ? s : absl::InternalError(absl::StrCat("planned restore: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SequenceData>> Tiers::Export(SequenceTable& table, uint64_t id,
                                                                 std::shared_ptr<SequenceData> buffer) {
  absl::StatusOr<SequenceTable::View> view = table.Get(id);
  if (!view.ok()) return view.status();
  if (absl::Status s = BetweenSteps(*view, id); !s.ok()) return s;
  std::shared_ptr<SequenceData> data = std::move(buffer);
  if (data == nullptr || data->length != view->length) {
    data = std::make_shared<SequenceData>();
    if (absl::Status s = data->Allocate(options_.num_layers, view->length, options_.model); !s.ok()) {
      return s;
    }
  }
  // Only the pages that hold committed tokens (a step's pages are never here: not mid-step).
  const auto pages = view->pages.subspan(0, data->num_pages);
  if (view->offloaded) {
    // Consecutive host pages lie back to back in the host tier: one copy per stretch of them.
    const int64_t page_bytes = options_.model.page_bytes();
    for (int32_t layer = 0; layer < options_.num_layers; ++layer) {
      ForEachStretch(pages, [&](size_t i, size_t j) {
        const int64_t at = static_cast<int64_t>(i) * page_bytes;
        const int64_t bytes = static_cast<int64_t>(j - i) * page_bytes;
        std::memcpy(data->k(layer) + at, HostK(layer, pages[i]), bytes);
        std::memcpy(data->v(layer) + at, HostV(layer, pages[i]), bytes);
      });
    }
    return data;
  }
  std::vector<PageRun> runs;
  for (int32_t layer = 0; layer < options_.num_layers; ++layer) {
    AppendRuns(layer, pages, data->k(layer), data->v(layer), data->page_bytes, &runs);
  }
  if (!runs.empty()) {
    if (absl::Status s = Failed(backend_->ReadPages(runs)); !s.ok()) return s;
  }
  return data;
}

absl::StatusOr<int64_t> Tiers::ExportTo(SequenceTable& table, uint64_t id, Tensor& destination,
                                        int64_t piece_bytes, const ExportPiece& on_piece) {
  absl::StatusOr<SequenceTable::View> view = table.Get(id);
  if (!view.ok()) return view.status();
  if (absl::Status s = BetweenSteps(*view, id); !s.ok()) return s;
  const int64_t length = view->length;
  const int64_t page_size = options_.model.page_size;
  const int64_t page_bytes = options_.model.page_bytes();
  const int64_t row_bytes = page_bytes / page_size;
  const int64_t layer_bytes = length * row_bytes;
  const int64_t needed = 2 * int64_t{options_.num_layers} * layer_bytes;
  if (destination.size() < needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "destination holds ", destination.size(), " bytes; sequence ", id, " (", length,
        " tokens x ", options_.num_layers, " layers, K and V) needs ", needed));
  }
  if (length == 0) return length;
  char* const base = destination.mutable_data();
  const auto pages = view->pages.subspan(0, (length + page_size - 1) / page_size);
  // Tokens per piece: whole pages, at least one; without pieces, one backend call for all.
  const bool in_pieces = piece_bytes > 0 && on_piece;
  const int64_t piece_tokens =
      in_pieces ? std::max<int64_t>(1, piece_bytes / (2 * page_bytes)) * page_size : length;
  std::vector<MemoryCopy> copies;  // from the host tier, when offloaded
  std::vector<PageRun> runs;       // from the pool
  const auto copy = [&]() -> absl::Status {
    absl::Status s = view->offloaded ? backend_->CopyFromHost(copies) : backend_->ReadPages(runs);
    copies.clear();
    runs.clear();
    return Failed(s);
  };
  for (int32_t layer = 0; layer < options_.num_layers; ++layer) {
    char* const k_rows = base + 2 * int64_t{layer} * layer_bytes;
    char* const v_rows = k_rows + layer_bytes;
    for (int64_t first = 0; first < length; first += piece_tokens) {
      const int64_t n = std::min(piece_tokens, length - first);
      if (view->offloaded) {
        // One copy per stretch of consecutive host pages; the last one stops at the last row.
        const auto piece = pages.subspan(first / page_size, (n + page_size - 1) / page_size);
        ForEachStretch(piece, [&](size_t i, size_t j) {
          const int64_t at = first * row_bytes + static_cast<int64_t>(i) * page_bytes;
          const int64_t bytes = std::min(static_cast<int64_t>(j - i) * page_bytes, layer_bytes - at);
          copies.push_back({k_rows + at, HostK(layer, piece[i]), bytes, destination.on_device()});
          copies.push_back({v_rows + at, HostV(layer, piece[i]), bytes, destination.on_device()});
        });
      } else {
        AppendTokenRuns(layer, pages, first, n, options_.model, k_rows + first * row_bytes,
                        v_rows + first * row_bytes, destination.on_device(), &runs);
      }
      if (!in_pieces) continue;
      if (absl::Status s = copy(); !s.ok()) return s;
      on_piece(length, layer, first, n);
    }
  }
  if (!in_pieces) {
    if (absl::Status s = copy(); !s.ok()) return s;
  }
  return length;
}

absl::StatusOr<std::vector<int32_t>> Tiers::Reserve(SequenceTable& table, BlockAllocator& allocator,
                                                    uint64_t id, int64_t length) {
  if (table.Contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
  }
  const int64_t num_pages = options_.model.pages_for(length);
  if (num_pages > allocator.num_free()) {
    if (absl::Status s = MakeRoom(table, allocator, num_pages - allocator.num_free(), {});
        !s.ok()) {
      if (!absl::IsResourceExhausted(s)) return s;
      return absl::ResourceExhaustedError(absl::StrCat("import of ", length, " tokens needs ", num_pages,
                                                       " free KV pages, ", allocator.num_free(),
                                                       " free: ", s.message()));
    }
  }
  std::vector<int32_t> pages;
  if (absl::Status s = allocator.Allocate(num_pages, &pages); !s.ok()) return s;
  return pages;
}

absl::Status Tiers::WriteRows(absl::Span<const int32_t> pages, const SequenceSource::Span& span) {
  const int64_t tokens = static_cast<int64_t>(pages.size()) * options_.model.page_size;
  if (span.layer < 0 || span.layer >= options_.num_layers || span.first_token < 0 ||
      span.num_tokens < 1 || span.num_tokens > tokens - span.first_token) {
    return absl::InternalError(absl::StrCat("import span of layer ", span.layer, " tokens [",
                                            span.first_token, ", +", span.num_tokens,
                                            ") outside the sequence's ", pages.size(), " pages"));
  }
  std::vector<PageRun> runs;
  AppendTokenRuns(span.layer, pages, span.first_token, span.num_tokens, options_.model, span.k,
                  span.v, span.on_device, &runs);
  return Failed(backend_->WritePages(runs));
}

absl::Status Tiers::EndImport(SequenceTable& table, BlockAllocator& allocator, uint64_t id,
                              int64_t length, std::vector<int32_t> pages, bool commit) {
  const absl::Status s = commit ? table.Adopt(id, length, &pages) : absl::OkStatus();
  for (int32_t page : pages) (void)allocator.Unref(page);  // none left once adopted
  return s;
}

}  // namespace pagedattn
