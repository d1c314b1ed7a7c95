#include "server/backend/host_ring.h"

namespace pagedattn {

namespace {

int64_t AlignUp(int64_t n) {
  constexpr int64_t a = HostRing::kAlignment;
  return (n + a - 1) / a * a;
}

}  // namespace

HostBlock& HostBlock::operator=(HostBlock&& other) noexcept {
  if (this != &other) {
    Reset();
    ring_ = other.ring_;
    data_ = other.data_;
    size_ = other.size_;
    id_ = other.id_;
    other.ring_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void HostBlock::Reset() {
  if (ring_ != nullptr) ring_->Free(id_);
  ring_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

HostRing::HostRing(char* base, int64_t bytes) : base_(base), bytes_(bytes) {}

HostBlock HostRing::Take(int64_t bytes) {
  HostBlock block;
  if (bytes <= 0) return block;
  const int64_t need = AlignUp(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  // A record that wraps owns the skipped end of the region [begin, bytes_) and its data lies
  // at [0, end).
  Record r;
  if (records_.empty()) {
    if (need > bytes_) return block;
    r = {0, need, false, false};
  } else {
    const int64_t tail = records_.front().begin;
    const bool wrapped = head_ <= tail;  // a live ring that has not wrapped has head_ > tail
    if (!wrapped && bytes_ - head_ >= need) {
      r = {head_, head_ + need, false, false};
    } else if (!wrapped && need <= tail) {
      r = {head_, need, true, false};
    } else if (wrapped && tail - head_ >= need) {
      r = {head_, head_ + need, false, false};
    } else {
      return block;
    }
  }
  head_ = r.end;
  held_ += Size(r);
  records_.push_back(r);
  block.ring_ = this;
  block.data_ = base_ + (r.wraps ? 0 : r.begin);
  block.size_ = need;
  block.id_ = first_id_ + records_.size() - 1;
  return block;
}

void HostRing::Free(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  records_[id - first_id_].freed = true;
  while (!records_.empty() && records_.front().freed) {
    const Record& r = records_.front();
    held_ -= Size(r);
    records_.pop_front();
    ++first_id_;
  }
  if (records_.empty()) head_ = 0;
}

int64_t HostRing::blocks_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(records_.size());
}

int64_t HostRing::bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

}  // namespace pagedattn
