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
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.cuh"
#include "bench_shapes.cuh"
#include "bench_floors.cuh"
#include "bench_handoff.cuh"
#include "bench_launch_sequence.cuh"
#include "bench_timeline.cuh"
#include "workload.h"

namespace pagedattn::kernels::bench {
namespace {

// The workload with its pages renumbered 0, 1, 2, ... in batch order: the same shape over a
// contiguous stretch of the pool (the locality experiment).
pt::Workload Contiguous(const pt::Workload& w) {
  pt::Workload c = w;
  std::iota(c.kv_indices.begin(), c.kv_indices.end(), 0);
  c.num_pages = std::max<int64_t>(w.num_pages, static_cast<int64_t>(c.kv_indices.size()));
  return c;
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

}  // namespace

int Main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--shape") return RunShapes(argc, argv);
  }
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
  bool handoff = false;
  bool small_batches = false;
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
    else if (a == "--handoff") handoff = true;
    else if (a == "--small-batches") small_batches = true;
    else if (a == "--no-floors") floors = false;
    else {
      std::fprintf(stderr,
                   "usage: %s [--workloads FILE] [--out FILE] [--iters N] [--no-uneven] "
                   "[--no-cpasync] [--variants] [--timelines] [--sweep] [--launch-sequence] "
                   "[--handoff] [--small-batches] [--default-cpasync] [--no-floors]\n",
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
  PreferSharedCarveoutForCleanSharedFlush();

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

  if (handoff) {
    TimeHandoff(tma->num_ctas(), stream, iters);
    return 0;
  }

  std::mt19937 rng(std::random_device{}());
  if (uneven) {
    std::vector<int> un(301, 16), uni(275, 32);
    un[0] = 4000;  // 4000 + 300 x 16 = 8800 pages = 275 x 32
    workloads.push_back(Synthetic("uneven_1x4000_300x16", un, rng));
    workloads.push_back(Synthetic("uniform_275x32", uni, rng));
  }

  if (small_batches) {
    // The service's small steps (default shape): the plan's smallest part (min_part_units,
    // (page, KV head) units) against the default of 8, which keeps a B=1 step of 8 pages in 4
    // unsplit parts. Median of `iters` runs; dirty: L2 warm, as a step finds it when the same
    // sequences came the step before; clean: flushed.
    const std::vector<int> mins = {8, 4, 2, 1};
    std::vector<std::unique_ptr<pk::CudaDecoder>> ds;
    for (int m : mins) {
      pk::CudaDecoderOptions o;
      o.tuning.min_part_units = m;
      ds.emplace_back();
      CheckStatus(pk::CudaDecoder::Create(o, &ds.back()), "Create (small batches)");
    }
    Flusher small_flusher(prop.multiProcessorCount);
    std::printf("\nsmall batches: median us, dirty / clean L2, by min_part_units\n%-16s", "workload");
    for (int m : mins) std::printf("   min %d dirty/clean", m);
    std::printf("\n");
    const std::vector<std::pair<std::string, std::vector<int>>> shapes = {
        {"b1_8pages", {8}},           {"b1_16pages", {16}},         {"b1_32pages", {32}},
        {"b1_128pages", {128}},       {"b2_8pages", std::vector<int>(2, 8)},
        {"b4_8pages", std::vector<int>(4, 8)}, {"b8_8pages", std::vector<int>(8, 8)},
        {"b16_8pages", std::vector<int>(16, 8)}, {"b4_64pages", std::vector<int>(4, 64)},
        {"b64_64pages", std::vector<int>(64, 64)}};
    for (const auto& [name, lengths] : shapes) {
      const pt::Workload w = Synthetic(name, lengths, rng);
      DeviceInputs in;
      in.Init(w, rng());
      std::printf("%-16s", name.c_str());
      for (auto& d : ds) {
        const double dirty = TimeDecoder(*d, w, in, small_flusher, FlushMode::kDirty, stream, iters).median_us;
        const double clean = TimeDecoder(*d, w, in, small_flusher, FlushMode::kClean, stream, iters).median_us;
        std::printf("   %8.2f / %7.2f", dirty, clean);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    return 0;
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
      PrintTimeline(*tma, "default", w, in.args, flusher, stream, false);
      PrintTimeline(*v6, "v6", w, in.args, flusher, stream, detail);
      if (cp) PrintTimeline(*cp, "cp.async", w, in.args, flusher, stream, false);
      PrintTimeline(*alt, "v3", w, in.args, flusher, stream, false);
      PrintTimeline(*tma, "default", w, in.args, flusher, stream, detail);
    }
  }
  std::fclose(out);
  cudaFree(floor_buf);
  cudaFree(floor_sink);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace pagedattn::kernels::bench

int main(int argc, char** argv) { return pagedattn::kernels::bench::Main(argc, argv); }
