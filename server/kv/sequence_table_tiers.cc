// SequenceTable's host tier (sequence_table.h): offload and restore of whole sequences, the
// links that keep shared pages shared across the tiers, and the lru plan.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/kv/sequence_table.h"

namespace pagedattn {

absl::StatusOr<int64_t> SequenceTable::OffloadCost(uint64_t id) const {
  if (host_allocator_ == nullptr) return absl::FailedPreconditionError("the server has no host tier");
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  const Sequence& seq = it->second;
  if (seq.offloaded) return 0;
  if (seq.step_tokens != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " is mid-step (next layer ", seq.next_layer, ")"));
  }
  int64_t cost = 0;
  for (int32_t page : seq.pages) cost += device_to_host_.contains(page) ? 0 : 1;
  return cost;
}

absl::Status SequenceTable::Offload(uint64_t id, std::vector<PageMove>* moves) {
  absl::StatusOr<int64_t> cost = OffloadCost(id);
  if (!cost.ok()) return cost.status();
  Sequence& seq = sequences_.find(id)->second;
  if (seq.offloaded) return absl::OkStatus();
  if (*cost > host_allocator_->num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("offload of sequence ", id, " needs ", *cost,
                                                     " free host pages, ",
                                                     host_allocator_->num_free(), " free"));
  }
  std::vector<int32_t> fresh;
  fresh.reserve(*cost);
  if (absl::Status s = host_allocator_->Allocate(*cost, &fresh); !s.ok()) return s;
  size_t next = 0;
  for (int32_t& page : seq.pages) {
    const int32_t device = page;
    if (auto link = device_to_host_.find(device); link != device_to_host_.end()) {
      page = link->second;
      (void)host_allocator_->AddRef(page);
    } else {
      page = fresh[next++];
      moves->push_back(PageMove{device, page});
      // Others still hold the device page: later offloads of theirs share this copy.
      if (allocator_->ref_count(device) > 1) {
        device_to_host_[device] = page;
        host_to_device_[page] = device;
      }
    }
    (void)UnrefPage(device, /*host=*/false);
  }
  seq.offloaded = true;
  ++num_offloaded_;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SequenceTable::RestoreCost(uint64_t id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (!it->second.offloaded) return 0;
  int64_t cost = 0;
  for (int32_t page : it->second.pages) cost += host_to_device_.contains(page) ? 0 : 1;
  return cost;
}

absl::Status SequenceTable::Restore(uint64_t id, std::vector<PageMove>* moves) {
  absl::StatusOr<int64_t> cost = RestoreCost(id);
  if (!cost.ok()) return cost.status();
  Sequence& seq = sequences_.find(id)->second;
  if (!seq.offloaded) return absl::OkStatus();
  if (*cost > allocator_->num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("restore of sequence ", id, " needs ", *cost,
                                                     " free KV pages, ", allocator_->num_free(),
                                                     " free"));
  }
  std::vector<int32_t> fresh;
  fresh.reserve(*cost);
  if (absl::Status s = allocator_->Allocate(*cost, &fresh); !s.ok()) return s;
  size_t next = 0;
  for (int32_t& page : seq.pages) {
    const int32_t host = page;
    if (auto link = host_to_device_.find(host); link != host_to_device_.end()) {
      page = link->second;
      (void)allocator_->AddRef(page);
    } else {
      page = fresh[next++];
      moves->push_back(PageMove{page, host});
      // Other offloaded sequences still hold the host page: their restores share this copy.
      if (host_allocator_->ref_count(host) > 1) {
        host_to_device_[host] = page;
        device_to_host_[page] = host;
      }
    }
    (void)UnrefPage(host, /*host=*/true);
  }
  seq.offloaded = false;
  seq.last_used = ++use_clock_;
  --num_offloaded_;
  return absl::OkStatus();
}

void SequenceTable::LinkedDevicePages(uint64_t id, absl::flat_hash_set<int32_t>* pages) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end() || !it->second.offloaded) return;
  for (int32_t host : it->second.pages) {
    if (auto link = host_to_device_.find(host); link != host_to_device_.end()) {
      pages->insert(link->second);
    }
  }
}

absl::StatusOr<std::vector<uint64_t>> SequenceTable::PlanOffload(
    int64_t device_pages, const absl::flat_hash_set<uint64_t>& exclude,
    const absl::flat_hash_set<int32_t>& keep_pages) const {
  if (host_allocator_ == nullptr) return absl::FailedPreconditionError("the server has no host tier");
  std::vector<std::pair<uint64_t, uint64_t>> candidates;  // (last_used, id)
  for (const auto& [id, seq] : sequences_) {
    if (seq.offloaded || seq.step_tokens != 0 || seq.pages.empty() || exclude.contains(id)) continue;
    if (!keep_pages.empty() &&
        std::any_of(seq.pages.begin(), seq.pages.end(),
                    [&](int32_t page) { return keep_pages.contains(page); })) {
      continue;
    }
    candidates.emplace_back(seq.last_used, id);
  }
  std::sort(candidates.begin(), candidates.end());
  // Simulates the offloads in order: a device page is freed once every holder went, a host
  // page is taken once per device page without a link.
  absl::flat_hash_map<int32_t, int32_t> dropped;  // device page -> references dropped
  absl::flat_hash_set<int32_t> copied;            // device pages given a host copy
  int64_t freed = 0;
  int64_t host_taken = 0;
  std::vector<uint64_t> plan;
  for (const auto& [used, id] : candidates) {
    if (freed >= device_pages) break;
    const Sequence& seq = sequences_.find(id)->second;
    int64_t host_more = 0;
    for (int32_t page : seq.pages) {
      if (!device_to_host_.contains(page) && !copied.contains(page)) ++host_more;
    }
    if (host_taken + host_more > host_allocator_->num_free()) continue;
    host_taken += host_more;
    for (int32_t page : seq.pages) {
      if (!device_to_host_.contains(page)) copied.insert(page);
      if (++dropped[page] == allocator_->ref_count(page)) ++freed;
    }
    plan.push_back(id);
  }
  if (freed < device_pages) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "need ", device_pages, " more free KV pages; offloading idle sequences frees at most ",
        freed, " (host tier: ", host_allocator_->num_free(), " free pages)"));
  }
  return plan;
}

}  // namespace pagedattn
