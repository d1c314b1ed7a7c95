#include "bench_shapes.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "bench_floors.cuh"
#include "bench_timeline.cuh"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::kernels::bench {
namespace {

// The model shapes of the comparison (FlashInfer's harness names them the same way).
struct NamedShape {
  const char* name;
  int32_t qo, kv, head_dim, page_size;
};
constexpr NamedShape kShapes[] = {
    {"mixtral_tp2", 24, 4, 128, 64}, {"llama8b", 32, 8, 128, 16}, {"llama70b_tp8", 8, 1, 128, 16},
    {"qwen7b", 28, 4, 128, 16},      {"gemma9b", 16, 8, 256, 16},
};

// Random normal values (Box-Muller over a hash of index and seed) stored as `type`; fp8 values
// are quantized with a scale of 1.
__global__ void FillNormal(uint8_t* dst, int64_t n, uint64_t seed, int type) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    const float u1 = (static_cast<float>(h & 0xffffff) + 1.0f) / 16777217.0f;
    const float u2 = static_cast<float>((h >> 24) & 0xffffff) / 16777216.0f;
    const float x = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (type == static_cast<int>(DType::kBf16)) {
      reinterpret_cast<uint16_t*>(dst)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    } else if (type == static_cast<int>(DType::kFp16)) {
      reinterpret_cast<uint16_t*>(dst)[i] = __half_as_ushort(__float2half_rn(x));
    } else {
      dst[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
    }
  }
}

void Fill(void* dst, int64_t n, uint64_t seed, DType type) {
  FillNormal<<<1024, 256>>>(static_cast<uint8_t*>(dst), n, seed, static_cast<int>(type));
  CHECK_CUDA(cudaGetLastError());
}

// A batch in pages of `page_size`: each sequence keeps its tokens; pages are a random
// permutation of the pool.
pt::Workload Convert(const std::string& name, const std::vector<int64_t>& tokens, int page_size,
                     std::mt19937& rng) {
  pt::Workload w;
  w.name = name;
  w.batch_size = static_cast<int32_t>(tokens.size());
  w.kv_indptr.assign(1, 0);
  for (int64_t t : tokens) {
    const int64_t pages = (t + page_size - 1) / page_size;
    w.kv_indptr.push_back(static_cast<int32_t>(w.kv_indptr.back() + pages));
    w.kv_last_page_len.push_back(t == 0 ? 1 : static_cast<int32_t>(t - (pages - 1) * page_size));
  }
  const int32_t total = w.kv_indptr.back();
  w.num_pages = std::max(total, 1);
  std::vector<int32_t> pool(w.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  w.kv_indices.assign(pool.begin(), pool.begin() + total);
  return w;
}

std::vector<int64_t> TokensOf(const pt::Workload& w) {
  std::vector<int64_t> t;
  for (int32_t b = 0; b < w.batch_size; ++b) {
    const int64_t pages = w.kv_indptr[b + 1] - w.kv_indptr[b];
    t.push_back(pages == 0 ? 0 : (pages - 1) * kPageSize + w.kv_last_page_len[b]);
  }
  return t;
}

}  // namespace

int RunShapes(int argc, char** argv) {
  std::string path = pt::DefaultWorkloadPath();
  std::string out_path = "kernel_bench_shape.jsonl";
  std::string shape_name;
  int iters = 100;
  int page_size = 0;
  int head_dim = 0;
  uint32_t seed = 1;
  bool timelines = false;
  Shape shape;
  bool fp8 = false;
  pk::CudaDecoderTuning tuning;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shape" && i + 1 < argc) shape_name = argv[++i];
    else if (a == "--workloads" && i + 1 < argc) path = argv[++i];
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
    else if (a == "--page-size" && i + 1 < argc) page_size = std::atoi(argv[++i]);
    else if (a == "--head-dim" && i + 1 < argc) head_dim = std::atoi(argv[++i]);
    else if (a == "--seed" && i + 1 < argc) seed = static_cast<uint32_t>(std::atoll(argv[++i]));
    else if (a == "--kv-dtype" && i + 1 < argc) fp8 = std::string(argv[++i]) == "fp8_e4m3";
    else if (a == "--dtype" && i + 1 < argc) shape.dtype = std::string(argv[++i]) == "fp16" ? DType::kFp16 : DType::kBf16;
    else if (a == "--skip-attention") tuning.skip_attention = true;
    else if (a == "--tma-promo" && i + 1 < argc) tuning.tma_l2_promotion_bytes = std::atoi(argv[++i]);
    else if (a == "--item-cost" && i + 1 < argc) tuning.item_cost_pages = std::atoi(argv[++i]);
    else if (a == "--timelines") timelines = true;
    else {
      std::fprintf(stderr,
                   "usage: %s --shape mixtral_tp2|llama8b|llama70b_tp8|qwen7b|gemma9b "
                   "[--page-size N] [--head-dim N] [--dtype bf16|fp16] [--kv-dtype auto|fp8_e4m3] "
                   "[--workloads FILE (pages of 64)] [--out FILE] [--iters N] [--seed N]\n"
                   "  [--skip-attention] (loads only: the outputs are garbage) "
                   "[--tma-promo 0|64|128|256] (the copies' L2 fetch granule)\n"
                   "  [--item-cost PAGES] (what a (seq, head) start costs a part of the plan) "
                   "[--timelines] (where each workload's time goes, per CTA)\n",
                   argv[0]);
      return 2;
    }
  }
  const NamedShape* named = nullptr;
  for (const NamedShape& s : kShapes) {
    if (shape_name == s.name) named = &s;
  }
  if (named == nullptr) {
    std::fprintf(stderr, "unknown --shape %s\n", shape_name.c_str());
    return 2;
  }
  shape.num_qo_heads = named->qo;
  shape.num_kv_heads = named->kv;
  shape.head_dim = head_dim > 0 ? head_dim : named->head_dim;
  shape.page_size = page_size > 0 ? page_size : named->page_size;
  shape.kv_dtype = fp8 ? DType::kFp8E4m3 : shape.dtype;
  if (KernelStatus st = ValidateShape(shape); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.message.c_str());
    return 2;
  }
  std::vector<pt::Workload> recorded;
  std::string error;
  if (!pt::LoadWorkloads(path, &recorded, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  // Page orders, short batches and values from one seed (--seed, default 1), so that two builds
  // or two calls time the same batches.
  std::mt19937 rng(seed);
  std::vector<pt::Workload> workloads;
  for (const pt::Workload& w : recorded) {
    workloads.push_back(Convert(ShortName(w.name), TokensOf(w), shape.page_size, rng));
  }
  // Hundreds of short sequences: 1-8 pages of 64 tokens each, any length within.
  for (int batch : {128, 256, 512}) {
    std::uniform_int_distribution<int64_t> tokens(1, 8 * 64);
    std::vector<int64_t> t(batch);
    for (int64_t& x : t) x = tokens(rng);
    workloads.push_back(Convert("short_b" + std::to_string(batch), t, shape.page_size, rng));
  }

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double stream_gbps = StreamReadGBps(stream, prop.multiProcessorCount);
  pk::CudaDecoderOptions options;
  options.shape = shape;
  options.tuning = tuning;
  std::unique_ptr<pk::CudaDecoder> decoder;
  CheckStatus(pk::CudaDecoder::Create(options, &decoder), "Create");
  std::printf("device: %s, %d SMs; shape %s; streaming read %.0f GB/s; %d CTAs, %zu B shared\n",
              prop.name, prop.multiProcessorCount, DescribeShape(shape).c_str(), stream_gbps,
              decoder->num_ctas(), decoder->shared_memory_bytes());
  std::printf("%-14s %6s %9s %10s %10s %10s %7s\n", "workload", "batch", "pages", "MB", "us",
              "floor us", "x floor");
  Flusher flusher(prop.multiProcessorCount);
  uint32_t* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  std::ofstream out(out_path);
  double log_sum = 0;
  int counted = 0;
  for (const pt::Workload& w : workloads) {
    const int64_t cache_bytes = w.num_pages * shape.page_bytes();
    // K then V in one allocation, so that the floor reads the same bytes in one stream.
    uint8_t* kv = nullptr;
    void *q = nullptr, *o = nullptr;
    float* lse = nullptr;
    int32_t* indices = nullptr;
    CHECK_CUDA(cudaMalloc(&kv, 2 * cache_bytes));
    CHECK_CUDA(cudaMalloc(&q, w.batch_size * shape.query_bytes()));
    CHECK_CUDA(cudaMalloc(&o, w.batch_size * shape.query_bytes()));
    CHECK_CUDA(cudaMalloc(&lse, w.batch_size * shape.lse_bytes()));
    CHECK_CUDA(cudaMalloc(&indices, std::max<size_t>(1, w.kv_indices.size()) * 4));
    CHECK_CUDA(cudaMemcpy(indices, w.kv_indices.data(), w.kv_indices.size() * 4,
                          cudaMemcpyHostToDevice));
    Fill(q, w.batch_size * shape.query_elems(), rng(), shape.dtype);
    Fill(kv, 2 * w.num_pages * shape.page_elems(), rng(), shape.kv_dtype);
    CHECK_CUDA(cudaDeviceSynchronize());
    pk::DecodeArgs args;
    args.q = q;
    args.k_cache = kv;
    args.v_cache = kv + cache_bytes;
    args.kv_indices = indices;
    args.output = o;
    args.lse = lse;
    args.batch_size = w.batch_size;
    args.num_pages = w.num_pages;
    args.sm_scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    args.shape = shape;
    CheckStatus(decoder->Plan(w.kv_indptr.data(), w.kv_last_page_len.data(), w.batch_size,
                              stream),
                "Plan");
    const Timing t = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
      CheckStatus(decoder->Run(args, stream), "Run");
    });
    // The bytes a decode must read: the pages the batch uses, K and V.
    const double bytes = 2.0 * w.kv_indices.size() * shape.page_bytes();
    const double floor_us = StreamFloorUs(reinterpret_cast<const uint4*>(kv), bytes, sink,
                                          prop.multiProcessorCount, flusher, stream, iters);
    std::printf("%-14s %6d %9zu %10.1f %10.1f %10.1f %7.2f\n", w.name.c_str(), w.batch_size,
                w.kv_indices.size(), bytes / 1e6, t.median_us, floor_us, t.median_us / floor_us);
    out << "{\"shape\":\"" << shape_name << "\",\"kv_dtype\":\"" << DTypeName(shape.kv_dtype)
        << "\",\"page_size\":" << shape.page_size << ",\"name\":\"" << w.name
        << "\",\"batch\":" << w.batch_size << ",\"pages\":" << w.kv_indices.size()
        << ",\"kv_bytes\":" << static_cast<int64_t>(bytes) << ",\"us\":" << t.median_us
        << ",\"p10_us\":" << t.p10_us << ",\"p90_us\":" << t.p90_us
        << ",\"floor_us\":" << floor_us << "}\n";
    if (timelines) PrintTimeline(*decoder, shape_name.c_str(), w, args, flusher, stream, true);
    log_sum += std::log(t.median_us / floor_us);
    ++counted;
    cudaFree(kv);
    cudaFree(q);
    cudaFree(o);
    cudaFree(lse);
    cudaFree(indices);
  }
  std::printf("geomean time / floor over %d workloads: %.3f\n", counted,
              std::exp(log_sum / std::max(counted, 1)));
  cudaFree(sink);
  return 0;
}

}  // namespace pagedattn::kernels::bench
