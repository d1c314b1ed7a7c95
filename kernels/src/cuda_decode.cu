#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "decode_kernel_sets.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode_plan.h"

namespace pagedattn::kernels {
namespace {

KernelStatus CudaFailure(const char* what, cudaError_t e) {
  return KernelStatus::Error(KernelCode::kInternal,
                             std::string(what) + ": " + cudaGetErrorString(e));
}

KernelStatus Invalid(std::string message) {
  return KernelStatus::Error(KernelCode::kInvalidArgument, std::move(message));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The kernels that serve `shape` (a supported one).
detail::KernelSet KernelsFor(const Shape& shape) {
  if (shape == Shape{}) return detail::DefaultKernels();
  const detail::PageKind pages = shape.kv_dtype == DType::kFp8E4m3 ? detail::PageKind::kFp8
                                 : shape.kv_dtype == DType::kFp16  ? detail::PageKind::kFp16
                                                                   : detail::PageKind::kBf16;
  switch (shape.head_dim) {
    case 64: return detail::KernelsHeadDim64(pages);
    case 128: return detail::KernelsHeadDim128(pages);
    default: return detail::KernelsHeadDim256(pages);
  }
}

// The plan's cost per (seq, head) start, in pages (CudaDecoderTuning::item_cost_pages).
int32_t ItemCostPages(const CudaDecoderOptions& options) {
  const int32_t pages = options.tuning.item_cost_pages;
  if (pages != CudaDecoderTuning::kItemCostAuto) return pages;
  if (options.tuning.parts_per_cta > 1) return 0;
  const Shape& shape = options.shape;
  const int64_t head_page_kv_bytes = 2 * shape.page_bytes() / shape.num_kv_heads;
  return static_cast<int32_t>(std::max<int64_t>(1, (32 << 10) / head_page_kv_bytes));
}

CUtensorMapDataType TmaType(DType t) {
  switch (t) {
    case DType::kBf16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kFp16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kFp8E4m3: return CU_TENSOR_MAP_DATA_TYPE_UINT8;
  }
  return CU_TENSOR_MAP_DATA_TYPE_UINT8;
}

}  // namespace

namespace detail {
KernelSet DefaultKernels() { return MakeKernelSet<DefaultConfig>(); }
}  // namespace detail

#define PA_RETURN_IF_CUDA_ERROR(expr, what)      \
  do {                                           \
    const cudaError_t pa_err_ = (expr);          \
    if (pa_err_ != cudaSuccess) return CudaFailure(what, pa_err_); \
  } while (0)

struct CudaDecoder::Impl {
  Options options;
  detail::KernelSet kernels;
  bool fixed = true;  // the default shape's build
  int device = 0;
  PlanCapacity capacity;
  CudaLoadPath path = CudaLoadPath::kTma;
  void* host_table = nullptr;  // pinned
  void* dev_table = nullptr;
  float* part_o = nullptr;
  float* part_lse = nullptr;
  int32_t* counters = nullptr;  // [merge counters][queue, done][merged units]
  cudaEvent_t copy_done = nullptr;
  bool copy_pending = false;
  bool planned = false;
  // The tables of the planned batch: this decoder's own (Plan) or the caller's (PlanInto).
  const void* run_host_table = nullptr;
  const void* run_dev_table = nullptr;
  PlanSummary plan;
  std::unique_ptr<PlanMemo> memo;  // plans with `capacity`, reusing a plan while its pages stay
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  CUtensorMap k_map{};
  CUtensorMap v_map{};
  const void* map_k = nullptr;
  const void* map_v = nullptr;
  int64_t map_pages = -1;
  uint64_t* timeline = nullptr;

  ~Impl() {
    // Errors on release are ignored: nothing useful can be done with them here.
    if (copy_done != nullptr) cudaEventDestroy(copy_done);
    if (host_table != nullptr) cudaFreeHost(host_table);
    if (dev_table != nullptr) cudaFree(dev_table);
    if (part_o != nullptr) cudaFree(part_o);
    if (part_lse != nullptr) cudaFree(part_lse);
    if (counters != nullptr) cudaFree(counters);
  }

  KernelStatus EncodeMap(const void* cache, int64_t num_pages, CUtensorMap* map) const {
    // Dimensions innermost first: dim, head, token, page; strides in bytes. A box is one page
    // of one head, box_dims of its dims (128 or 64 bytes: the swizzle span).
    const Shape& sh = options.shape;
    const cuuint64_t eb = static_cast<cuuint64_t>(DTypeBytes(sh.kv_dtype));
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(sh.head_dim),
                                static_cast<cuuint64_t>(sh.num_kv_heads),
                                static_cast<cuuint64_t>(sh.page_size),
                                static_cast<cuuint64_t>(num_pages)};
    const cuuint64_t strides[3] = {sh.head_dim * eb, sh.token_elems() * eb,
                                   sh.page_elems() * eb};
    const cuuint32_t box[4] = {static_cast<cuuint32_t>(kernels.box_dims), 1,
                               static_cast<cuuint32_t>(sh.page_size), 1};
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    // 128-byte promotion: 256 measured 6% slower on the largest workloads.
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    switch (options.tuning.tma_l2_promotion_bytes) {
      case 0: promotion = CU_TENSOR_MAP_L2_PROMOTION_NONE; break;
      case 64: promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_64B; break;
      case 256: promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B; break;
      default: break;
    }
    const CUtensorMapSwizzle swizzle =
        kernels.row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    const CUresult r = encode(map, TmaType(sh.kv_dtype), 4, const_cast<void*>(cache), dims,
                              strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      return KernelStatus::Error(KernelCode::kInternal,
                                 "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r));
    }
    return KernelStatus::Ok();
  }
};

KernelStatus CheckCudaDecodeDevice(int32_t device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return KernelStatus::Error(
        KernelCode::kUnavailable,
        e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e)
                         : std::string("no CUDA device"));
  }
  if (device < 0 || device >= count) {
    return Invalid("CUDA device " + std::to_string(device) + " does not exist (" +
                   std::to_string(count) + " present)");
  }
  int major = 0, minor = 0;
  PA_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                          "cudaDeviceGetAttribute");
  PA_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                          "cudaDeviceGetAttribute");
  if (major != 9) {
    return KernelStatus::Error(
        KernelCode::kFailedPrecondition,
        "CUDA device " + std::to_string(device) + " has compute capability " +
            std::to_string(major) + "." + std::to_string(minor) +
            "; the decode kernel is built for 9.0 (Hopper, sm_90a)");
  }
  return KernelStatus::Ok();
}

int32_t CudaDecodeDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int32_t usable = 0;
  for (int32_t d = 0; d < count; ++d) {
    if (CheckCudaDecodeDevice(d).ok()) ++usable;
  }
  cudaGetLastError();
  return usable;
}

CudaDecoder::CudaDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDecoder::~CudaDecoder() = default;

void CudaDecoder::SetTimelineForBenchmark(uint64_t* device_timeline) {
  impl_->timeline = device_timeline;
}

int32_t CudaDecoder::num_ctas() const { return impl_->capacity.num_ctas; }
int32_t CudaDecoder::threads_per_cta() const { return detail::kThreads; }
size_t CudaDecoder::shared_memory_bytes() const { return impl_->kernels.smem_bytes; }
CudaLoadPath CudaDecoder::load_path() const { return impl_->path; }
int32_t CudaDecoder::max_batch_size() const { return impl_->capacity.max_batch_size; }

KernelStatus CudaDecoder::Create(const Options& options, std::unique_ptr<CudaDecoder>* decoder) {
  if (decoder == nullptr) return Invalid("CudaDecoder::Create: null output");
  if (KernelStatus s = ValidateShape(options.shape); !s.ok()) {
    return Invalid("CudaDecoder::Create: " + s.message);
  }
  if (options.max_batch_size < 1 || options.max_batch_size > (1 << 24)) {
    return Invalid("CudaDecoder::Create: max_batch_size outside 1..2^24");
  }
  const int32_t promo = options.tuning.tma_l2_promotion_bytes;
  if (promo != 0 && promo != 64 && promo != 128 && promo != 256) {
    return Invalid("CudaDecoder::Create: tma_l2_promotion_bytes must be 0, 64, 128 or 256");
  }
  if (options.num_ctas < 0 || options.num_ctas > kMaxPlanCtas) {
    return Invalid("CudaDecoder::Create: num_ctas outside 0.." + std::to_string(kMaxPlanCtas));
  }
  if (options.tuning.parts_per_cta < 1 || options.tuning.parts_per_cta > kMaxPartsPerCta) {
    return Invalid("CudaDecoder::Create: parts_per_cta outside 1.." +
                   std::to_string(kMaxPartsPerCta));
  }
  if (options.tuning.min_part_units < 1) {
    return Invalid("CudaDecoder::Create: min_part_units < 1");
  }
  if (options.tuning.item_cost_pages < CudaDecoderTuning::kItemCostAuto ||
      (options.tuning.item_cost_pages > 0 && options.tuning.parts_per_cta > 1)) {
    return Invalid("CudaDecoder::Create: item_cost_pages must be >= 0 or kItemCostAuto, and not "
                   "> 0 with parts_per_cta > 1");
  }
  int device = options.device;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = 0;
  }
  if (KernelStatus s = CheckCudaDecodeDevice(device); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->kernels = KernelsFor(options.shape);
  impl->fixed = options.shape == Shape{};
  impl->device = device;
  if (options.device >= 0) PA_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
  int sms = 0, smem_optin = 0;
  PA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, impl->device),
      "cudaDeviceGetAttribute");
  PA_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, impl->device),
      "cudaDeviceGetAttribute");
  const detail::KernelSet& ks = impl->kernels;
  if (static_cast<size_t>(smem_optin) < ks.smem_bytes) {
    return KernelStatus::Error(KernelCode::kFailedPrecondition,
                               "device offers too little shared memory per block");
  }
  for (const auto& by_path : ks.decode) {
    for (detail::DecodeFn kernel : by_path) {
      if (kernel == nullptr) continue;
      PA_RETURN_IF_CUDA_ERROR(
          cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(ks.smem_bytes)),
          "cudaFuncSetAttribute");
    }
  }

  impl->capacity.num_ctas = options.num_ctas > 0 ? options.num_ctas : std::min(sms, kMaxPlanCtas);
  impl->capacity.max_batch_size = options.max_batch_size;
  impl->capacity.parts_per_cta = options.tuning.parts_per_cta;
  impl->capacity.min_part_units = options.tuning.min_part_units;
  impl->capacity.item_cost_units = ItemCostPages(options);
  impl->capacity.num_kv_heads = options.shape.num_kv_heads;
  impl->capacity.page_size = options.shape.page_size;
  impl->memo = std::make_unique<PlanMemo>(impl->capacity);
  impl->path = options.load_path;
  if (impl->path == CudaLoadPath::kTma) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess || fn == nullptr) {
      cudaGetLastError();
      impl->path = CudaLoadPath::kCpAsync;
    } else {
      impl->encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
  }
  if (!impl->fixed && impl->path != CudaLoadPath::kTma) {
    return KernelStatus::Error(KernelCode::kFailedPrecondition,
                               "CudaDecoder::Create: shapes other than " +
                                   DescribeShape(Shape{}) +
                                   " need the TMA load path, which is unavailable or not chosen");
  }

  const PlanCapacity& cap = impl->capacity;
  auto exhausted = [](const char* what, cudaError_t e) {
    cudaGetLastError();
    return KernelStatus::Error(KernelCode::kResourceExhausted,
                               std::string(what) + ": " + cudaGetErrorString(e));
  };
  cudaError_t e = cudaMallocHost(&impl->host_table, cap.TableBytes());
  if (e != cudaSuccess) return exhausted("cudaMallocHost (plan tables)", e);
  e = cudaMalloc(&impl->dev_table, cap.TableBytes());
  if (e != cudaSuccess) return exhausted("cudaMalloc (plan tables)", e);
  e = cudaMalloc(reinterpret_cast<void**>(&impl->part_o),
                 cap.MaxSlots() * ks.partial_floats * sizeof(float));
  if (e != cudaSuccess) return exhausted("cudaMalloc (partial outputs)", e);
  e = cudaMalloc(reinterpret_cast<void**>(&impl->part_lse),
                 cap.MaxSlots() * ks.max_group * sizeof(float));
  if (e != cudaSuccess) return exhausted("cudaMalloc (partial lse)", e);
  // The merge counters, the part queue's two counters, the merge kernel's per-group counts of
  // merged units.
  const size_t counter_bytes = (2 * cap.MaxGroups() + 2) * sizeof(int32_t);
  e = cudaMalloc(reinterpret_cast<void**>(&impl->counters), counter_bytes);
  if (e != cudaSuccess) return exhausted("cudaMalloc (merge counters)", e);
  PA_RETURN_IF_CUDA_ERROR(cudaMemset(impl->counters, 0, counter_bytes),
                          "cudaMemset (merge counters)");
  PA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&impl->copy_done, cudaEventDisableTiming),
                          "cudaEventCreate");
  PA_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  decoder->reset(new CudaDecoder(std::move(impl)));
  return KernelStatus::Ok();
}

KernelStatus CudaDecoder::Plan(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                               int32_t batch_size, CudaStream stream,
                               const int32_t* append_rows) {
  Impl& d = *impl_;
  if (d.copy_pending) {
    PA_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(d.copy_done), "cudaEventSynchronize");
    d.copy_pending = false;
  }
  d.planned = false;
  KernelStatus st =
      d.memo->Build(kv_indptr, kv_last_page_len, batch_size, d.host_table, &d.plan, append_rows);
  if (!st.ok()) return st;
  PA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(d.dev_table, d.host_table, d.plan.used_bytes,
                                          cudaMemcpyHostToDevice, stream),
                          "cudaMemcpyAsync (plan tables)");
  PA_RETURN_IF_CUDA_ERROR(cudaEventRecord(d.copy_done, stream), "cudaEventRecord");
  d.copy_pending = true;
  d.run_host_table = d.host_table;
  d.run_dev_table = d.dev_table;
  d.planned = true;
  return KernelStatus::Ok();
}

KernelStatus CudaDecoder::PlanInto(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                                   int32_t batch_size, void* host_table, void* dev_table,
                                   size_t* used_bytes, const int32_t* append_rows) {
  Impl& d = *impl_;
  d.planned = false;
  if (host_table == nullptr || dev_table == nullptr || used_bytes == nullptr ||
      !Aligned16(host_table) || !Aligned16(dev_table)) {
    return Invalid("CudaDecoder::PlanInto: null or unaligned table or used_bytes");
  }
  KernelStatus st =
      d.memo->Build(kv_indptr, kv_last_page_len, batch_size, host_table, &d.plan, append_rows);
  if (!st.ok()) return st;
  *used_bytes = d.plan.used_bytes;
  d.run_host_table = host_table;
  d.run_dev_table = dev_table;
  d.planned = true;
  return KernelStatus::Ok();
}

size_t CudaDecoder::table_bytes() const { return impl_->capacity.TableBytes(); }

KernelStatus CudaDecoder::Run(const DecodeArgs& args, CudaStream stream) {
  return Run(args, NewTokenRows{}, stream);
}

KernelStatus CudaDecoder::Run(const DecodeArgs& args, const NewTokenRows& rows,
                              CudaStream stream) {
  Impl& d = *impl_;
  if (!d.planned) {
    return KernelStatus::Error(KernelCode::kFailedPrecondition, "CudaDecoder::Run before Plan");
  }
  if (args.batch_size != d.plan.batch_size) {
    return Invalid("CudaDecoder::Run: batch_size " + std::to_string(args.batch_size) +
                   " differs from the planned " + std::to_string(d.plan.batch_size));
  }
  const Shape& shape = d.options.shape;
  if (args.shape != shape) {
    return Invalid("CudaDecoder::Run: the decoder serves " + DescribeShape(shape) + ", not " +
                   DescribeShape(args.shape));
  }
  const bool fp8 = shape.kv_dtype == DType::kFp8E4m3;
  if (fp8 && !(std::isfinite(args.k_scale) && args.k_scale > 0 && std::isfinite(args.v_scale) &&
               args.v_scale > 0)) {
    return Invalid("CudaDecoder::Run: fp8 pages need finite k_scale and v_scale > 0");
  }
  if (args.layer_k_scales != nullptr &&
      (!fp8 || args.layer_v_scales == nullptr || args.layer_pages < 1)) {
    return Invalid("CudaDecoder::Run: layer scales need fp8 pages, both arrays and layer_pages >= 1");
  }
  if (args.batch_size == 0) return KernelStatus::Ok();
  if (args.q == nullptr || args.output == nullptr || args.lse == nullptr) {
    return Invalid("CudaDecoder::Run: null q, output or lse");
  }
  if (!std::isfinite(args.sm_scale)) return Invalid("CudaDecoder::Run: sm_scale not finite");
  const bool has_pages = d.plan.total_pages > 0;
  if (has_pages) {
    if (args.k_cache == nullptr || args.v_cache == nullptr || args.kv_indices == nullptr) {
      return Invalid("CudaDecoder::Run: null k_cache, v_cache or kv_indices");
    }
    if (args.num_pages < 1 || args.num_pages > (int64_t{1} << 31)) {
      return Invalid("CudaDecoder::Run: num_pages outside 1..2^31");
    }
    if (!Aligned16(args.q) || !Aligned16(args.k_cache) || !Aligned16(args.v_cache)) {
      return Invalid("CudaDecoder::Run: q, k_cache and v_cache must be 16-byte aligned");
    }
  }
  if (d.plan.num_appends > 0) {
    if (rows.k == nullptr || rows.v == nullptr || !Aligned16(rows.k) || !Aligned16(rows.v)) {
      return Invalid("CudaDecoder::Run: the plan appends tokens: new rows null or unaligned");
    }
    if (rows.k_cache != args.k_cache || rows.v_cache != args.v_cache) {
      return Invalid("CudaDecoder::Run: the plan appends tokens: rows name other caches");
    }
  }

  detail::KernelParams p;
  std::memset(&p, 0, sizeof p);
  const bool tma = d.path == CudaLoadPath::kTma;
  if (tma && has_pages) {
    if (d.map_k != args.k_cache || d.map_v != args.v_cache || d.map_pages != args.num_pages) {
      d.map_k = nullptr;
      KernelStatus st = d.EncodeMap(args.k_cache, args.num_pages, &d.k_map);
      if (!st.ok()) return st;
      st = d.EncodeMap(args.v_cache, args.num_pages, &d.v_map);
      if (!st.ok()) return st;
      d.map_k = args.k_cache;
      d.map_v = args.v_cache;
      d.map_pages = args.num_pages;
    }
    p.k_map = d.k_map;
    p.v_map = d.v_map;
  }
  const char* table = static_cast<const char*>(d.run_dev_table);
  // 16-bit values travel as their bit patterns; fp8 pages are read through the tensor maps and
  // written as bytes (k_out, v_out).
  p.q = static_cast<const uint16_t*>(args.q);
  p.k_cache = static_cast<const uint16_t*>(args.k_cache);
  p.v_cache = static_cast<const uint16_t*>(args.v_cache);
  p.kv_indices = args.kv_indices;
  p.new_k = rows.k;
  p.new_v = rows.v;
  p.k_out = static_cast<uint16_t*>(rows.k_cache);
  p.v_out = static_cast<uint16_t*>(rows.v_cache);
  p.output = static_cast<uint16_t*>(args.output);
  p.lse = args.lse;
  p.header = reinterpret_cast<const PlanHeader*>(table);
  p.items = reinterpret_cast<const WorkItem*>(table + d.capacity.ItemsOffset());
  p.groups = reinterpret_cast<const MergeGroup*>(table + d.capacity.GroupsOffset());
  p.part_o = d.part_o;
  p.part_lse = d.part_lse;
  p.counters = d.counters;
  p.queue = d.counters + d.capacity.MaxGroups();
  p.done = p.queue + 1;
  // fp8 pages: the K scale is each item's (its layer's), folded in by the kernel.
  p.scale_log2 = args.sm_scale * 1.4426950408889634f;
  p.layer_k_scales = args.layer_k_scales;
  p.layer_v_scales = args.layer_v_scales;
  p.layer_pages = args.layer_pages;
  p.num_qo_heads = shape.num_qo_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.group = shape.group_size();
  p.page_size = shape.page_size;
  p.pages_per_tile = detail::kStageTokens / shape.page_size;
  p.io_fp16 = shape.dtype == DType::kFp16 ? 1 : 0;
  p.k_scale = fp8 ? args.k_scale : 1.0f;
  p.v_scale = fp8 ? args.v_scale : 1.0f;
  p.skip_attention = d.options.tuning.skip_attention ? 1 : 0;
  using Merge = CudaDecoderTuning::Merge;
  const Merge mode = d.options.tuning.merge;
  const bool merge_kernel =
      mode == Merge::kKernel ||
      (mode == Merge::kAuto && 2 * int64_t{d.plan.num_segments} <= d.capacity.num_ctas);
  const bool on_signal = d.options.tuning.merge_wait == CudaDecoderTuning::MergeWait::kCounters;
  p.merge_mode = !merge_kernel ? detail::kMergeInKernel
                 : on_signal   ? detail::kMergeOnSignal
                               : detail::kMergeAfterGrid;
  p.zero_tail_in_shared = d.options.tuning.zero_tail_in_shared ? 1 : 0;
  p.output_vec = reinterpret_cast<uintptr_t>(args.output) % 8 == 0 ? 1 : 0;
  p.timeline = reinterpret_cast<unsigned long long*>(d.timeline);
  if (d.options.tuning.first_items_in_params) {
    p.first_from_params = 1;
    p.num_parts = d.plan.num_parts;
    std::memcpy(p.first, static_cast<const char*>(d.run_host_table) + d.capacity.ItemsOffset(),
                sizeof(WorkItem) * d.capacity.num_ctas);
  }

  const bool appends = d.plan.num_appends > 0;
  cudaLaunchConfig_t decode_config = {};
  decode_config.gridDim = dim3(d.capacity.num_ctas);
  decode_config.blockDim = dim3(detail::kThreads);
  decode_config.dynamicSmemBytes = d.kernels.smem_bytes;
  decode_config.stream = stream;
  PA_RETURN_IF_CUDA_ERROR(
      cudaLaunchKernelEx(&decode_config, d.kernels.decode[tma ? 1 : 0][appends ? 1 : 0], p),
      "decode kernel launch");
  if (!merge_kernel || d.plan.num_groups == 0) return KernelStatus::Ok();

  detail::MergeParams mp;
  mp.header = p.header;
  mp.groups = p.groups;
  mp.part_o = d.part_o;
  mp.part_lse = d.part_lse;
  mp.output = p.output;
  mp.lse = args.lse;
  mp.counters = d.counters;
  mp.merged = d.counters + d.capacity.MaxGroups() + 2;
  mp.on_signal = on_signal ? 1 : 0;
  mp.end_stamp = d.timeline == nullptr ? nullptr
                 : reinterpret_cast<unsigned long long*>(d.timeline) +
                       detail::kTimelineSlots * d.capacity.num_ctas;
  mp.num_qo_heads = p.num_qo_heads;
  mp.num_kv_heads = p.num_kv_heads;
  mp.group = p.group;
  mp.io_fp16 = p.io_fp16;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(d.capacity.num_ctas);
  config.blockDim = dim3(detail::kMergeThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (d.options.tuning.programmatic_launch) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  PA_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&config, d.kernels.merge, mp),
                          "merge kernel launch");
  return KernelStatus::Ok();
}

}  // namespace pagedattn::kernels
