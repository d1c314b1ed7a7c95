#include "gpu_harness.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include "device_data.h"

namespace pagedattn::kernels::testing {
namespace {

bool Check(cudaError_t e, const char* what, std::string* error) {
  if (e == cudaSuccess) return true;
  *error = std::string(what) + ": " + cudaGetErrorString(e);
  return false;
}
bool Check(int e, const char* what, std::string* error) {
  return Check(static_cast<cudaError_t>(e), what, error);
}

// Runs fn(i) for i in [0, n) over the machine's cores.
template <typename Fn>
void ParallelFor(int64_t n, Fn fn) {
  const int64_t threads =
      std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int64_t i = next++; i < n; i = next++) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

template <typename T>
bool Alloc(T** p, int64_t count, std::string* error) {
  return Check(cudaMalloc(reinterpret_cast<void**>(p), std::max<int64_t>(count, 1) * sizeof(T)),
               "cudaMalloc", error);
}

}  // namespace

void Batch::Add(const std::vector<int32_t>& pages, int32_t last_len) {
  indices.insert(indices.end(), pages.begin(), pages.end());
  indptr.push_back(static_cast<int32_t>(indices.size()));
  last.push_back(pages.empty() ? 0 : last_len);
}

Batch FromWorkload(const Workload& w) {
  Batch b;
  b.name = w.name;
  b.num_pages = w.num_pages;
  b.indptr = w.kv_indptr;
  b.indices = w.kv_indices;
  b.last = w.kv_last_page_len;
  return b;
}

uint64_t FreshSeed() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd() ^
         static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

DeviceBatch::~DeviceBatch() {
  for (void* p : {static_cast<void*>(q_), static_cast<void*>(k_), static_cast<void*>(v_),
                  static_cast<void*>(indices_), static_cast<void*>(out_),
                  static_cast<void*>(lse_)}) {
    if (p != nullptr) cudaFree(p);
  }
}

bool DeviceBatch::Init(const Batch& batch, uint64_t seed, std::string* error) {
  batch_ = &batch;
  const int64_t cache_elems = batch.num_pages * kPageElems;
  if (!Alloc(&q_, batch.size() * kQueryElems, error) || !Alloc(&k_, cache_elems, error) ||
      !Alloc(&v_, cache_elems, error) ||
      !Alloc(&indices_, static_cast<int64_t>(batch.indices.size()), error) ||
      !Alloc(&out_, batch.size() * kQueryElems, error) ||
      !Alloc(&lse_, int64_t{batch.size()} * kNumQoHeads, error)) {
    return false;
  }
  if (!Check(FillNormalBf16(q_, batch.size() * kQueryElems, seed, nullptr), "fill q", error) ||
      !Check(FillNormalBf16(k_, cache_elems, seed * 3 + 1, nullptr), "fill k", error) ||
      !Check(FillNormalBf16(v_, cache_elems, seed * 5 + 2, nullptr), "fill v", error)) {
    return false;
  }
  if (!batch.indices.empty() &&
      !Check(cudaMemcpy(indices_, batch.indices.data(), batch.indices.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice),
             "copy indices", error)) {
    return false;
  }
  if (batch.garbage_tails) {
    for (int32_t b = 0; b < batch.size(); ++b) {
      if (batch.indptr[b + 1] == batch.indptr[b] || batch.last[b] == kPageSize) continue;
      const int64_t page = batch.indices[batch.indptr[b + 1] - 1];
      const uint16_t nan = 0x7fc0, inf = 0x7f80;
      if (!Check(FillPageTail(k_, page, batch.last[b], b % 2 ? nan : inf, nullptr), "tail", error) ||
          !Check(FillPageTail(v_, page, batch.last[b], b % 2 ? inf : nan, nullptr), "tail", error)) {
        return false;
      }
    }
  }
  return Check(cudaDeviceSynchronize(), "fill", error);
}

DecodeArgs DeviceBatch::Args() const {
  DecodeArgs a;
  a.q = q_;
  a.k_cache = k_;
  a.v_cache = v_;
  a.kv_indptr = nullptr;  // the CUDA decoder follows the plan's host arrays
  a.kv_indices = indices_;
  a.kv_last_page_len = nullptr;
  a.output = out_;
  a.lse = lse_;
  a.batch_size = batch_->size();
  a.num_pages = batch_->num_pages;
  a.sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  return a;
}

bool DeviceBatch::Poison(cudaStream_t stream, std::string* error) {
  return Check(cudaMemsetAsync(out_, 0xff, batch_->size() * kQueryElems * 2, stream), "poison",
               error) &&
         Check(cudaMemsetAsync(lse_, 0xff, int64_t{batch_->size()} * kNumQoHeads * 4, stream),
               "poison", error);
}

bool DeviceBatch::Fetch(cudaStream_t stream, std::vector<uint16_t>* out, std::vector<float>* lse,
                        std::string* error) {
  out->resize(batch_->size() * kQueryElems);
  lse->resize(int64_t{batch_->size()} * kNumQoHeads);
  return Check(cudaStreamSynchronize(stream), "kernel", error) &&
         Check(cudaMemcpy(out->data(), out_, out->size() * 2, cudaMemcpyDeviceToHost), "fetch",
               error) &&
         Check(cudaMemcpy(lse->data(), lse_, lse->size() * 4, cudaMemcpyDeviceToHost), "fetch",
               error);
}

bool DeviceBatch::Reference(std::vector<double>* out, std::vector<double>* lse,
                            std::string* error) {
  const Batch& b = *batch_;
  // A compact copy of the pages in use, and the batch's indices into it.
  std::vector<int32_t> used(b.indices);
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  std::vector<int32_t> remapped(b.indices.size());
  for (size_t i = 0; i < b.indices.size(); ++i) {
    remapped[i] = static_cast<int32_t>(
        std::lower_bound(used.begin(), used.end(), b.indices[i]) - used.begin());
  }
  const int64_t n = static_cast<int64_t>(used.size());
  std::vector<uint16_t> hq(b.size() * kQueryElems), hk(n * kPageElems), hv(n * kPageElems);
  int32_t* dev_used = nullptr;
  uint16_t* compact = nullptr;
  bool ok = Alloc(&dev_used, n, error) && Alloc(&compact, n * kPageElems, error) &&
            Check(cudaMemcpy(dev_used, used.data(), n * 4, cudaMemcpyHostToDevice), "copy", error) &&
            Check(GatherPages(k_, dev_used, static_cast<int32_t>(n), compact, nullptr), "gather",
                  error) &&
            Check(cudaMemcpy(hk.data(), compact, n * kPageElems * 2, cudaMemcpyDeviceToHost),
                  "copy", error) &&
            Check(GatherPages(v_, dev_used, static_cast<int32_t>(n), compact, nullptr), "gather",
                  error) &&
            Check(cudaMemcpy(hv.data(), compact, n * kPageElems * 2, cudaMemcpyDeviceToHost),
                  "copy", error) &&
            Check(cudaMemcpy(hq.data(), q_, hq.size() * 2, cudaMemcpyDeviceToHost), "copy", error);
  if (dev_used != nullptr) cudaFree(dev_used);
  if (compact != nullptr) cudaFree(compact);
  if (!ok) return false;

  DecodeArgs a;
  a.q = hq.data();
  a.k_cache = hk.data();
  a.v_cache = hv.data();
  a.kv_indptr = b.indptr.data();
  a.kv_indices = remapped.data();
  a.kv_last_page_len = b.last.data();
  a.batch_size = b.size();
  a.num_pages = n;
  a.sm_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  out->assign(b.size() * kQueryElems, 0.0);
  lse->assign(int64_t{b.size()} * kNumQoHeads, 0.0);
  if (b.f64_reference) {
    ParallelFor(b.size(), [&](int64_t s) {
      DecodeArgs one = a;
      one.q = static_cast<const uint16_t*>(a.q) + s * kQueryElems;
      one.kv_indptr = a.kv_indptr + s;
      one.kv_last_page_len = a.kv_last_page_len + s;
      one.batch_size = 1;
      DecodeReferenceF64(one, out->data() + s * kQueryElems, lse->data() + s * kNumQoHeads);
    });
  } else {
    std::vector<uint16_t> o16(b.size() * kQueryElems);
    std::vector<float> l32(int64_t{b.size()} * kNumQoHeads);
    a.output = o16.data();
    a.lse = l32.data();
    ParallelFor(DecodeCpuNumItems(a), [&](int64_t item) { DecodeCpuItems(a, item, item + 1); });
    for (size_t i = 0; i < o16.size(); ++i) (*out)[i] = Bf16ToFloat(o16[i]);
    for (size_t i = 0; i < l32.size(); ++i) (*lse)[i] = l32[i];
  }
  return true;
}

std::string Compare(const Batch& batch, const std::vector<uint16_t>& out,
                    const std::vector<float>& lse, const std::vector<double>& ref_out,
                    const std::vector<double>& ref_lse, double* worst_rel_l2,
                    double* worst_lse_err) {
  *worst_rel_l2 = 0.0;
  *worst_lse_err = 0.0;
  std::string failure;
  for (int32_t b = 0; b < batch.size() && failure.empty(); ++b) {
    const bool empty = batch.indptr[b + 1] == batch.indptr[b];
    double num = 0.0, den = 0.0;
    for (int64_t i = b * kQueryElems; i < (b + 1) * kQueryElems; ++i) {
      const float o = Bf16ToFloat(out[i]);
      if (empty) {
        if (out[i] != 0) failure = "sequence " + std::to_string(b) + " (empty): output not 0";
        continue;
      }
      if (!std::isfinite(o)) {
        failure = "sequence " + std::to_string(b) + ": non-finite output at " + std::to_string(i);
        break;
      }
      num += (o - ref_out[i]) * (o - ref_out[i]);
      den += ref_out[i] * ref_out[i];
    }
    if (!empty && failure.empty()) {
      const double rel = std::sqrt(num / std::max(den, 1e-300));
      *worst_rel_l2 = std::max(*worst_rel_l2, rel);
      if (rel >= 1e-2) {
        failure = "sequence " + std::to_string(b) + ": relative L2 error " + std::to_string(rel);
      }
    }
    for (int h = 0; h < kNumQoHeads && failure.empty(); ++h) {
      const int64_t row = int64_t{b} * kNumQoHeads + h;
      if (empty) {
        if (!(std::isinf(lse[row]) && lse[row] < 0)) {
          failure = "sequence " + std::to_string(b) + " (empty): lse " + std::to_string(lse[row]);
        }
        continue;
      }
      const double err = std::fabs(lse[row] - ref_lse[row]);
      if (!(err < 1e-3)) {
        failure = "sequence " + std::to_string(b) + " head " + std::to_string(h) + ": lse " +
                  std::to_string(lse[row]) + " vs " + std::to_string(ref_lse[row]);
      }
      if (std::isfinite(err)) *worst_lse_err = std::max(*worst_lse_err, err);
    }
  }
  return failure;
}

}  // namespace pagedattn::kernels::testing
