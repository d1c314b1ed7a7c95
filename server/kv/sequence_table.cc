#include "server/kv/sequence_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<SequenceTable>> SequenceTable::Create(const Options& options,
                                                                     BlockAllocator* allocator,
                                                                     BlockAllocator* host_allocator) {
  if (options.num_layers <= 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (options.page_size <= 0) return absl::InvalidArgumentError("page_size must be > 0");
  if (allocator == nullptr) return absl::InvalidArgumentError("allocator is null");
  return std::unique_ptr<SequenceTable>(new SequenceTable(options, allocator, host_allocator));
}

bool SequenceTable::IsOffloaded(uint64_t id) const {
  auto it = sequences_.find(id);
  return it != sequences_.end() && it->second.offloaded;
}

absl::Status SequenceTable::UnrefPage(int32_t page, bool host) {
  BlockAllocator* tier = host ? host_allocator_ : allocator_;
  absl::StatusOr<bool> freed = tier->Unref(page);
  if (!freed.ok()) return freed.status();
  if (*freed) {
    auto& from = host ? host_to_device_ : device_to_host_;
    auto& to = host ? device_to_host_ : host_to_device_;
    if (auto link = from.find(page); link != from.end()) {
      to.erase(link->second);
      from.erase(link);
    }
  }
  return absl::OkStatus();
}

void SequenceTable::Touch(uint64_t id) {
  if (auto it = sequences_.find(id); it != sequences_.end()) it->second.last_used = ++use_clock_;
}

absl::Status SequenceTable::Add(uint64_t id) {
  if (!sequences_.try_emplace(id).second) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
  }
  return absl::OkStatus();
}

absl::Status SequenceTable::Fork(uint64_t parent, uint64_t child) {
  auto it = sequences_.find(parent);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("parent sequence ", parent, " not found"));
  }
  if (sequences_.contains(child)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", child, " already exists"));
  }
  if (it->second.step_tokens != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", parent, " is mid-step (next layer ", it->second.next_layer,
                     "): fork between steps"));
  }
  // Check every page first so that a failure (which would be a bookkeeping bug) changes nothing.
  BlockAllocator* tier = TierOf(it->second);
  for (int32_t page : it->second.pages) {
    if (tier->ref_count(page) <= 0) {
      return absl::InternalError(absl::StrCat("sequence ", parent, " holds free page ", page));
    }
  }
  Sequence copy = it->second;  // `it` may be invalidated by the insertion below
  for (int32_t page : copy.pages) {
    if (absl::Status s = tier->AddRef(page); !s.ok()) return s;
  }
  copy.last_used = ++use_clock_;
  total_tokens_ += copy.length;
  if (copy.offloaded) ++num_offloaded_;
  sequences_.emplace(child, std::move(copy));
  return absl::OkStatus();
}

absl::Status SequenceTable::Remove(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  absl::Status result;
  for (int32_t page : it->second.pages) {
    if (absl::Status s = UnrefPage(page, it->second.offloaded); !s.ok()) result = s;
  }
  total_tokens_ -= it->second.length;
  if (it->second.offloaded) --num_offloaded_;
  sequences_.erase(it);
  return result;
}

absl::StatusOr<SequenceTable::View> SequenceTable::Get(uint64_t id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  const Sequence& seq = it->second;
  return View{seq.pages, seq.length, seq.step_tokens, seq.next_layer, seq.offloaded};
}

bool SequenceTable::NeedsCopyOnWrite(const Sequence& seq) const {
  return seq.length % page_size_ != 0 && allocator_->ref_count(seq.pages.back()) > 1;
}

void SequenceTable::Prefetch(absl::Span<const uint64_t> ids) const {
  for (uint64_t id : ids) sequences_.prefetch(id);
  for (uint64_t id : ids) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    const std::vector<int32_t>& pages = it->second.pages;
    const char* const begin = reinterpret_cast<const char*>(pages.data());
    const char* const end = reinterpret_cast<const char*>(pages.data() + pages.size());
    for (const char* p = begin; p < end; p += 64) __builtin_prefetch(p);
    if (!pages.empty()) __builtin_prefetch(end - 1);
  }
}

absl::StatusOr<int64_t> SequenceTable::CheckStep(uint64_t id, int32_t layer,
                                                 int32_t num_tokens) const {
  auto it = sequences_.find(id);
  return CheckStep(id, it == sequences_.end() ? nullptr : &it->second, layer, num_tokens);
}

absl::StatusOr<int64_t> SequenceTable::CheckStep(uint64_t id, const Sequence* found,
                                                 int32_t layer, int32_t num_tokens) const {
  if (layer < 0 || layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", num_layers_, ")"));
  }
  if (num_tokens <= 0) return absl::InvalidArgumentError("num_tokens must be > 0");
  if (found == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  const Sequence& seq = *found;
  if (layer == 0) {
    if (seq.offloaded) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", id, " is offloaded: restore it before a step"));
    }
    if (seq.step_tokens != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", id, ": a step is in progress, expected layer ", seq.next_layer));
    }
    return PagesFor(seq.length + num_tokens) - static_cast<int64_t>(seq.pages.size()) +
           (NeedsCopyOnWrite(seq) ? 1 : 0);
  }
  if (seq.step_tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, ": layer ", layer, " before layer 0 of a step"));
  }
  if (seq.next_layer != layer) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id, ": layer ", layer,
                                                      " out of order, expected ", seq.next_layer));
  }
  if (seq.step_tokens != num_tokens) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", id, ": step of ",
                                                      seq.step_tokens, " tokens, got ", num_tokens,
                                                      " at layer ", layer));
  }
  return 0;
}

absl::StatusOr<SequenceTable::StepResult> SequenceTable::ApplyStep(uint64_t id, int32_t layer,
                                                                   int32_t num_tokens,
                                                                   std::vector<PageCopy>* copies) {
  auto it = sequences_.find(id);
  Sequence* const found = it == sequences_.end() ? nullptr : &it->second;
  absl::StatusOr<int64_t> needed = CheckStep(id, found, layer, num_tokens);
  if (!needed.ok()) return needed.status();
  Sequence& seq = *found;
  if (*needed > allocator_->num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence ", id, ": need ", *needed,
                                                     " free KV pages, ", allocator_->num_free(),
                                                     " free"));
  }
  seq.last_used = ++use_clock_;
  if (layer == 0) {
    const bool cow = NeedsCopyOnWrite(seq);
    // The fresh pages go straight to the end of the list (no vector of their own per step); a
    // copy on write then moves the first of them over the shared last page.
    const size_t old_size = seq.pages.size();
    if (absl::Status s = allocator_->Allocate(*needed, &seq.pages); !s.ok()) return s;
    if (cow) {
      const int32_t shared = seq.pages[old_size - 1];
      const int32_t copy = seq.pages[old_size];
      copies->push_back(PageCopy{shared, copy});
      // The page was shared (count > 1), so this only drops our reference.
      (void)allocator_->Unref(shared);
      seq.pages[old_size - 1] = copy;
      seq.pages.erase(seq.pages.begin() + static_cast<std::ptrdiff_t>(old_size));
    }
    if (!cow && seq.length % page_size_ != 0) {
      // The step writes into this page past its tokens: a host copy of it no longer matches.
      const int32_t written = seq.pages[old_size - 1];
      if (auto link = device_to_host_.find(written); link != device_to_host_.end()) {
        host_to_device_.erase(link->second);
        device_to_host_.erase(link);
      }
    }
    seq.step_tokens = num_tokens;
  }
  StepResult result;
  result.first_position = seq.length;
  result.visible_tokens = seq.length + num_tokens;
  if (layer == num_layers_ - 1) {
    seq.length += num_tokens;
    total_tokens_ += num_tokens;
    seq.step_tokens = 0;
    seq.next_layer = 0;
  } else {
    seq.next_layer = layer + 1;
  }
  result.length = seq.length;
  result.pages = seq.pages;
  return result;
}

absl::Status SequenceTable::Adopt(uint64_t id, int64_t length, std::vector<int32_t>* pages) {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
  }
  if (static_cast<int64_t>(pages->size()) != PagesFor(length)) {
    return absl::InternalError(absl::StrCat(pages->size(), " pages for a sequence of ", length, " tokens"));
  }
  Sequence seq;
  seq.pages = std::move(*pages);
  pages->clear();
  seq.length = length;
  seq.last_used = ++use_clock_;
  total_tokens_ += length;
  sequences_.emplace(id, std::move(seq));
  return absl::OkStatus();
}

}  // namespace pagedattn
