// Writes into the paged KV pool on the device: copy on write of whole pages (in every layer, K
// and V) and the scatter of staged token rows into their slots. Phases 1 and 2 of a backend
// batch (server/backend/backend.h); each is one kernel launch, with no allocation and no
// synchronisation.
//
// Plain C++ (no CUDA header needed). Defined in the CUDA build of pagedattn_kernels_cuda only
// (nvcc present); the service's CUDA backend is its one user. Every pointer is device memory;
// the caller guarantees the ranges (the kernels do not check page ids or slots).
#pragma once

#include <cstdint>

#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/status.h"

namespace pagedattn::kernels {

// Copy page src -> page dst, for every layer, K and V. The pool is [num_layers][layer_pages]
// pages; page ids are per layer. The copies of one launch run in parallel: a dst must not be
// the src or dst of another copy of the same launch.
struct PageCopyArgs {
  void* k_cache = nullptr;          // [num_layers * layer_pages] pages of page_bytes
  void* v_cache = nullptr;          // the same
  const int32_t* copies = nullptr;  // [num_copies, 2]: (src, dst) page ids in 0..layer_pages-1
  int32_t num_copies = 0;
  int32_t num_layers = 0;
  int64_t layer_pages = 0;
  int64_t page_bytes = kPageBytes;  // one page of K (or V), a multiple of 16
};

// Token t's K and V rows go to slot slots[t] (pool page * page_size + offset in the page).
// Tokens of one launch are written in parallel: slots must be distinct. Rows arrive in the
// callers' type (bf16 or fp16, token_elems values each); fp8 pages get each value divided by
// its layer's scale and rounded as StoreKvValues does.
struct TokenScatterArgs {
  void* k_cache = nullptr;            // [pool pages, page_size, num_kv_heads, head_dim]
  void* v_cache = nullptr;            // the same
  const int64_t* slots = nullptr;     // [num_tokens]
  const uint16_t* k_rows = nullptr;   // [num_tokens, token_elems], 16-byte aligned
  const uint16_t* v_rows = nullptr;   // [num_tokens, token_elems], 16-byte aligned
  int64_t num_tokens = 0;
  int64_t token_elems = kTokenElems;  // num_kv_heads * head_dim, a multiple of 8
  bool fp16 = false;                  // rows in fp16 (else bf16)
  bool fp8 = false;                   // pages in fp8 e4m3 (else the rows' type)
  // fp8: the scales of every layer (device arrays; slot s is in layer s / layer_slots), or
  // null and one k_scale / v_scale for all.
  const float* layer_k_scales = nullptr;
  const float* layer_v_scales = nullptr;
  int64_t layer_slots = 0;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// Launch on `stream`. Nothing to do (0 copies or tokens) is OK. InvalidArgument for null
// pointers or negative counts; Internal when the launch fails.
KernelStatus LaunchPageCopies(const PageCopyArgs& args, CudaStream stream);
KernelStatus LaunchTokenScatter(const TokenScatterArgs& args, CudaStream stream);

}  // namespace pagedattn::kernels
