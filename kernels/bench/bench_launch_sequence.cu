#include "bench_launch_sequence.cuh"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "pagedattn/kernels/kv_write.h"

namespace pagedattn::kernels::bench {

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

}  // namespace pagedattn::kernels::bench
