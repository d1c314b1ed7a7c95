// pagedattn-kernel-bench: times the CUDA decoder on every workload of a JSONL file.
//
// Method: first a plain streaming-read kernel over 4 GiB gives the read bandwidth ceiling of
// this device. Then, per workload, fresh random normal data; the plan is made once; each timed
// run is preceded by an L2 flush, a 256 MiB memset followed by a 256 MiB read (so the kernel
// starts with no useful and no dirty lines in the 60 MB L2; "dirty" figures skip the read);
// CUDA events bracket the decode launch alone; the median over --iters runs (default 200) is
// reported, for the TMA and the cp.async load path. Read bandwidth counts the
// K and V bytes the batch needs: tokens x 4 heads x 128 x 2 bytes x 2.
// Floors, timed the same way (--floors, on by default): per workload, the same streaming-read
// kernel over exactly the workload's K and V bytes, contiguous (the best of 1, 2 and 4 blocks
// per SM): what any kernel that reads those bytes once pays, launch and ramp included; once,
// empty kernels (plain, with the decoder's shared memory, and followed by a programmatic
// dependent launch that waits for it): the cost of a launch as the events see it.
// Output: a table on stdout and one JSON object per workload in --out.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device_data.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/kv_write.h"
#include "pagedattn/kernels/decode.h"
#include "workload.h"

namespace pk = pagedattn::kernels;
namespace pt = pagedattn::kernels::testing;

namespace {

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

void CheckStatus(const pk::KernelStatus& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message.c_str());
    std::exit(1);
  }
}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Reads n 16-byte words. kPreferShared: the same kernel, set up at start to ask for the largest
// shared-memory carveout (so that a decode kernel after it needs no L1/shared reconfiguration).
// end_stamp, when non-null: raised to the %globaltimer of each CTA's end.
template <bool kPreferShared>
__global__ void StreamReadKernel(const uint4* __restrict__ src, int64_t n, uint32_t* sink,
                                 unsigned long long* end_stamp) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(src + i);
    const uint4 b = __ldcs(src + i + stride);
    const uint4 c = __ldcs(src + i + 2 * stride);
    const uint4 d = __ldcs(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; practically never true
  if (end_stamp != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(end_stamp, GlobalTimer());
  }
}

__global__ void EmptyKernel() {}

// The two halves of a programmatic dependent launch pair, empty.
__global__ void EmptyPrimaryKernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__global__ void EmptySecondaryKernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

std::string ShortName(const std::string& name) {
  const size_t p = name.rfind("_p");
  return p == std::string::npos ? name : name.substr(0, p);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[static_cast<size_t>(q * (v.size() - 1))];
}

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

void Flusher::Flush(cudaStream_t s, FlushMode mode, unsigned long long* end_stamp) {
  CHECK_CUDA(cudaMemsetAsync(buf, ++round & 0xff, bytes, s));
  const uint4* src = static_cast<const uint4*>(buf);
  if (mode == FlushMode::kClean) {
    StreamReadKernel<false><<<sms * 4, 512, 0, s>>>(src, bytes / 16, sink, end_stamp);
  } else if (mode == FlushMode::kCleanShared) {
    StreamReadKernel<true><<<sms * 4, 512, 0, s>>>(src, bytes / 16, sink, end_stamp);
  }
  CHECK_CUDA(cudaGetLastError());
}

double StreamReadGBps(cudaStream_t stream, int sms) {
  const size_t bytes = size_t{4} << 30;
  uint4* buf = nullptr;
  uint32_t* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(buf, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  double best = 0.0;
  for (int blocks_per_sm : {2, 4, 8}) {
    std::vector<double> us;
    for (int r = 0; r < 23; ++r) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      StreamReadKernel<false><<<sms * blocks_per_sm, 512, 0, stream>>>(buf, bytes / 16, sink, nullptr);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) us.push_back(ms * 1e3);
    }
    const double gbps = bytes / (Median(us) * 1e-6) / 1e9;
    std::printf("stream read, %d blocks/SM x 512 threads: %.0f GB/s (median of 20)\n",
                blocks_per_sm, gbps);
    best = std::max(best, gbps);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(buf);
  cudaFree(sink);
  return best;
}

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

Timing TimeDecoder(pk::CudaDecoder& decoder, const pt::Workload& w, DeviceInputs& in,
                   Flusher& flusher, FlushMode mode, cudaStream_t stream, int iters) {
  const auto p0 = std::chrono::steady_clock::now();
  CheckStatus(decoder.Plan(w.kv_indptr.data(), w.kv_last_page_len.data(), w.batch_size, stream),
              "Plan");
  const auto p1 = std::chrono::steady_clock::now();
  Timing t = TimeRuns(flusher, mode, stream, iters,
                      [&] { CheckStatus(decoder.Run(in.args, stream), "Run"); });
  t.plan_us = std::chrono::duration<double, std::micro>(p1 - p0).count();
  return t;
}

// The floor of a workload: the streaming-read kernel over `bytes` of `src` (contiguous), the
// best median of 1, 2 and 4 blocks of 512 threads per SM.
double StreamFloorUs(const uint4* src, double bytes, uint32_t* sink, int sms, Flusher& flusher,
                     cudaStream_t stream, int iters) {
  double best = 1e30;
  const int64_t n = static_cast<int64_t>(bytes / 16);
  for (int blocks_per_sm : {1, 2, 4}) {
    const Timing t = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
      StreamReadKernel<false><<<sms * blocks_per_sm, 512, 0, stream>>>(src, n, sink, nullptr);
      CHECK_CUDA(cudaGetLastError());
    });
    best = std::min(best, t.median_us);
  }
  return best;
}

// What a launch costs as the events see it, after the same flush: an empty kernel of the
// decoder's grid and block; the same with the decoder's dynamic shared memory; that one as the
// primary of a programmatic dependent launch whose secondary (the merge kernel's grid and
// block) waits for it.
struct LaunchFloors {
  double empty_us = 0, empty_smem_us = 0, pdl_pair_us = 0;
};
LaunchFloors MeasureLaunchFloors(int ctas, int threads, size_t smem, Flusher& flusher,
                                 cudaStream_t stream, int iters) {
  CHECK_CUDA(cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  CHECK_CUDA(cudaFuncSetAttribute(EmptyPrimaryKernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  LaunchFloors f;
  f.empty_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                 EmptyKernel<<<ctas, threads, 0, stream>>>();
                 CHECK_CUDA(cudaGetLastError());
               }).median_us;
  f.empty_smem_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                      EmptyKernel<<<ctas, threads, smem, stream>>>();
                      CHECK_CUDA(cudaGetLastError());
                    }).median_us;
  f.pdl_pair_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                    EmptyPrimaryKernel<<<ctas, threads, smem, stream>>>();
                    CHECK_CUDA(cudaGetLastError());
                    cudaLaunchConfig_t config = {};
                    config.gridDim = dim3(ctas);
                    config.blockDim = dim3(128);
                    config.stream = stream;
                    cudaLaunchAttribute attribute;
                    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attribute.val.programmaticStreamSerializationAllowed = 1;
                    config.attrs = &attribute;
                    config.numAttrs = 1;
                    CHECK_CUDA(cudaLaunchKernelEx(&config, EmptySecondaryKernel));
                  }).median_us;
  return f;
}

// The workload with its pages renumbered 0, 1, 2, ... in batch order: the same shape over a
// contiguous stretch of the pool (the locality experiment).
pt::Workload Contiguous(const pt::Workload& w) {
  pt::Workload c = w;
  std::iota(c.kv_indices.begin(), c.kv_indices.end(), 0);
  c.num_pages = std::max<int64_t>(w.num_pages, static_cast<int64_t>(c.kv_indices.size()));
  return c;
}

// One clean-flushed run with per-CTA %globaltimer stamps: where the time of a launch goes. Times
// are from the end of the flush's read kernel (its last CTA), the event that starts a timed run.
// `detail`: also the 6 CTAs that finished last and the 3 that finished first, with their SM,
// items, in-kernel merges, pages, and the time their consumers spent finishing items and
// waiting for pages.
void PrintTimeline(pk::CudaDecoder& decoder, const char* label, const pt::Workload& w,
                   DeviceInputs& in, Flusher& flusher, cudaStream_t stream, bool detail) {
  constexpr int kSlots = 8;  // per CTA (cuda_decode.h, SetTimelineForBenchmark)
  const int n = decoder.num_ctas();
  const size_t stamps = size_t{kSlots} * n + 2;  // + the merge kernel's end, the flush's end
  uint64_t* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, stamps * sizeof(uint64_t)));
  CheckStatus(decoder.Plan(w.kv_indptr.data(), w.kv_last_page_len.data(), w.batch_size, stream),
              "Plan");
  decoder.SetTimelineForBenchmark(dev);
  std::vector<uint64_t> host(stamps);
  for (int r = 0; r < 5; ++r) {
    CHECK_CUDA(cudaMemsetAsync(dev, 0, stamps * sizeof(uint64_t), stream));
    flusher.Flush(stream, FlushMode::kClean, reinterpret_cast<unsigned long long*>(dev + stamps - 1));
    CheckStatus(decoder.Run(in.args, stream), "Run");
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  CHECK_CUDA(cudaMemcpy(host.data(), dev, stamps * 8, cudaMemcpyDeviceToHost));
  decoder.SetTimelineForBenchmark(nullptr);
  cudaFree(dev);
  const uint64_t base = host[stamps - 1];
  auto rel = [&](uint64_t t) { return (static_cast<double>(t) - static_cast<double>(base)) * 1e-3; };
  struct Cta {
    int id;
    double entry, first, last, exit, finish_us, wait_us;
    uint32_t smid, items, merges, pages;
  };
  std::vector<Cta> ctas;
  for (int c = 0; c < n; ++c) {
    const uint64_t* t = &host[size_t{kSlots} * c];
    if (t[0] == 0) continue;
    ctas.push_back({c, rel(t[0]), rel(t[1]), rel(t[2]), rel(t[3]), t[6] * 1e-3, t[7] * 1e-3,
                    static_cast<uint32_t>(t[4] >> 32), static_cast<uint32_t>(t[4]),
                    static_cast<uint32_t>(t[5] >> 32), static_cast<uint32_t>(t[5])});
  }
  auto column = [&](double Cta::*f) {
    std::vector<double> v;
    for (const Cta& c : ctas) v.push_back(c.*f);
    return v;
  };
  auto mn = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  auto mx = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  const std::vector<double> entry = column(&Cta::entry), first = column(&Cta::first),
                            last = column(&Cta::last), exit_t = column(&Cta::exit);
  const uint64_t merge_end = host[size_t{kSlots} * n];
  char merge[48] = "no merge kernel";
  if (merge_end != 0) std::snprintf(merge, sizeof merge, "merge kernel end %.1f", rel(merge_end));
  std::printf("  %-12s %-14s (us from the flush's end; median/max over %zu CTAs): entry "
              "%.1f(min)/%.1f/%.1f  first page %.1f/%.1f  last page %.1f/%.1f  exit %.1f/%.1f  %s\n",
              label, ShortName(w.name).c_str(), ctas.size(), mn(entry), Median(entry), mx(entry),
              Median(first), mx(first), Median(last), mx(last), Median(exit_t), mx(exit_t), merge);
  if (!detail) return;
  std::sort(ctas.begin(), ctas.end(), [](const Cta& a, const Cta& b) { return a.exit > b.exit; });
  std::printf("    cta  sm items merges pages  first   last   exit finish_us wait_us\n");
  for (size_t i = 0; i < ctas.size(); ++i) {
    if (i >= 6 && i + 3 < ctas.size()) continue;
    const Cta& c = ctas[i];
    std::printf("    %3d %3u %5u %6u %5u %6.1f %6.1f %6.1f %9.1f %7.1f\n", c.id, c.smid, c.items,
                c.merges, c.pages, c.first, c.last, c.exit, c.finish_us, c.wait_us);
  }
}

// A batch of `lengths` pages each (full last pages) over distinct random pages of a pool.
pt::Workload Synthetic(const std::string& name, const std::vector<int>& lengths, std::mt19937& rng) {
  pt::Workload w;
  w.name = name;
  w.batch_size = static_cast<int32_t>(lengths.size());
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  w.num_pages = std::max<int64_t>(2 * total, 32768);
  std::vector<int32_t> pool(w.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  w.kv_indptr.push_back(0);
  for (int len : lengths) {
    w.kv_indptr.push_back(w.kv_indptr.back() + len);
    w.kv_last_page_len.push_back(64);
  }
  w.kv_indices.assign(pool.begin(), pool.begin() + total);
  return w;
}


// The service's launch sequence for one decode step of a batch of one request whose rows lie
// in the host ring (server/backend/cuda_backend.cc): the rows (q, then the new token's K and V
// rows) are copied straight from the request's pinned block; the decoder plans into the arena
// (PlanInto) while that copy runs; one copy of the tables (kv_indices, token slots, plan); the
// token scatter; a timing event, Run, a timing event; the outputs copied back; a completion
// event. Timed on the host per step, four ways:
//   direct: what the service does;
//   captured + updated: everything but the plan captured each step and applied to one
//     executable graph with cudaGraphExecUpdate (what a service whose batches change every
//     step would have to do);
//   one replayed: one graph replayed unchanged, no plan, rows from one block: the floor a fixed
//     shape could reach;
//   rows + plan + replay: what a service could do while a batch's shape stays: the rows copied
//     and the plan made each step as in the direct way, the rest one replayed graph (its tables
//     copy reads the arena the plan was just written into, so its parameters stay the same).
//     A service would need first items from the table (CudaDecoderTuning): with them in the
//     launch parameters a replay keeps the captured plan's, right here only because every
//     step's plan is the same.
// Steps alternate between two row blocks (of equal contents), as requests land in different
// blocks of the ring. q and the rows are random normal bf16. Each way's outputs and lse are
// compared with the direct way's (the largest differences are printed; the bench exits
// non-zero past 1e-2 on an output or 1e-4 on an lse, far below what a stale or misplaced input
// would give).
void TimeLaunchSequence(pk::CudaDecoder& decoder, const pt::Workload& w, DeviceInputs& in,
                        cudaStream_t stream, int iters, uint64_t seed) {
  const int64_t b = w.batch_size;
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };  // each section 256-byte aligned
  const size_t q_raw = b * pk::kQueryElems * 2;
  const size_t rows_bytes = q_raw + 2 * b * pk::kTokenElems * 2;  // q | K rows | V rows
  const size_t idx_off = 0;                                       // in the tables section
  const size_t slots_off = align(w.kv_indices.size() * 4);
  const size_t plan_off = slots_off + align(b * 8);
  const size_t tables_bytes = plan_off + decoder.table_bytes();
  const size_t tables_dev = align(rows_bytes);  // the tables section's offset on the device
  const size_t out_bytes = align(q_raw) + b * pk::kNumQoHeads * 4;
  char *blocks[2] = {nullptr, nullptr}, *host_tables = nullptr, *host_out = nullptr;
  char *dev_in = nullptr, *dev_out = nullptr;
  for (char*& block : blocks) CHECK_CUDA(cudaMallocHost(&block, rows_bytes));
  CHECK_CUDA(cudaMallocHost(&host_tables, tables_bytes));
  CHECK_CUDA(cudaMallocHost(&host_out, out_bytes));
  CHECK_CUDA(cudaMalloc(&dev_in, tables_dev + tables_bytes));
  CHECK_CUDA(cudaMalloc(&dev_out, out_bytes));
  {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> normal;
    auto* rows = reinterpret_cast<uint16_t*>(blocks[0]);
    for (size_t i = 0; i < rows_bytes / 2; ++i) rows[i] = pk::FloatToBf16(normal(gen));
    std::memcpy(blocks[1], blocks[0], rows_bytes);
  }
  std::memset(host_tables, 0, tables_bytes);
  std::memcpy(host_tables + idx_off, w.kv_indices.data(), w.kv_indices.size() * 4);
  auto* slots = reinterpret_cast<int64_t*>(host_tables + slots_off);
  for (int64_t s = 0; s < b; ++s) slots[s] = int64_t{w.kv_indices[w.kv_indptr[s]]} * pk::kPageSize;
  char* const dev_tables = dev_in + tables_dev;
  pk::DecodeArgs a = in.args;
  a.q = reinterpret_cast<const uint16_t*>(dev_in);
  a.kv_indices = reinterpret_cast<const int32_t*>(dev_tables + idx_off);
  a.output = reinterpret_cast<uint16_t*>(dev_out);
  a.lse = reinterpret_cast<float*>(dev_out + align(q_raw));
  pk::TokenScatterArgs sc;
  sc.k_cache = in.k;
  sc.v_cache = in.v;
  sc.slots = reinterpret_cast<const int64_t*>(dev_tables + slots_off);
  sc.k_rows = reinterpret_cast<const uint16_t*>(dev_in + q_raw);
  sc.v_rows = reinterpret_cast<const uint16_t*>(dev_in + q_raw + b * pk::kTokenElems * 2);
  sc.num_tokens = b;
  cudaEvent_t start, stop, done;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  size_t tables_used = 0;
  auto plan = [&] {
    size_t used = 0;
    CheckStatus(decoder.PlanInto(w.kv_indptr.data(), w.kv_last_page_len.data(), w.batch_size,
                                 host_tables + plan_off, dev_tables + plan_off, &used),
                "PlanInto");
    tables_used = plan_off + used;
  };
  auto copy_rows = [&](int step) {
    CHECK_CUDA(cudaMemcpyAsync(dev_in, blocks[step % 2], rows_bytes, cudaMemcpyHostToDevice,
                               stream));
  };
  // The device work of a step after the rows; `flags` is cudaEventRecordExternal inside a
  // capture (so that the timing events become graph nodes).
  auto after_rows = [&](unsigned flags) {
    CHECK_CUDA(cudaMemcpyAsync(dev_tables, host_tables, tables_used, cudaMemcpyHostToDevice,
                               stream));
    CheckStatus(pk::LaunchTokenScatter(sc, stream), "LaunchTokenScatter");
    CHECK_CUDA(cudaEventRecordWithFlags(start, stream, flags));
    CheckStatus(decoder.Run(a, stream), "Run");
    CHECK_CUDA(cudaEventRecordWithFlags(stop, stream, flags));
    CHECK_CUDA(cudaMemcpyAsync(host_out, dev_out, out_bytes, cudaMemcpyDeviceToHost, stream));
  };
  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::time_point a0, Clock::time_point a1) {
    return std::chrono::duration<double, std::micro>(a1 - a0).count();
  };
  // Work recorded into a new graph (the caller destroys it).
  auto capture = [&](auto&& work) {
    cudaGraph_t graph = nullptr;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    work();
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    return graph;
  };
  auto instantiate = [&](auto&& work) {
    cudaGraph_t graph = capture(work);
    cudaGraphExec_t exec = nullptr;
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphDestroy(graph));
    return exec;
  };
  cudaGraphExec_t updated = nullptr;
  cudaGraphExec_t fixed = nullptr;
  cudaGraphExec_t tail = nullptr;
  int updates_failed = 0;
  std::vector<char> reference;
  bool all_close = true;
  // The largest differences of host_out from `reference`: outputs (bf16), lse.
  auto differences = [&] {
    const auto* o = reinterpret_cast<const uint16_t*>(host_out);
    const auto* r = reinterpret_cast<const uint16_t*>(reference.data());
    // Equal values (-inf lse included) differ by 0; a NaN on either side counts as infinite.
    auto diff = [](float x, float y) {
      if (x == y) return 0.0f;
      const float d = std::fabs(x - y);
      return std::isnan(d) ? INFINITY : d;
    };
    float out_diff = 0.0f, lse_diff = 0.0f;
    for (int64_t i = 0; i < b * pk::kQueryElems; ++i) {
      out_diff = std::max(out_diff, diff(pk::Bf16ToFloat(o[i]), pk::Bf16ToFloat(r[i])));
    }
    const auto* ol = reinterpret_cast<const float*>(host_out + align(q_raw));
    const auto* rl = reinterpret_cast<const float*>(reference.data() + align(q_raw));
    for (int64_t i = 0; i < b * pk::kNumQoHeads; ++i) {
      lse_diff = std::max(lse_diff, diff(ol[i], rl[i]));
    }
    return std::pair<float, float>(out_diff, lse_diff);
  };
  static const char* const kModes[] = {"direct launches", "graph, captured + updated",
                                       "graph, one replayed", "rows + plan + replay"};
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<double> issue, total, kernel;
    for (int r = 0; r < iters + 20; ++r) {
      const Clock::time_point t0 = Clock::now();
      if (mode == 0) {
        copy_rows(r);
        plan();
        after_rows(cudaEventRecordDefault);
      } else if (mode == 1) {
        plan();
        cudaGraph_t graph = capture([&] {
          copy_rows(r);
          after_rows(cudaEventRecordExternal);
        });
        if (updated != nullptr) {
          cudaGraphExecUpdateResultInfo info;
          if (cudaGraphExecUpdate(updated, graph, &info) != cudaSuccess) {
            cudaGetLastError();
            ++updates_failed;
            CHECK_CUDA(cudaGraphExecDestroy(updated));
            updated = nullptr;
          }
        }
        if (updated == nullptr) CHECK_CUDA(cudaGraphInstantiate(&updated, graph, 0));
        CHECK_CUDA(cudaGraphDestroy(graph));
        CHECK_CUDA(cudaGraphLaunch(updated, stream));
      } else if (mode == 2) {
        if (fixed == nullptr) {
          plan();
          fixed = instantiate([&] {
            copy_rows(0);
            after_rows(cudaEventRecordExternal);
          });
        }
        CHECK_CUDA(cudaGraphLaunch(fixed, stream));
      } else {
        copy_rows(r);
        plan();
        if (tail == nullptr) tail = instantiate([&] { after_rows(cudaEventRecordExternal); });
        CHECK_CUDA(cudaGraphLaunch(tail, stream));
      }
      CHECK_CUDA(cudaEventRecord(done, stream));
      const Clock::time_point t1 = Clock::now();
      CHECK_CUDA(cudaEventSynchronize(done));
      const Clock::time_point t2 = Clock::now();
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (r >= 20) {
        issue.push_back(us(t0, t1));
        total.push_back(us(t0, t2));
        kernel.push_back(ms * 1e3);
      }
    }
    if (mode == 0) reference.assign(host_out, host_out + out_bytes);
    const auto [out_diff, lse_diff] = differences();
    const bool close = out_diff <= 1e-2f && lse_diff <= 1e-4f;
    all_close = all_close && close;
    std::printf("  %-26s issue %6.1f us  issue->done %6.1f us (p90 %6.1f)  kernel %6.1f us  "
                "vs direct: out %.1e lse %.1e%s\n",
                kModes[mode], Median(issue), Median(total), Quantile(total, 0.9), Median(kernel),
                out_diff, lse_diff, close ? "" : "  DIFFERS");
  }
  if (updates_failed > 0) std::printf("  (%d graph updates fell back to a new instantiation)\n", updates_failed);
  for (cudaGraphExec_t exec : {updated, fixed, tail}) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaEventDestroy(done);
  for (char* block : blocks) cudaFreeHost(block);
  cudaFreeHost(host_tables);
  cudaFreeHost(host_out);
  cudaFree(dev_in);
  cudaFree(dev_out);
  if (!all_close) {
    std::fprintf(stderr, "launch sequence: a graph way's outputs differ from the direct way's\n");
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = pt::DefaultWorkloadPath();
  std::string out_path = "kernel_bench.jsonl";
  int iters = 200;
  bool uneven = true;
  bool cpasync = true;
  bool variants = false;
  bool default_cpasync = false;
  bool timelines = false;
  bool sweep = false;
  bool launch_sequence = false;
  bool floors = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--workloads" && i + 1 < argc) path = argv[++i];
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
    else if (a == "--no-uneven") uneven = false;
    else if (a == "--no-cpasync") cpasync = false;
    else if (a == "--variants") variants = true;
    else if (a == "--default-cpasync") default_cpasync = true;
    else if (a == "--timelines") timelines = true;
    else if (a == "--sweep") sweep = true;
    else if (a == "--launch-sequence") launch_sequence = true;
    else if (a == "--no-floors") floors = false;
    else {
      std::fprintf(stderr,
                   "usage: %s [--workloads FILE] [--out FILE] [--iters N] [--no-uneven] "
                   "[--no-cpasync] [--variants] [--timelines] [--sweep] [--launch-sequence] "
                   "[--default-cpasync] [--no-floors]\n",
                   argv[0]);
      return 2;
    }
  }
  std::vector<pt::Workload> workloads;
  std::string error;
  if (!pt::LoadWorkloads(path, &workloads, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double stream_gbps = StreamReadGBps(stream, prop.multiProcessorCount);
  CHECK_CUDA(cudaFuncSetAttribute(StreamReadKernel<true>,
                                  cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared));

  std::unique_ptr<pk::CudaDecoder> tma, cp, alt;
  pk::CudaDecoderOptions options;
  CheckStatus(pk::CudaDecoder::Create(options, &tma), "Create (tma)");
  {
    // The v3 kernel's way (one part per CTA, no run-time queue, merges by the last piece's
    // CTA), TMA, timed side by side.
    pk::CudaDecoderOptions o = options;
    o.tuning.parts_per_cta = 1;
    o.tuning.merge = pk::CudaDecoderTuning::Merge::kInKernel;
    CheckStatus(pk::CudaDecoder::Create(o, &alt), "Create (v3 split and merge)");
  }
  options.load_path = pk::CudaLoadPath::kCpAsync;
  if (cpasync) CheckStatus(pk::CudaDecoder::Create(options, &cp), "Create (cp.async)");
  const pk::CudaDecoderTuning defaults;
  std::printf("decoder: %d CTAs, load path %s, up to %d parts per CTA of >= %d units, merges %s\n",
              tma->num_ctas(),
              tma->load_path() == pk::CudaLoadPath::kTma ? "tma" : "cp.async (tma unavailable)",
              defaults.parts_per_cta, defaults.min_part_units,
              defaults.merge == pk::CudaDecoderTuning::Merge::kAuto ? "auto"
              : defaults.merge == pk::CudaDecoderTuning::Merge::kKernel
                  ? (defaults.merge_wait == pk::CudaDecoderTuning::MergeWait::kCounters
                         ? "by a kernel, on counters"
                         : "by a kernel, after the grid")
                                                                          : "in the decode kernel");

  std::mt19937 rng(std::random_device{}());
  if (uneven) {
    std::vector<int> un(301, 16), uni(275, 32);
    un[0] = 4000;  // 4000 + 300 x 16 = 8800 pages = 275 x 32
    workloads.push_back(Synthetic("uneven_1x4000_300x16", un, rng));
    workloads.push_back(Synthetic("uniform_275x32", uni, rng));
  }

  FILE* out = std::fopen(out_path.c_str(), "w");
  if (out == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  Flusher flusher(prop.multiProcessorCount);
  LaunchFloors launch_floors;
  uint4* floor_buf = nullptr;
  uint32_t* floor_sink = nullptr;
  if (floors) {
    launch_floors = MeasureLaunchFloors(tma->num_ctas(), tma->threads_per_cta(),
                                        tma->shared_memory_bytes(), flusher, stream, iters);
    std::printf("launch floors (median of %d, clean flush): empty kernel %.2f us, with %zu B of "
                "shared memory %.2f us, that + a programmatic dependent kernel waiting for it "
                "%.2f us\n",
                iters, launch_floors.empty_us, tma->shared_memory_bytes(),
                launch_floors.empty_smem_us, launch_floors.pdl_pair_us);
    double most = 0;
    for (const pt::Workload& w : workloads) most = std::max<double>(most, w.Tokens());
    const size_t floor_bytes = static_cast<size_t>(most) * pk::kTokenElems * 2 * 2;
    CHECK_CUDA(cudaMalloc(&floor_buf, floor_bytes));
    CHECK_CUDA(cudaMalloc(&floor_sink, 4));
    CHECK_CUDA(cudaMemset(floor_buf, 0x5a, floor_bytes));
  }
  std::printf("\nkernel_us: median over %d runs, clean L2 flush (memset + read 256 MiB); "
              "dirty: memset only; floor: a contiguous streaming read of the same bytes; "
              "contig: the decoder on the same batch over consecutive pages; cshared: the "
              "decoder after a flush that asks for the largest shared-memory carveout\n", iters);
  std::printf("%-22s %5s %6s %9s %9s %9s %9s %8s %7s %7s %7s %9s %8s %8s %8s\n", "workload",
              "batch", "pages", "tma_us", "tma_dirty", "cpa_us", "cpa_dirty", "GB/s", "of_read",
              "p10", "p90", "v3_us", "floor", "contig", "cshared");
  for (const pt::Workload& w : workloads) {
    DeviceInputs in;
    in.Init(w, rng());
    const Timing tc = TimeDecoder(*tma, w, in, flusher, FlushMode::kClean, stream, iters);
    const Timing td = TimeDecoder(*tma, w, in, flusher, FlushMode::kDirty, stream, iters);
    const Timing ta = TimeDecoder(*alt, w, in, flusher, FlushMode::kClean, stream, iters);
    Timing cc, cd;
    if (cp) {
      cc = TimeDecoder(*cp, w, in, flusher, FlushMode::kClean, stream, iters);
      cd = TimeDecoder(*cp, w, in, flusher, FlushMode::kDirty, stream, iters);
    }
    const bool use_cp = default_cpasync && cp;
    const Timing& k = use_cp ? cc : tc;
    const Timing& kd = use_cp ? cd : td;
    const double bytes = static_cast<double>(w.Tokens()) * pk::kNumKvHeads * pk::kHeadDim * 2 * 2;
    double floor_us = 0, contig_us = 0, cshared_us = 0;
    if (floors) {
      floor_us = StreamFloorUs(floor_buf, bytes, floor_sink, prop.multiProcessorCount, flusher,
                               stream, iters);
      cshared_us = TimeDecoder(*tma, w, in, flusher, FlushMode::kCleanShared, stream, iters).median_us;
      const pt::Workload cw = Contiguous(w);
      DeviceInputs cin;
      cin.Init(cw, rng());
      contig_us = TimeDecoder(*tma, cw, cin, flusher, FlushMode::kClean, stream, iters).median_us;
    }
    const double gbps = bytes / (k.median_us * 1e-6) / 1e9;
    const double gbps_dirty = bytes / (kd.median_us * 1e-6) / 1e9;
    std::printf("%-22s %5d %6zu %9.1f %9.1f %9.1f %9.1f %8.0f %7.3f %7.1f %7.1f %9.1f %8.1f %8.1f "
                "%8.1f\n",
                ShortName(w.name).c_str(), w.batch_size, w.kv_indices.size(), tc.median_us,
                td.median_us, cc.median_us, cd.median_us, gbps, gbps / stream_gbps, k.p10_us,
                k.p90_us, ta.median_us, floor_us, contig_us, cshared_us);
    std::fprintf(out,
                 "{\"name\": \"%s\", \"workload\": \"%s\", \"batch_size\": %d, "
                 "\"num_kv_indices\": %zu, \"tokens\": %lld, \"kv_bytes\": %.0f, "
                 "\"load_path\": \"%s\", \"kernel_us\": %.2f, \"kernel_us_p10\": %.2f, "
                 "\"kernel_us_p90\": %.2f, \"kernel_dirty_us\": %.2f, \"tma_us\": %.2f, "
                 "\"tma_dirty_us\": %.2f, \"cpasync_us\": %.2f, \"cpasync_dirty_us\": %.2f, "
                 "\"read_gbps\": %.1f, \"read_fraction\": %.4f, \"read_gbps_dirty\": %.1f, "
                 "\"read_fraction_dirty\": %.4f, \"stream_read_gbps\": %.1f, "
                 "\"plan_host_us\": %.1f, \"iters\": %d, \"parts_per_cta\": %d, "
                 "\"min_part_units\": %d, \"merge\": \"%s\", \"v3_split_tma_us\": %.2f, "
                 "\"stream_floor_us\": %.2f, \"contig_us\": %.2f, \"clean_shared_flush_us\": %.2f, "
                 "\"empty_kernel_us\": %.2f, \"empty_kernel_smem_us\": %.2f, "
                 "\"pdl_pair_us\": %.2f}\n",
                 ShortName(w.name).c_str(), w.name.c_str(), w.batch_size, w.kv_indices.size(),
                 static_cast<long long>(w.Tokens()), bytes, use_cp ? "cp.async" : "tma",
                 k.median_us, k.p10_us, k.p90_us, kd.median_us, tc.median_us, td.median_us,
                 cc.median_us, cd.median_us, gbps, gbps / stream_gbps, gbps_dirty,
                 gbps_dirty / stream_gbps, stream_gbps, k.plan_us, iters,
                 defaults.parts_per_cta, defaults.min_part_units,
                 defaults.merge == pk::CudaDecoderTuning::Merge::kAuto     ? "auto"
                 : defaults.merge == pk::CudaDecoderTuning::Merge::kInKernel ? "in-kernel"
                 : defaults.merge_wait == pk::CudaDecoderTuning::MergeWait::kCounters
                     ? "kernel-counters"
                     : "kernel-grid",
                 ta.median_us, floor_us, contig_us, cshared_us, launch_floors.empty_us,
                 launch_floors.empty_smem_us, launch_floors.pdl_pair_us);
    std::fflush(out);
  }
  if (variants) {
    std::printf("\nvariants (clean flush, median us):\n");
    pk::CudaDecoderOptions o;
    std::vector<std::pair<std::string, pk::CudaDecoderOptions>> vs;
    o.tuning.tma_l2_promotion_bytes = 0;
    vs.push_back({"tma_promo_none", o});
    o.tuning.tma_l2_promotion_bytes = 256;
    vs.push_back({"tma_promo_256", o});
    o.tuning.tma_l2_promotion_bytes = 128;
    o.tuning.skip_attention = true;
    vs.push_back({"tma_no_math", o});
    o.load_path = pk::CudaLoadPath::kCpAsync;
    vs.push_back({"cpasync_no_math", o});
    for (auto& [vname, vopt] : vs) {
      std::unique_ptr<pk::CudaDecoder> d;
      CheckStatus(pk::CudaDecoder::Create(vopt, &d), "Create (variant)");
      std::printf("  %-16s", vname.c_str());
      for (const pt::Workload& w : workloads) {
        const std::string sn = ShortName(w.name);
        if (sn != "b1_kv361" && sn != "b16_kv993" && sn != "b8_kv3176" && sn != "b16_kv16593") continue;
        DeviceInputs in;
        in.Init(w, rng());
        const Timing t = TimeDecoder(*d, w, in, flusher, FlushMode::kClean, stream, 100);
        std::printf("  %s %.1f", sn.c_str(), t.median_us);
      }
      std::printf("\n");
    }
  }
  if (sweep) {
    // Decoder configurations side by side (one part per CTA; merges i: in the decode kernel,
    // k: merge kernel, a: auto; the v7 options; and the plan's cost per (seq, head) start),
    // TMA, clean flush: median of 100 runs each.
    struct Config {
      char merge;
      bool counters;     // c: the merge kernel starts each group on its counter (else: grid)
      bool shared_tail;  // s: a last page's unused V rows zeroed in shared memory (else: registers)
      int item_cost;     // +N: the plan charges N pages per (seq, head) start
    };
    const std::vector<Config> configs = {{'a', false, true, 0}, {'k', true, false, 0},
                                         {'k', true, false, 1}, {'k', true, false, 2},
                                         {'k', true, false, 4}};
    std::vector<std::unique_ptr<pk::CudaDecoder>> ds;
    std::printf("\nsweep (TMA, clean flush, median us of 100 runs): merge i(n kernel) / k(ernel, "
                "PDL) / a(uto); c: the merge kernel starts each group on its counter (else when "
                "the grid is done); s: a last page's unused V rows zeroed in shared memory (else "
                "in registers); +N: the plan charges N pages per (seq, head) start. as = v6's "
                "default, kc = v7's\n");
    std::printf("%-22s", "workload");
    for (const Config& c : configs) {
      pk::CudaDecoderOptions o;
      using Merge = pk::CudaDecoderTuning::Merge;
      o.tuning.merge = c.merge == 'i' ? Merge::kInKernel : c.merge == 'a' ? Merge::kAuto : Merge::kKernel;
      o.tuning.merge_wait = c.counters ? pk::CudaDecoderTuning::MergeWait::kCounters
                                       : pk::CudaDecoderTuning::MergeWait::kGrid;
      o.tuning.zero_tail_in_shared = c.shared_tail;
      o.tuning.item_cost_pages = c.item_cost;
      ds.emplace_back();
      CheckStatus(pk::CudaDecoder::Create(o, &ds.back()), "Create (sweep)");
      const std::string label = std::string(1, c.merge) + (c.counters ? "c" : "") +
                                (c.shared_tail ? "s" : "") +
                                (c.item_cost > 0 ? "+" + std::to_string(c.item_cost) : "");
      std::printf(" %9s", label.c_str());
    }
    std::printf("\n");
    for (const pt::Workload& w : workloads) {
      DeviceInputs in;
      in.Init(w, rng());
      std::printf("%-22s", ShortName(w.name).c_str());
      for (auto& d : ds) {
        std::printf(" %9.1f", TimeDecoder(*d, w, in, flusher, FlushMode::kClean, stream, 100).median_us);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (launch_sequence) {
    // The service's shapes: B=64 x 4,096 tokens (64 pages each) and B=1 x 512 tokens.
    std::printf("\nlaunch sequence of one service step (median of 500 steps, no flush):\n");
    for (const auto& [name, lengths] :
         std::vector<std::pair<std::string, std::vector<int>>>{{"b64_64pages", std::vector<int>(64, 64)},
                                                              {"b1_8pages", std::vector<int>(1, 8)}}) {
      const pt::Workload w = Synthetic(name, lengths, rng);
      DeviceInputs in;
      in.Init(w, rng());
      std::printf(" %s:\n", name.c_str());
      TimeLaunchSequence(*tma, w, in, stream, 500, rng());
      // The host cost of v6's first work items in the launch parameters (8 KiB per launch).
      pk::CudaDecoderOptions o;  // the defaults, as `tma` (options is cp.async's by now)
      o.tuning.first_items_in_params = false;
      std::unique_ptr<pk::CudaDecoder> table_only;
      CheckStatus(pk::CudaDecoder::Create(o, &table_only), "Create (first items from the table)");
      std::printf(" %s, first items from the table (not the launch parameters):\n", name.c_str());
      TimeLaunchSequence(*table_only, w, in, stream, 500, rng());
    }
  }
  if (variants || timelines) {
    // The default is printed first and last: the first timeline of a workload has shown slow
    // streaming whatever the decoder.
    pk::CudaDecoderOptions o;
    o.tuning.merge = pk::CudaDecoderTuning::Merge::kAuto;
    o.tuning.merge_wait = pk::CudaDecoderTuning::MergeWait::kGrid;
    o.tuning.zero_tail_in_shared = true;
    std::unique_ptr<pk::CudaDecoder> v6;
    CheckStatus(pk::CudaDecoder::Create(o, &v6), "Create (v6 default)");
    std::printf("\ntimelines: default; v6's default; cp.async; the v3 split and merge (TMA); "
                "default again\n");
    for (const pt::Workload& w : workloads) {
      const std::string sn = ShortName(w.name);
      if (sn != "b1_kv361" && sn != "b2_kv130" && sn != "b16_kv993" && sn != "b32_kv1954" &&
          sn != "b16_kv16593" && sn != "b128_kv8761") continue;
      DeviceInputs in;
      in.Init(w, rng());
      const bool detail = sn == "b16_kv993" || sn == "b32_kv1954" || sn == "b128_kv8761";
      PrintTimeline(*tma, "default", w, in, flusher, stream, false);
      PrintTimeline(*v6, "v6", w, in, flusher, stream, detail);
      if (cp) PrintTimeline(*cp, "cp.async", w, in, flusher, stream, false);
      PrintTimeline(*alt, "v3", w, in, flusher, stream, false);
      PrintTimeline(*tma, "default", w, in, flusher, stream, detail);
    }
  }
  std::fclose(out);
  cudaFree(floor_buf);
  cudaFree(floor_sink);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
