#include "tests/fuzz/kv_model.h"

namespace pagedattn::fuzz {

using Code = absl::StatusCode;

int64_t KvModel::total_tokens() const {
  int64_t total = 0;
  for (const auto& [id, seq] : seqs_) total += seq.length;
  return total;
}

const KvModel::Seq* KvModel::Find(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

int32_t KvModel::refs(int64_t page) const {
  auto it = refs_.find(page);
  return it == refs_.end() ? 0 : it->second;
}

int64_t KvModel::NewPage() {
  const int64_t page = next_page_++;
  refs_[page] = 1;
  return page;
}

bool KvModel::Unref(int64_t page) {
  auto it = refs_.find(page);
  if (--it->second > 0) return false;
  refs_.erase(it);
  freed_.push_back(page);
  return true;
}

absl::StatusCode KvModel::Add(uint64_t id) {
  return seqs_.try_emplace(id).second ? Code::kOk : Code::kAlreadyExists;
}

absl::StatusCode KvModel::Fork(uint64_t parent, uint64_t child) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) return Code::kNotFound;
  if (seqs_.contains(child)) return Code::kAlreadyExists;
  if (it->second.step_tokens != 0) return Code::kFailedPrecondition;
  Seq copy = it->second;
  for (int64_t page : copy.pages) ++refs_[page];
  seqs_.emplace(child, std::move(copy));
  return Code::kOk;
}

absl::StatusCode KvModel::Remove(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return Code::kNotFound;
  for (int64_t page : it->second.pages) Unref(page);
  seqs_.erase(it);
  return Code::kOk;
}

bool KvModel::NeedsCopyOnWrite(const Seq& seq) const {
  return seq.length % page_size_ != 0 && refs(seq.pages.back()) > 1;
}

KvModel::StepCheck KvModel::CheckStep(uint64_t id, int32_t layer, int64_t num_tokens) const {
  if (layer < 0 || layer >= num_layers_) return {Code::kInvalidArgument, 0};
  if (num_tokens <= 0) return {Code::kInvalidArgument, 0};
  const Seq* seq = Find(id);
  if (seq == nullptr) return {Code::kNotFound, 0};
  if (layer == 0) {
    if (seq->step_tokens != 0) return {Code::kFailedPrecondition, 0};
    const int64_t needed = PagesFor(seq->length + num_tokens) -
                           static_cast<int64_t>(seq->pages.size()) +
                           (NeedsCopyOnWrite(*seq) ? 1 : 0);
    return {Code::kOk, needed};
  }
  if (seq->step_tokens == 0 || seq->next_layer != layer || seq->step_tokens != num_tokens) {
    return {Code::kFailedPrecondition, 0};
  }
  return {Code::kOk, 0};
}

absl::StatusCode KvModel::ApplyStep(uint64_t id, int32_t layer, int32_t num_tokens,
                                    StepResult* result) {
  const StepCheck check = CheckStep(id, layer, num_tokens);
  if (check.code != Code::kOk) return check.code;
  if (check.needed > num_free()) return Code::kResourceExhausted;
  Seq& seq = seqs_.at(id);
  *result = StepResult{};
  if (layer == 0) {
    int64_t fresh = check.needed;
    if (NeedsCopyOnWrite(seq)) {
      const int64_t shared = seq.pages.back();
      const int64_t copy = NewPage();
      --fresh;
      Unref(shared);
      seq.pages.back() = copy;
      result->copy = {shared, copy};
    }
    for (int64_t i = 0; i < fresh; ++i) seq.pages.push_back(NewPage());
    seq.step_tokens = num_tokens;
  }
  result->first_position = seq.length;
  result->visible_tokens = seq.length + num_tokens;
  if (layer == num_layers_ - 1) {
    seq.length += num_tokens;
    seq.step_tokens = 0;
    seq.next_layer = 0;
  } else {
    seq.next_layer = layer + 1;
  }
  result->length = seq.length;
  return Code::kOk;
}

std::vector<int64_t> KvModel::AllocateExternal(int64_t count) {
  std::vector<int64_t> pages;
  for (int64_t i = 0; i < count; ++i) pages.push_back(NewPage());
  return pages;
}

void KvModel::AddRefExternal(int64_t page) { ++refs_.at(page); }

bool KvModel::UnrefExternal(int64_t page) { return Unref(page); }

std::vector<int64_t> KvModel::TakeFreed() {
  std::vector<int64_t> out;
  out.swap(freed_);
  return out;
}

}  // namespace pagedattn::fuzz
