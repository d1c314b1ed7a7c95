// The shared parts of pagedattn-kernel-bench: error checks, statistics, the L2 flush before a
// timed run, a workload's inputs on the device, and the timing loop every measurement uses.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device_data.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "workload.h"

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace pagedattn::kernels::bench {

namespace pk = pagedattn::kernels;
namespace pt = pagedattn::kernels::testing;

// Exits with a message unless `st` is ok.
void CheckStatus(const pk::KernelStatus& st, const char* what);

// A workload's name without its "_p..." suffix.
std::string ShortName(const std::string& name);

double Median(std::vector<double> v);
double Quantile(std::vector<double> v, double q);

// The streaming-read kernel (bench_common.cu) on `blocks` blocks of 512 threads: reads n 16-byte
// words of `src`.
void LaunchStreamRead(int blocks, cudaStream_t stream, const uint4* src, int64_t n, uint32_t* sink);

// Sets up the streaming-read kernel of FlushMode::kCleanShared to ask for the largest
// shared-memory carveout; call once at start.
void PreferSharedCarveoutForCleanSharedFlush();

// Evicts the workload from L2 before a timed run. kDirty: a 256 MiB memset, which leaves the L2
// full of dirty lines whose write-back the next kernel pays for (triton.testing.do_bench's
// convention). kClean: the same memset, then a 256 MiB streaming read, so the timed kernel starts
// with an L2 of clean, useless lines. kCleanShared: kClean with the read kernel asking for the
// largest shared-memory carveout (an experiment: does the L1/shared reconfiguration between a
// kernel without shared memory and the decoder cost time?).
enum class FlushMode { kDirty, kClean, kCleanShared };

struct Flusher {
  void* buf = nullptr;
  uint32_t* sink = nullptr;
  size_t bytes = size_t{256} << 20;
  int round = 0;
  int sms = 132;
  Flusher(int num_sms) : sms(num_sms) {
    CHECK_CUDA(cudaMalloc(&buf, bytes));
    CHECK_CUDA(cudaMalloc(&sink, 4));
  }
  ~Flusher() {
    cudaFree(buf);
    cudaFree(sink);
  }
  // end_stamp (clean modes): raised to the read kernel's last CTA end (%globaltimer).
  void Flush(cudaStream_t s, FlushMode mode, unsigned long long* end_stamp = nullptr);
};

// The device's read bandwidth ceiling: the streaming-read kernel over 4 GiB, the best of 2, 4
// and 8 blocks per SM (GB/s).
double StreamReadGBps(cudaStream_t stream, int sms);

struct Timing {
  double median_us = 0, p10_us = 0, p90_us = 0, plan_us = 0;
};

struct DeviceInputs {
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  int32_t* indices = nullptr;
  float* lse = nullptr;
  pk::DecodeArgs args;
  void Init(const pt::Workload& w, uint64_t seed) {
    const int64_t cache = w.num_pages * pk::kPageElems;
    CHECK_CUDA(cudaMalloc(&q, std::max<int64_t>(1, w.batch_size * pk::kQueryElems) * 2));
    CHECK_CUDA(cudaMalloc(&k, cache * 2));
    CHECK_CUDA(cudaMalloc(&v, cache * 2));
    CHECK_CUDA(cudaMalloc(&out, std::max<int64_t>(1, w.batch_size * pk::kQueryElems) * 2));
    CHECK_CUDA(cudaMalloc(&lse, std::max<int64_t>(1, int64_t{w.batch_size} * pk::kNumQoHeads) * 4));
    CHECK_CUDA(cudaMalloc(&indices, std::max<size_t>(1, w.kv_indices.size()) * 4));
    CHECK_CUDA(cudaMemcpy(indices, w.kv_indices.data(), w.kv_indices.size() * 4,
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(static_cast<cudaError_t>(pt::FillNormalBf16(q, w.batch_size * pk::kQueryElems, seed, nullptr)));
    CHECK_CUDA(static_cast<cudaError_t>(pt::FillNormalBf16(k, cache, seed + 1, nullptr)));
    CHECK_CUDA(static_cast<cudaError_t>(pt::FillNormalBf16(v, cache, seed + 2, nullptr)));
    CHECK_CUDA(cudaDeviceSynchronize());
    args.q = q;
    args.k_cache = k;
    args.v_cache = v;
    args.kv_indices = indices;
    args.output = out;
    args.lse = lse;
    args.batch_size = w.batch_size;
    args.num_pages = w.num_pages;
    args.sm_scale = 1.0f / std::sqrt(128.0f);
  }
  ~DeviceInputs() {
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(out);
    cudaFree(lse);
    cudaFree(indices);
  }
};

// Times `launch` (work issued on `stream`) the bench's way: 5 warm-up runs, then `iters` runs,
// each after a flush, bracketed by CUDA events.
template <typename Launch>
Timing TimeRuns(Flusher& flusher, FlushMode mode, cudaStream_t stream, int iters,
                const Launch& launch) {
  Timing t;
  for (int r = 0; r < 5; ++r) launch();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int r = 0; r < iters; ++r) {
    flusher.Flush(stream, mode);
    CHECK_CUDA(cudaEventRecord(ev[2 * r], stream));
    launch();
    CHECK_CUDA(cudaEventRecord(ev[2 * r + 1], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us(iters);
  for (int r = 0; r < iters; ++r) {
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
    us[r] = ms * 1e3;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  t.median_us = Median(us);
  t.p10_us = Quantile(us, 0.1);
  t.p90_us = Quantile(us, 0.9);
  return t;
}

// Plans `w` once (timed on the host), then times the decoder's Run with TimeRuns.
Timing TimeDecoder(pk::CudaDecoder& decoder, const pt::Workload& w, DeviceInputs& in,
                   Flusher& flusher, FlushMode mode, cudaStream_t stream, int iters);

}  // namespace pagedattn::kernels::bench
