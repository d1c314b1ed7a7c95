// KvModel: a deliberately plain model of the KV bookkeeping (BlockAllocator + SequenceTable, as
// the engine drives them), written from their header contracts, for the fuzz targets to check
// the real thing against.
//
// Pages are abstract ids that the model makes up (never reused); a fuzz target binds each to the
// real page id it observes and checks that no two live abstract pages ever share a real one.
// Sequences hold lists of abstract pages; a page's reference count is the number of holders
// (sequences, and "external" holders standing for direct allocator calls). Error results are
// status codes, in the order the real components check them; an error changes nothing.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace pagedattn::fuzz {

class KvModel {
 public:
  struct Seq {
    std::vector<int64_t> pages;  // abstract pages in token order (covering length + step_tokens)
    int64_t length = 0;          // committed tokens
    int32_t step_tokens = 0;     // tokens of the step in progress, 0 when none
    int32_t next_layer = 0;      // the layer the step in progress expects next
  };

  // What CheckStep would answer: a code and, when OK, the free pages the step layer takes.
  struct StepCheck {
    absl::StatusCode code = absl::StatusCode::kOk;
    int64_t needed = 0;
  };

  struct StepResult {
    int64_t first_position = 0;
    int64_t visible_tokens = 0;
    int64_t length = 0;
    std::optional<std::pair<int64_t, int64_t>> copy;  // copy on write: {old page, new page}
  };

  KvModel(int32_t num_layers, int64_t num_pages, int32_t page_size)
      : num_layers_(num_layers), num_pages_(num_pages), page_size_(page_size) {}

  int32_t num_layers() const { return num_layers_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const { return num_pages_ - static_cast<int64_t>(refs_.size()); }
  int64_t total_tokens() const;
  const std::map<uint64_t, Seq>& sequences() const { return seqs_; }
  const Seq* Find(uint64_t id) const;
  // Held abstract pages and their reference counts.
  const std::map<int64_t, int32_t>& held() const { return refs_; }
  int32_t refs(int64_t page) const;

  absl::StatusCode Add(uint64_t id);
  absl::StatusCode Fork(uint64_t parent, uint64_t child);
  absl::StatusCode Remove(uint64_t id);

  StepCheck CheckStep(uint64_t id, int32_t layer, int64_t num_tokens) const;
  // CheckStep's code, then RESOURCE_EXHAUSTED when fewer than `needed` pages are free; applies
  // the step layer when OK.
  absl::StatusCode ApplyStep(uint64_t id, int32_t layer, int32_t num_tokens, StepResult* result);

  // Direct allocator use: `count` fresh pages held once each by an outside holder (the caller
  // checks count <= num_free()); one more or one fewer outside reference to a held page.
  std::vector<int64_t> AllocateExternal(int64_t count);
  void AddRefExternal(int64_t page);
  bool UnrefExternal(int64_t page);  // whether the page became free

  // Abstract pages freed since the last call.
  std::vector<int64_t> TakeFreed();

 private:
  int64_t PagesFor(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  bool NeedsCopyOnWrite(const Seq& seq) const;
  int64_t NewPage();
  bool Unref(int64_t page);

  const int32_t num_layers_;
  const int64_t num_pages_;
  const int32_t page_size_;
  std::map<uint64_t, Seq> seqs_;
  std::map<int64_t, int32_t> refs_;  // held pages only
  std::vector<int64_t> freed_;
  int64_t next_page_ = 0;
};

}  // namespace pagedattn::fuzz
