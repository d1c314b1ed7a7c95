// The CUDA decoder's API when the library is built without nvcc: every call says Unavailable,
// so callers build and link the same either way.
#include "pagedattn/kernels/cuda_decode.h"

namespace pagedattn::kernels {

struct CudaDecoder::Impl {};

namespace {
KernelStatus NoCuda() {
  return KernelStatus::Error(KernelCode::kUnavailable, "pagedattn was built without CUDA");
}
}  // namespace

KernelStatus CheckCudaDecodeDevice(int32_t) { return NoCuda(); }
int32_t CudaDecodeDeviceCount() { return 0; }
CudaDecoder::CudaDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDecoder::~CudaDecoder() = default;
KernelStatus CudaDecoder::Create(const Options&, std::unique_ptr<CudaDecoder>*) { return NoCuda(); }
KernelStatus CudaDecoder::Plan(const int32_t*, const int32_t*, int32_t, CudaStream,
                               const int32_t*) {
  return NoCuda();
}
KernelStatus CudaDecoder::PlanInto(const int32_t*, const int32_t*, int32_t, void*, void*, size_t*,
                                   const int32_t*) {
  return NoCuda();
}
size_t CudaDecoder::table_bytes() const { return 0; }
KernelStatus CudaDecoder::Run(const DecodeArgs&, CudaStream) { return NoCuda(); }
KernelStatus CudaDecoder::Run(const DecodeArgs&, const NewTokenRows&, CudaStream) {
  return NoCuda();
}
void CudaDecoder::SetTimelineForBenchmark(uint64_t*) {}
int32_t CudaDecoder::num_ctas() const { return 0; }
int32_t CudaDecoder::threads_per_cta() const { return 0; }
size_t CudaDecoder::shared_memory_bytes() const { return 0; }
CudaLoadPath CudaDecoder::load_path() const { return CudaLoadPath::kTma; }
int32_t CudaDecoder::max_batch_size() const { return 0; }

}  // namespace pagedattn::kernels
