// CountingBackend: any backend, with its page transfers counted and timed. Every call is
// forwarded unchanged; ReadPages, WritePages and CopyFromHost also count their calls, the copies
// they ask for (a PageRun is one copy of K and one of V; a MemoryCopy is one copy) and the
// seconds spent inside them. The tier tests use it to check that a whole sequence moves in one
// run per layer, and the tier benches to tell the copies' time from the engine's own.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "server/backend/backend.h"

namespace pagedattn::testing {

class CountingBackend final : public Backend {
 public:
  struct Counts {
    int64_t calls = 0;    // ReadPages + WritePages + CopyFromHost calls
    int64_t copies = 0;   // K and V copies (2 per run) and MemoryCopy entries
    int64_t bytes = 0;    // bytes copied, K and V together
    double seconds = 0;   // inside the transfer calls
  };

  explicit CountingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  // Counts since the last Reset (thread-safe; transfers come from the engine's executor).
  Counts counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_ = {};
  }

  std::string_view name() const override { return inner_->name(); }
  absl::Status Init(const PoolShape& shape) override {
    page_bytes_ = shape.model.page_bytes();
    return inner_->Init(shape);
  }
  int32_t max_in_flight() const override { return inner_->max_in_flight(); }
  absl::Status Launch(BackendBatch* batch) override { return inner_->Launch(batch); }
  absl::Status Wait(BackendBatch* batch) override { return inner_->Wait(batch); }
  bool Ready(const BackendBatch& batch) override { return inner_->Ready(batch); }
  HostBlock TakeHostBlock(int64_t bytes) override { return inner_->TakeHostBlock(bytes); }
  absl::StatusOr<char*> OpenDeviceMemory(std::string_view ipc_handle, int32_t device_id,
                                         int64_t bytes) override {
    return inner_->OpenDeviceMemory(ipc_handle, device_id, bytes);
  }
  void CloseDeviceMemory(char* data) override { inner_->CloseDeviceMemory(data); }
  absl::Status PinHostMemory(char* data, int64_t bytes) override {
    return inner_->PinHostMemory(data, bytes);
  }
  void UnpinHostMemory(char* data) override { inner_->UnpinHostMemory(data); }
  absl::StatusOr<char*> AllocateHostMemory(int64_t bytes) override {
    return inner_->AllocateHostMemory(bytes);
  }

  absl::Status ReadPages(const std::vector<PageRun>& runs) override {
    return Timed(RunBytes(runs), 2 * static_cast<int64_t>(runs.size()),
                 [&] { return inner_->ReadPages(runs); });
  }
  absl::Status WritePages(const std::vector<PageRun>& runs) override {
    return Timed(RunBytes(runs), 2 * static_cast<int64_t>(runs.size()),
                 [&] { return inner_->WritePages(runs); });
  }
  absl::Status CopyFromHost(const std::vector<MemoryCopy>& copies) override {
    int64_t bytes = 0;
    for (const MemoryCopy& c : copies) bytes += c.bytes;
    return Timed(bytes, static_cast<int64_t>(copies.size()),
                 [&] { return inner_->CopyFromHost(copies); });
  }

 private:
  int64_t RunBytes(const std::vector<PageRun>& runs) const {
    int64_t bytes = 0;
    for (const PageRun& r : runs) bytes += 2 * r.CopyBytes(page_bytes_);
    return bytes;
  }
  template <typename F>
  absl::Status Timed(int64_t bytes, int64_t copies, F&& transfer) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = transfer();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    counts_.calls += 1;
    counts_.copies += copies;
    counts_.bytes += bytes;
    counts_.seconds += seconds;
    return s;
  }

  const std::unique_ptr<Backend> inner_;
  int64_t page_bytes_ = 0;  // set by Init, before any transfer
  mutable std::mutex mu_;
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn::testing
