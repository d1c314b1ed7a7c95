#include "bench_handoff.cuh"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_common.cuh"

namespace pagedattn::kernels::bench {
namespace {

constexpr int kThreads = 128;
constexpr uint32_t kStop = 0xffffffffu;
// Per CTA and hop: 8 words of 16 bytes (128 bytes) of the step table.
constexpr int kWordsPerCta = 8;
// Untimed steps before each way's timed ones.
constexpr int kWarmup = 50;

__device__ __forceinline__ uint32_t LoadAcquireSystem(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadVolatile(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadAcquireGpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSystem(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void StoreReleaseGpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void EmptyGrid() {}

struct DoorbellParams {
  const uint32_t* bell;    // host memory: the step's number, kStop to leave
  uint32_t* ack;           // host memory: the last finished step
  uint32_t* arrived;       // device: CTAs done with the current step
  uint32_t* relay;         // device: the bell as CTA 0 relays it (one_poller)
  const uint4* table;      // host memory: the step table
  int hops;                // dependent reads of the table per CTA and step
  int one_poller;          // 1: only CTA 0 reads the host bell, the others the relay
  int volatile_loads;      // 1: the host bell read with ld.volatile (then a fence)
  uint32_t* sums;          // per CTA: the sum of the table words it read
  unsigned long long* stamps;  // per step: [CTA 0 saw the bell, the ack stored]
};

__device__ __forceinline__ uint32_t WaitForChange(const DoorbellParams& p, uint32_t seen) {
  uint32_t b;
  if (p.one_poller && blockIdx.x != 0) {
    do {
      b = LoadAcquireGpu(p.relay);
    } while (b == seen);
    return b;
  }
  if (p.volatile_loads) {
    do {
      b = LoadVolatile(p.bell);
    } while (b == seen);
    __threadfence_system();
  } else {
    do {
      b = LoadAcquireSystem(p.bell);
    } while (b == seen);
  }
  if (p.one_poller) StoreReleaseGpu(p.relay, b);
  return b;
}

// Resident across steps: waits for the bell to change, optionally reads its table slice from
// host memory in `hops` dependent loads, and the last CTA to finish acknowledges the step.
__global__ void __launch_bounds__(kThreads) DoorbellGrid(DoorbellParams p) {
  __shared__ uint32_t step;
  __shared__ uint32_t next;
  uint32_t seen = 0;
  for (;;) {
    if (threadIdx.x == 0) {
      step = WaitForChange(p, seen);
      if (blockIdx.x == 0 && step != kStop) p.stamps[2 * step] = GlobalTimer();
    }
    __syncthreads();
    const uint32_t b = step;
    if (b == kStop) return;
    seen = b;
    if (p.hops > 0) {
      // Hop h's words of this CTA start where hop h-1's first word points: a dependent chain.
      if (threadIdx.x == 0) next = 0;
      __syncthreads();
      uint32_t sum = 0;
      for (int h = 0; h < p.hops; ++h) {
        const uint32_t base = next;
        uint4 w = make_uint4(0, 0, 0, 0);
        if (threadIdx.x < kWordsPerCta) {
          w = __ldcv(p.table + base + (int64_t{blockIdx.x} * p.hops + h) * kWordsPerCta +
                     threadIdx.x);
          sum += w.x + w.y + w.z + w.w;
        }
        __syncthreads();
        if (threadIdx.x == 0) next = w.x;
        __syncthreads();
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (threadIdx.x == 0) p.sums[blockIdx.x] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(p.arrived, 1) == gridDim.x - 1) {
        *p.arrived = 0;
        p.stamps[2 * b + 1] = GlobalTimer();
        __threadfence_system();
        StoreReleaseSystem(p.ack, b);
      }
    }
  }
}

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

void Report(const char* way, std::vector<double> us) {
  std::printf("  %-44s p10 %6.2f  p50 %6.2f  p90 %6.2f  p99 %6.2f us\n", way, Quantile(us, 0.1),
              Median(us), Quantile(us, 0.9), Quantile(us, 0.99));
  std::fflush(stdout);
}

// Host round trips of `iters` steps (after kWarmup): `issue` enqueues a step on `stream`, then
// the host records `done` and spins on it.
template <typename Issue>
std::vector<double> TimeCalls(int iters, cudaStream_t stream, cudaEvent_t done, Issue issue) {
  std::vector<double> us;
  for (int i = 0; i < kWarmup + iters; ++i) {
    const Clock::time_point t0 = Clock::now();
    issue();
    CHECK_CUDA(cudaEventRecord(done, stream));
    cudaError_t q;
    while ((q = cudaEventQuery(done)) == cudaErrorNotReady) {
    }
    CHECK_CUDA(q);
    if (i >= kWarmup) us.push_back(MicrosSince(t0));
  }
  return us;
}

struct DoorbellWay {
  const char* name;
  int num_ctas;
  int hops;
  int one_poller;
  int volatile_loads;
};

// One resident grid, `iters` steps: prints the host's round trips and, from the GPU's clock,
// the span from CTA 0 seeing the bell to the ack's store.
void TimeDoorbell(const DoorbellWay& way, cudaStream_t stream, int iters) {
  const int steps = kWarmup + iters;
  const int num_ctas = way.num_ctas;
  const int hops = way.hops;
  uint32_t* words = nullptr;  // [bell, ack]
  CHECK_CUDA(cudaHostAlloc(&words, 2 * sizeof(uint32_t), cudaHostAllocMapped));
  const int table_words = num_ctas * kWordsPerCta * (hops > 0 ? hops : 1);
  uint4* table = nullptr;
  CHECK_CUDA(cudaHostAlloc(&table, table_words * sizeof(uint4), cudaHostAllocMapped));
  uint32_t* dev_words = nullptr;  // [arrived, relay]
  uint32_t* sums = nullptr;
  unsigned long long* stamps = nullptr;
  CHECK_CUDA(cudaMalloc(&dev_words, 2 * sizeof(uint32_t)));
  CHECK_CUDA(cudaMemset(dev_words, 0, 2 * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&sums, num_ctas * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&stamps, 2 * (steps + 1) * sizeof(unsigned long long)));
  uint32_t* const bell = &words[0];
  uint32_t* const ack = &words[1];
  __atomic_store_n(bell, 0u, __ATOMIC_SEQ_CST);
  __atomic_store_n(ack, 0u, __ATOMIC_SEQ_CST);
  uint32_t* d_words = nullptr;
  uint4* d_table = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_words), words, 0));
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_table), table, 0));
  DoorbellParams p;
  p.bell = d_words;
  p.ack = d_words + 1;
  p.arrived = dev_words;
  p.relay = dev_words + 1;
  p.table = d_table;
  p.hops = hops;
  p.one_poller = way.one_poller;
  p.volatile_loads = way.volatile_loads;
  p.sums = sums;
  p.stamps = stamps;
  DoorbellGrid<<<num_ctas, kThreads, 0, stream>>>(p);
  CHECK_CUDA(cudaGetLastError());
  std::vector<double> us;
  std::vector<uint32_t> expect(num_ctas);
  uint32_t lcg = 12345;
  for (int i = 1; i <= steps; ++i) {
    // A new table each step, so a read of the previous one is caught. Hop h's first word
    // points at the next hop's offset: 0, so the chain stays within the CTA's slice.
    for (int c = 0; c < num_ctas && hops > 0; ++c) {
      uint32_t s = 0;
      for (int h = 0; h < hops; ++h) {
        for (int k = 0; k < kWordsPerCta; ++k) {
          uint4& w = table[(int64_t{c} * hops + h) * kWordsPerCta + k];
          lcg = lcg * 1664525u + 1013904223u;
          w = make_uint4(k == 0 ? 0u : lcg, lcg >> 3, lcg >> 7, lcg >> 11);
          s += w.x + w.y + w.z + w.w;
        }
      }
      expect[c] = s;
    }
    const Clock::time_point t0 = Clock::now();
    __atomic_store_n(bell, static_cast<uint32_t>(i), __ATOMIC_SEQ_CST);
    while (__atomic_load_n(ack, __ATOMIC_ACQUIRE) != static_cast<uint32_t>(i)) {
    }
    if (i > kWarmup) us.push_back(MicrosSince(t0));
    if (hops > 0 && i % 97 == 0) {
      std::vector<uint32_t> got(num_ctas);
      CHECK_CUDA(cudaMemcpy(got.data(), sums, num_ctas * sizeof(uint32_t),
                            cudaMemcpyDeviceToHost));
      for (int c = 0; c < num_ctas; ++c) {
        if (got[c] != expect[c]) {
          std::fprintf(stderr, "doorbell step %d: CTA %d read a stale table\n", i, c);
          std::exit(1);
        }
      }
    }
  }
  __atomic_store_n(bell, kStop, __ATOMIC_SEQ_CST);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<unsigned long long> t(2 * (steps + 1));
  CHECK_CUDA(cudaMemcpy(t.data(), stamps, t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost));
  std::vector<double> gpu;
  for (int i = kWarmup + 1; i <= steps; ++i) gpu.push_back(1e-3 * double(t[2 * i + 1] - t[2 * i]));
  char name[96];
  std::snprintf(name, sizeof(name), "%s, %d CTA%s", way.name, num_ctas, num_ctas > 1 ? "s" : "");
  Report(name, us);
  std::snprintf(name, sizeof(name), "  of which on the GPU");
  Report(name, gpu);
  CHECK_CUDA(cudaFree(stamps));
  CHECK_CUDA(cudaFree(sums));
  CHECK_CUDA(cudaFree(dev_words));
  CHECK_CUDA(cudaFreeHost(table));
  CHECK_CUDA(cudaFreeHost(words));
}

}  // namespace

void TimeHandoff(int num_ctas, cudaStream_t stream, int iters) {
  std::printf("\nhand-off of one empty step, %d CTAs of %d threads, %d steps:\n", num_ctas,
              kThreads, iters);
  cudaEvent_t done;
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  Report("launch", TimeCalls(iters, stream, done, [&] {
           EmptyGrid<<<num_ctas, kThreads, 0, stream>>>();
         }));
  {
    constexpr size_t kTableBytes = 16 << 10;  // a B=64 step's tables are about this size
    void *host = nullptr, *dev = nullptr;
    CHECK_CUDA(cudaHostAlloc(&host, kTableBytes, cudaHostAllocDefault));
    CHECK_CUDA(cudaMalloc(&dev, kTableBytes));
    Report("step calls (copy, 2 grids)", TimeCalls(iters, stream, done, [&] {
             CHECK_CUDA(cudaMemcpyAsync(dev, host, kTableBytes, cudaMemcpyHostToDevice, stream));
             EmptyGrid<<<num_ctas, kThreads, 0, stream>>>();
             EmptyGrid<<<num_ctas, kThreads, 0, stream>>>();
           }));
    CHECK_CUDA(cudaFree(dev));
    CHECK_CUDA(cudaFreeHost(host));
  }
  const DoorbellWay ways[] = {
      {"doorbell, every CTA polls", num_ctas, 0, 0, 0},
      {"doorbell, CTA 0 polls", num_ctas, 0, 1, 0},
      {"doorbell, CTA 0 polls, volatile", num_ctas, 0, 1, 1},
      {"doorbell, one CTA", 1, 0, 0, 0},
      {"doorbell, one CTA, volatile", 1, 0, 0, 1},
      {"doorbell + 2 table hops", num_ctas, 2, 1, 0},
  };
  for (const DoorbellWay& way : ways) TimeDoorbell(way, stream, iters);
  CHECK_CUDA(cudaEventDestroy(done));
}

}  // namespace pagedattn::kernels::bench
