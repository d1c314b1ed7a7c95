// Host copy rates on the GPU host: memcpy vs non-temporal stores into pinned (cudaMallocHost)
// and pageable memory, 1/2/4/8 threads, sources hot (just written by this thread) or written
// by another thread (as gRPC's parse leaves them). 524 KiB per copy, as a B=64 decode step.
#include <cuda_runtime.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
static void CopyNt(char* dst, const char* src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
    __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a);
    _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c);
    _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
}

// Persistent spinning workers, as the backend's copy pool.
struct Pool {
  std::atomic<int> gen{0}, done{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> ws;
  char* dst = nullptr; const char* src = nullptr; size_t n = 0, piece = 0; int threads = 1; bool nt = false;
  static void Part(char* d, const char* s, size_t b, size_t e, size_t piece, bool nt) {
    for (size_t o = b; o < e; o += piece) {
      size_t m = std::min(piece, e - o);
      if (nt) CopyNt(d + o, s + o, m); else std::memcpy(d + o, s + o, m);
    }
  }
  explicit Pool(int k) {
    for (int i = 1; i < k; ++i) ws.emplace_back([this, i] {
      int seen = 0;
      while (!stop.load()) {
        int g = gen.load(std::memory_order_acquire);
        if (g == seen) { std::this_thread::yield(); continue; }
        seen = g;
        if (i < threads) { size_t sh = n / threads; Part(dst, src, i * sh, (i + 1) * sh, piece, nt); }
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  ~Pool() { stop = true; for (auto& w : ws) w.join(); }
  void Run() {
    done.store(0);
    gen.fetch_add(1, std::memory_order_acq_rel);
    size_t sh = n / threads;
    Part(dst, src, 0, sh, piece, nt);
    while (done.load(std::memory_order_acquire) != (int)ws.size()) std::this_thread::yield();
  }
};
int main() {
  const size_t n = 524288, piece = 6144;
  const int nsrc = 16;
  std::vector<char*> src(nsrc);
  for (auto& s : src) { s = (char*)aligned_alloc(64, n); memset(s, 1, n); }
  char* pinned = nullptr;
  if (cudaMallocHost((void**)&pinned, n) != cudaSuccess) { std::printf("no pinned memory: pageable instead\n"); pinned = (char*)aligned_alloc(64, n); }
  memset(pinned, 0, n);
  char* pageable = (char*)aligned_alloc(64, n); memset(pageable, 0, n);
  Pool pool(8);
  for (int remote = 0; remote < 2; ++remote)
  for (int dstk = 0; dstk < 2; ++dstk)
  for (int nt = 0; nt < 2; ++nt)
  for (int threads : {1, 2, 4, 8}) {
    std::vector<double> t;
    for (int r = 0; r < 300; ++r) {
      char* s = src[r % nsrc];
      if (remote) { std::thread w([&] { memset(s, r, n); }); w.join(); } else memset(s, r, n);
      pool.dst = dstk ? pageable : pinned; pool.src = s; pool.n = n; pool.piece = piece;
      pool.threads = threads; pool.nt = nt;
      auto t0 = std::chrono::steady_clock::now();
      pool.Run();
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    std::printf("src %-6s dst %-8s %-6s threads %d: median %6.1f us p10 %6.1f (%.1f GB/s median)\n",
                remote ? "remote" : "local", dstk ? "pageable" : "pinned", nt ? "nt" : "memcpy", threads,
                t[t.size() / 2], t[t.size() / 10], n / t[t.size() / 2] / 1e3);
  }
}
