// Host-to-device copy time of a 512 KiB pinned buffer right after the host wrote it: with
// memcpy (the data sits in the CPU caches), with non-temporal stores (it is in DRAM), or not
// rewritten since the last copy. CUDA events around the copy; median of 300.
#include <cuda_runtime.h>
#include <immintrin.h>
#include <algorithm>
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
int main() {
  for (size_t n : {size_t{6144}, size_t{393216}, size_t{524288}, size_t{2} << 20}) {
    char *pinned, *dev, *out_pinned;
    cudaMallocHost((void**)&pinned, n);
    cudaMallocHost((void**)&out_pinned, n);
    cudaMalloc((void**)&dev, n);
    std::vector<char> src(n, 1);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<float> gpu;
      std::vector<double> wall;
      for (int r = 0; r < 300; ++r) {
        std::thread w([&] { memset(src.data(), r, n); });  // another core wrote the source
        w.join();
        if (mode == 0) std::memcpy(pinned, src.data(), n);
        if (mode == 1) CopyNt(pinned, src.data(), n);
        auto t0 = std::chrono::steady_clock::now();
        cudaEventRecord(a, s);
        if (mode < 3) {
          cudaMemcpyAsync(dev, pinned, n, cudaMemcpyHostToDevice, s);
        } else {
          cudaMemcpyAsync(out_pinned, dev, n, cudaMemcpyDeviceToHost, s);
        }
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        wall.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        gpu.push_back(ms * 1000);
      }
      std::sort(gpu.begin(), gpu.end());
      std::sort(wall.begin(), wall.end());
      const char* names[] = {"H2D after memcpy write", "H2D after NT write", "H2D, not rewritten", "D2H"};
      std::printf("%8zu B %-24s: events %6.1f us (%5.1f GB/s), host issue->synced %6.1f us\n", n,
                  names[mode], gpu[gpu.size() / 2], n / gpu[gpu.size() / 2] / 1e3, wall[wall.size() / 2]);
    }
    cudaFreeHost(pinned);
    cudaFreeHost(out_pinned);
    cudaFree(dev);
  }
  std::printf("rc %s\n", cudaGetErrorString(cudaGetLastError()));
}
