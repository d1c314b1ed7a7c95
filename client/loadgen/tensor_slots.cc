#include "client/loadgen/tensor_slots.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/shm_region.h"
#if PAGEDATTN_LOADGEN_CUDA
#include "client/cuda_region.h"
#endif

namespace pagedattn::loadgen {

namespace {

constexpr int64_t kAlign = 256;
int64_t Up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

class SystemMemory final : public TensorSlots::Memory {
 public:
  explicit SystemMemory(client::SharedMemoryRegion region) : region_(std::move(region)) {}
  absl::Status Write(int64_t offset, const char* src, int64_t n) override {
    std::memcpy(region_.data() + offset, src, static_cast<size_t>(n));
    return absl::OkStatus();
  }
  absl::Status Read(int64_t offset, char* dst, int64_t n) const override {
    std::memcpy(dst, region_.data() + offset, static_cast<size_t>(n));
    return absl::OkStatus();
  }
  const client::SharedMemoryRegion& region() const { return region_; }

 private:
  client::SharedMemoryRegion region_;
};

#if PAGEDATTN_LOADGEN_CUDA
class CudaMemory final : public TensorSlots::Memory {
 public:
  explicit CudaMemory(CudaRegion region) : region_(std::move(region)) {}
  absl::Status Write(int64_t offset, const char* src, int64_t n) override {
    return region_.CopyFromHost(offset, src, n);
  }
  absl::Status Read(int64_t offset, char* dst, int64_t n) const override {
    return region_.CopyToHost(offset, dst, n);
  }
  const CudaRegion& region() const { return region_; }

 private:
  CudaRegion region_;
};
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<TensorSlots>> TensorSlots::Create(absl::string_view kind,
                                                                 client::Client* client,
                                                                 const kernels::Shape& shape,
                                                                 int32_t slots, int64_t max_batch,
                                                                 int32_t cuda_device,
                                                                 const RandomPool& pool) {
  if (slots < 1 || max_batch < 1) return absl::InvalidArgumentError("TensorSlots: empty");
  Layout l;
  l.q_row = shape.query_bytes();
  l.kv_row = shape.token_bytes();
  l.lse_row = shape.lse_bytes();
  l.k = Up(max_batch * l.q_row);
  l.v = l.k + Up(max_batch * l.kv_row);
  l.output = l.v + Up(max_batch * l.kv_row);
  l.lse = l.output + Up(max_batch * l.q_row);
  l.bytes = l.lse + Up(max_batch * l.lse_row);
  const int64_t total = l.bytes * slots;
  static std::atomic<int> counter{0};
  std::string name = absl::StrCat("loadgen-", kind, "-", getpid(), "-", counter++);
  std::unique_ptr<Memory> memory;
  absl::Status registered;
  if (kind == "system") {
    absl::StatusOr<client::SharedMemoryRegion> region =
        client::SharedMemoryRegion::Create(static_cast<size_t>(total), "pa-loadgen");
    if (!region.ok()) return region.status();
    registered = client->RegisterSystemMemory(name, region->key(), 0, static_cast<uint64_t>(total));
    memory = std::make_unique<SystemMemory>(*std::move(region));
  } else if (kind == "cuda") {
#if PAGEDATTN_LOADGEN_CUDA
    absl::StatusOr<CudaRegion> region = CudaRegion::Create(cuda_device, total);
    if (!region.ok()) return region.status();
    registered = client->RegisterCudaMemory(name, region->ipc_handle(), cuda_device,
                                            static_cast<uint64_t>(total));
    memory = std::make_unique<CudaMemory>(*std::move(region));
#else
    (void)cuda_device;
    return absl::FailedPreconditionError("--tensors=cuda: this loadgen was built without CUDA");
#endif
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--tensors must be inline, system or cuda, got ",
                                                   std::string(kind)));
  }
  if (!registered.ok()) return registered;
  // Random inputs, the same bytes in the region and in the host copy.
  std::string inputs(static_cast<size_t>(total), '\0');
  for (int32_t s = 0; s < slots; ++s) {
    const int64_t base = s * l.bytes;
    const std::string bytes = pool.Slice(l.output);  // q, k and v parts (and their padding)
    std::memcpy(inputs.data() + base, bytes.data(), bytes.size());
  }
  absl::Status written = memory->Write(0, inputs.data(), total);
  auto out = std::unique_ptr<TensorSlots>(
      new TensorSlots(client, slots, l, std::move(name), std::move(memory), std::move(inputs)));
  if (!written.ok()) return written;  // the destructor unregisters
  return out;
}

TensorSlots::TensorSlots(client::Client* client, int32_t slots, const Layout& layout,
                         std::string name, std::unique_ptr<Memory> memory, std::string inputs)
    : client_(client),
      slots_(slots),
      layout_(layout),
      name_(std::move(name)),
      memory_(std::move(memory)),
      inputs_(std::move(inputs)) {}

TensorSlots::~TensorSlots() { (void)client_->UnregisterMemory(name_); }

void TensorSlots::Refer(int32_t slot, int64_t b, bool kv, v1::DecodeRequest* request) const {
  const uint64_t base = static_cast<uint64_t>(slot * layout_.bytes);
  const Layout& l = layout_;
  *request->mutable_q_ref() = client::MakeTensorRef(name_, base + l.q, b * l.q_row);
  if (kv) {
    *request->mutable_k_ref() = client::MakeTensorRef(name_, base + l.k, b * l.kv_row);
    *request->mutable_v_ref() = client::MakeTensorRef(name_, base + l.v, b * l.kv_row);
  }
  *request->mutable_output_ref() = client::MakeTensorRef(name_, base + l.output, b * l.q_row);
  *request->mutable_lse_ref() = client::MakeTensorRef(name_, base + l.lse, b * l.lse_row);
}

absl::string_view TensorSlots::Q(int32_t slot, int64_t b) const {
  return absl::string_view(inputs_).substr(slot * layout_.bytes + layout_.q, b * layout_.q_row);
}
absl::string_view TensorSlots::K(int32_t slot, int64_t b) const {
  return absl::string_view(inputs_).substr(slot * layout_.bytes + layout_.k, b * layout_.kv_row);
}
absl::string_view TensorSlots::V(int32_t slot, int64_t b) const {
  return absl::string_view(inputs_).substr(slot * layout_.bytes + layout_.v, b * layout_.kv_row);
}

absl::Status TensorSlots::ReadOutputs(int32_t slot, int64_t b, std::string* output,
                                      std::string* lse) const {
  const int64_t out_bytes = b * layout_.q_row, lse_bytes = b * layout_.lse_row;
  output->resize(static_cast<size_t>(out_bytes));
  lse->resize(static_cast<size_t>(lse_bytes));
  const int64_t base = slot * layout_.bytes;
  if (absl::Status s = memory_->Read(base + layout_.output, output->data(), out_bytes); !s.ok()) return s;
  return memory_->Read(base + layout_.lse, lse->data(), lse_bytes);
}

}  // namespace pagedattn::loadgen
