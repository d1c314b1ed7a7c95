#include "bench_timeline.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace pagedattn::kernels::bench {

void PrintTimeline(pk::CudaDecoder& decoder, const char* label, const pt::Workload& w,
                   const pk::DecodeArgs& args, Flusher& flusher, cudaStream_t stream,
                   bool detail) {
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
    CheckStatus(decoder.Run(args, stream), "Run");
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

}  // namespace pagedattn::kernels::bench
