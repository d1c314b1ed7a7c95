// The paged decode kernel. One CTA per SM, 5 warps, persistent over the parts of the plan it
// takes: its own part first (part blockIdx.x), then, when the plan has more parts than CTAs, the
// next free one from a queue (an atomic counter) each time it has issued the last page of a part.
//   warp 4      producer: takes the parts, walks their items and pages, waits for a free stage,
//               tags it with what it holds (item, page) and copies one (page, KV head) of K and
//               V into it (TMA boxes of 64 tokens x 64 dims, 128-byte swizzled; or cp.async in
//               the same layout), and the item's 6 query heads with its first page; empty
//               (seq, head)s and the end of the work travel as tags without data;
//   warps 0..3  consumers: follow the stages' tags; each takes 16 of the page's 64 tokens;
//               S = Q K^T and O += P V on the tensor cores (m16n8k16, the 6 query heads in rows
//               0..5 of A), online softmax in base 2; at the end of an item the 4 warps combine
//               through shared memory and either write the output or a partial result that
//               MergeKernel merges (by default; or the last piece's CTA: merge_mode).
// The stages form a ring of kStages buffers with a full and an empty mbarrier each.
//
// Shapes (Config below): the description above is the default shape (24/4/128, pages of 64,
// bf16), built with every size a constant. Other shapes are built per head dim and page type:
// a stage holds one or more tiles of 64 tokens of one KV head (a tile: 64 / page_size pages, one
// TMA box per page and 128 bytes of dims; as many tiles as make 32 KiB), the item's query heads
// (1..8) fill rows 0..group-1 of A, and head counts and page size come from the launch
// parameters; at head dims 64 and 128 the consumers take an item's tiles two at a time (32
// tokens per warp per softmax update). fp8 pages are multiplied in fp16 (every e4m3 value is an
// fp16 value): K rows feed the MMA with their dims permuted within each 16 (the query's
// fragments follow the same permutation), V's transposed fragments split into even and odd dims
// (the output's order is restored when it is written). k_scale is folded into the softmax
// scale, v_scale into the output.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "ptx.cuh"

namespace pagedattn::kernels::detail {

inline constexpr int kConsumerWarps = 4;
inline constexpr int kConsumerThreads = kConsumerWarps * 32;
inline constexpr int kThreads = kConsumerThreads + 32;
inline constexpr int kStageTokens = 64;                            // tokens of one stage
inline constexpr int kTokensPerWarp = kStageTokens / kConsumerWarps;  // 16
inline constexpr uint32_t kConsumerBarrier = 1;                    // named barrier of warps 0..3
inline constexpr int kSmemLimit = 227 * 1024;                      // a Hopper block's opt-in

// The element type of the pages, which decides the MMA's: bf16 pages multiply in bf16, fp16
// and fp8 pages in fp16.
enum class PageKind { kBf16, kFp16, kFp8 };

// What a build of the kernel fixes at compile time. kFixed: the default shape (decode.h), every
// size a constant; else head counts, group and page size are KernelParams fields.
template <int kHeadDimT, PageKind kPagesT, bool kFixedT = false>
struct Config {
  static constexpr int kHeadDim = kHeadDimT;
  static constexpr PageKind kPages = kPagesT;
  static constexpr bool kFixed = kFixedT;
  static constexpr bool kFp8 = kPages == PageKind::kFp8;
  static constexpr bool kF16Math = kPages != PageKind::kBf16;
  static constexpr int kMaxGroup = kFixed ? kGroupSize : kMaxGroupSize;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  // A stage holds K then V, each as boxes of 64 token rows of kRowBytes (128, or 64 for fp8
  // pages of head dim 64), swizzled like TMA's 128-byte (64-byte) swizzle.
  static constexpr int kRowBytes = kHeadDim * kElemBytes >= 128 ? 128 : 64;
  static constexpr int kBoxDims = kRowBytes / kElemBytes;
  static constexpr int kBoxes = kHeadDim / kBoxDims;
  static constexpr int kBoxBytes = kStageTokens * kRowBytes;
  static constexpr int kHalfBytes = kBoxes * kBoxBytes;  // the K (or V) of a stage
  static constexpr int kStageBytes = 2 * kHalfBytes;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kKSteps = kHeadDim / 16;   // MMA k-steps of S = Q K^T
  static constexpr int kNTiles = kHeadDim / 8;    // n-tiles of O
  static constexpr int kQBytes = kMaxGroup * kHeadDim * 2;    // the query heads of a KV head
  static constexpr int kPartialFloats = kMaxGroup * kHeadDim; // one slot of partial output
  // Dims per thread where 128 threads share a row (CombineWarps, MergeKernel), and per lane
  // where 32 lanes do (Merge).
  static constexpr int kDimsPerThread = kHeadDim >= kConsumerThreads ? kHeadDim / kConsumerThreads : 1;
  static constexpr int kDimsPerLane = kHeadDim / 32;
  // Pieces per warp whose loads an in-kernel merge round keeps in flight: fewer where a piece
  // is larger (more query heads, more dims), so that the round's registers do not spill.
  static constexpr int kMergeRound = kFixed ? 3 : (kHeadDim >= 256 ? 1 : 2);
  // The consumers take an item's stages two at a time where it has two left (ProcessTiles).
  // Not at head dim 256, where the second stage's fragments spill (measured 1.4x slower).
  static constexpr bool kPairs = !kFixed && kHeadDim <= 128;
  // Tiles of 64 tokens (kStageBytes each, one after the other) per stage of the ring: enough
  // that a stage carries 32 KiB. Each stage costs the producer a wait, a tag and its barrier
  // handshakes whatever it holds; measured with the loads alone, 16 KiB stages reached 1.31-1.36x
  // of the streaming read and 8 KiB ones 2.35x, where 32 KiB ones reached 1.18x. Where a stage
  // holds tiles, the consumers take them two at a time within it.
  static constexpr int kTilesPerStage = kFixed || kStageBytes >= 32768 ? 1 : 32768 / kStageBytes;
  static constexpr int kRingStageBytes = kTilesPerStage * kStageBytes;
  static_assert(kTilesPerStage == 1 || kPairs, "tiles of a stage are taken in pairs");
  // Stages: 6 for the default shape; else as many as fit beside the rest, at most 12.
  static constexpr int kRestBytes = 4 * kConsumerWarps * kMaxGroup * (kHeadDim + 2) + 64 + 1024;
  static constexpr int kStages =
      kFixed ? 6 : ((kSmemLimit - kRestBytes) / (kRingStageBytes + kQBytes + 48) < 12
                        ? (kSmemLimit - kRestBytes) / (kRingStageBytes + kQBytes + 48)
                        : 12);
  static_assert(kStages >= 2, "fewer than two stages fit in shared memory");
};
using DefaultConfig = Config<kHeadDim, PageKind::kBf16, true>;
// Arrivals that complete a full barrier: TMA: the producer's arrive.expect_tx; cp.async: the 32
// lanes' copy completions and lane 0's own arrival after it wrote the stage's tag.
inline constexpr uint32_t kFullArrivalsTma = 1;
inline constexpr uint32_t kFullArrivalsCpAsync = 33;

// Who merges the pieces of split (seq, head)s (KernelParams::merge_mode).
inline constexpr int32_t kMergeInKernel = 0;  // the decode kernel's CTA that finishes the last piece
inline constexpr int32_t kMergeAfterGrid = 1;  // MergeKernel, once the whole decode grid is done
// MergeKernel, each group as soon as its pieces are written: the decode kernel counts them in
// counters[group] (a release add after the piece's partial stores) and MergeKernel acquires it.
inline constexpr int32_t kMergeOnSignal = 2;

// What a stage holds, written by the producer before the stage's full barrier completes.
inline constexpr int32_t kTagEmpty = -1;  // no data: an empty sequence's (seq, head)
inline constexpr int32_t kTagEnd = -2;    // no data: this CTA has no more work
struct StageTag {
  // >= 0: the stage's first tile of 64 tokens is the item's tile `tile` (the default shape:
  // its page `tile`); else kTagEmpty or kTagEnd.
  int32_t tile;
  int32_t num_tiles;  // the item's tiles
  int32_t seq_head;
  int32_t last_len;
  int32_t slot;
  int32_t group;
  // fp8 pages, the item's first stage only: the K and V scales of the item's layer.
  float k_scale;
  float v_scale;
};

struct KernelParams {
  // k_cache as [pages][page_size tokens][kv heads][head_dim], box kBoxDims x 1 x page_size x 1
  // (the default: [pages][64][4][128] bf16, box 64x1x64x1).
  CUtensorMap k_map;
  CUtensorMap v_map;  // v_cache, the same
  const uint16_t* q;           // [batch, 24, 128] bf16
  const uint16_t* k_cache;     // [pages, 64, 4, 128] bf16 (cp.async path)
  const uint16_t* v_cache;     // [pages, 64, 4, 128] bf16 (cp.async path)
  const int32_t* kv_indices;   // [total pages]
  const uint16_t* new_k;       // [rows, 4, 128] bf16: the tokens the plan appends (decode_plan.h)
  const uint16_t* new_v;       // [rows, 4, 128] bf16
  uint16_t* k_out;             // k_cache, where those tokens are written (null without appends)
  uint16_t* v_out;             // v_cache, the same
  uint16_t* output;            // [batch, 24, 128] bf16
  float* lse;                  // [batch, 24] fp32, base 2
  const PlanHeader* header;    // the plan's header (number of parts)
  const WorkItem* items;       // the plan's items
  const MergeGroup* groups;    // the plan's merge groups
  float* part_o;               // [slots, 6, 128] partial outputs, each normalised
  float* part_lse;             // [slots, 6] their base-2 log-sum-exp
  int32_t* counters;           // [groups] pieces finished; zero between launches
  int32_t* queue;              // parts handed out beyond the CTAs' own; zero between launches
  int32_t* done;               // CTAs that found the queue empty; zero between launches
  float scale_log2;            // sm_scale * log2(e)
  int32_t skip_attention;      // benchmarking only: move the pages, skip the math
  int32_t merge_mode;          // kMergeInKernel, kMergeAfterGrid or kMergeOnSignal
  // 1: the V rows of a last page's unused tokens are zeroed in shared memory (then a proxy
  // fence before the stage is released); 0: the V fragments of those tokens are zeroed in
  // registers (no shared-memory write, no fence).
  int32_t zero_tail_in_shared;
  int32_t output_vec;  // 1: output is 8-byte aligned, stored 4 dims at a time (StoreChunks)
  unsigned long long* timeline;
  // The plan's header and each CTA's first item, copied into the launch parameters (when
  // first_from_params): a CTA starts with its page ids' load instead of a table load first.
  int32_t first_from_params;
  int32_t num_parts;
  WorkItem first[kMaxPlanCtas];  // benchmarking only: [ctas][4] %globaltimer stamps, or null
  // Shapes other than the default (Config::kFixed false) read these; the default's kernel
  // uses the constants of decode.h.
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t group;             // num_qo_heads / num_kv_heads, 1..8
  int32_t page_size;         // 16, 32 or 64
  int32_t pages_per_tile;    // 64 / page_size
  int32_t io_fp16;           // q, new rows and output in fp16 (else bf16); fp8 pages only
  float v_scale;             // fp8 pages: a stored V reads back as value * v_scale
  float k_scale;             // fp8 pages: the same for K (appends divide by it)
  // fp8 pages of several layers (DecodeArgs::layer_k_scales): page p's scales are
  // layer_k_scales[p / layer_pages] and layer_v_scales[...]; null: k_scale and v_scale.
  const float* layer_k_scales;
  const float* layer_v_scales;
  int64_t layer_pages;
};

// The K and V scales of the layer that page `page` (an id) belongs to (fp8 pages).
__device__ __forceinline__ float2 PageScales(const KernelParams& p, int page) {
  if (p.layer_k_scales == nullptr) return make_float2(p.k_scale, p.v_scale);
  const int64_t layer = page / p.layer_pages;
  return make_float2(__ldg(p.layer_k_scales + layer), __ldg(p.layer_v_scales + layer));
}

// Shape accessors: constants for the default shape, launch parameters otherwise.
template <class C>
__device__ __forceinline__ int NumKvHeads(const KernelParams& p) {
  if constexpr (C::kFixed) return kNumKvHeads; else return p.num_kv_heads;
}
template <class C>
__device__ __forceinline__ int NumQoHeads(const KernelParams& p) {
  if constexpr (C::kFixed) return kNumQoHeads; else return p.num_qo_heads;
}
template <class C>
__device__ __forceinline__ int Group(const KernelParams& p) {
  if constexpr (C::kFixed) return kGroupSize; else return p.group;
}
// Whether q, the new rows and the output are fp16 (else bf16).
template <class C>
__device__ __forceinline__ bool IoFp16(const KernelParams& p) {
  if constexpr (C::kPages == PageKind::kFp8) return p.io_fp16 != 0;
  else return C::kPages == PageKind::kFp16;
}

template <class C>
struct alignas(1024) SharedStorage {
  uint8_t stage[C::kStages][C::kRingStageBytes];  // 1024-aligned boxes (swizzled)
  uint8_t q[C::kStages][C::kQBytes];
  float scratch_o[kConsumerWarps][C::kMaxGroup][C::kHeadDim];
  float scratch_m[kConsumerWarps][C::kMaxGroup];
  float scratch_l[kConsumerWarps][C::kMaxGroup];
  StageTag tag[C::kStages];
  uint64_t full[C::kStages];
  uint64_t empty[C::kStages];
  int32_t is_last;
  uint32_t merges;  // benchmarking only (timeline): in-kernel merges done by this CTA
};
template <class C>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<C>) + 1024;  // + alignment slack

__device__ __forceinline__ WorkItem LoadItem(const WorkItem* item) {
  const int4* v = reinterpret_cast<const int4*>(item);
  const int4 a = __ldg(v);
  const int4 b = __ldg(v + 1);
  WorkItem w;
  w.page_begin = a.x;
  w.num_pages = a.y;
  w.seq_head = a.z;
  w.last_len = a.w;
  w.slot = b.x;
  w.group = b.y;
  w.rest_begin = b.z;
  w.rest_count = b.w;
  return w;
}

__device__ __forceinline__ uint16_t ToBf16(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint16_t ToF16(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ float Bf16Bits(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
__device__ __forceinline__ float F16Bits(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// An output element in the caller's type.
template <class C>
__device__ __forceinline__ uint16_t ToIo(const KernelParams& p, float x) {
  return IoFp16<C>(p) ? ToF16(x) : ToBf16(x);
}

// Offset of 16-byte chunk `chunk` (0..C::kHeadDim * kElemBytes / 16) of token row `token`
// within the K or V of a stage: the chunk's box, then TMA's swizzle, which XORs the chunk index
// with the row index mod 8 (128-byte rows) or with row / 2 mod 4 (64-byte rows).
template <class C>
__device__ __forceinline__ uint32_t SwizzledOffset(int token, int chunk) {
  if constexpr (C::kRowBytes == 128) {
    return static_cast<uint32_t>((chunk >> 3) * C::kBoxBytes + token * 128 +
                                 (((chunk & 7) ^ (token & 7)) << 4));
  } else {
    return static_cast<uint32_t>(token * 64 + ((chunk ^ ((token >> 1) & 3)) << 4));
  }
}

// ---------------------------------------------------------------------------------------------
// Producer

// The producer's position in the ring.
template <class C>
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void Advance() {
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Tags a stage. tile: the item's tile the stage starts with (>= 0) or kTagEmpty / kTagEnd;
// num_tiles: the item's tiles; last_len: the item's (the default shape, whose tiles are its
// pages) or the valid tokens of the item's last tile (other shapes).
template <class C>
__device__ __forceinline__ void WriteTag(SharedStorage<C>& s, int stage, int32_t tile,
                                         const WorkItem& it, int32_t num_tiles,
                                         int32_t last_len) {
  StageTag& t = s.tag[stage];
  t.tile = tile;
  t.num_tiles = num_tiles;
  t.seq_head = it.seq_head;
  t.last_len = last_len;
  t.slot = it.slot;
  t.group = it.group;
}

// A stage without data (kTagEmpty or kTagEnd): lane 0 waits for it, tags it and completes its
// full barrier with every arrival the barrier expects.
template <class C, bool kTma>
__device__ void ProduceTagOnly(SharedStorage<C>& s, Ring<C>& ring, int32_t tag,
                               const WorkItem& it, int lane) {
  if (lane == 0) {
    ptx::MbarWait(ptx::SmemAddr(&s.empty[ring.stage]), ring.phase ^ 1);
    WriteTag(s, ring.stage, tag, it, it.num_pages, it.last_len);
    ptx::MbarArriveCount(ptx::SmemAddr(&s.full[ring.stage]),
                         kTma ? kFullArrivalsTma : kFullArrivalsCpAsync);
  }
  ring.Advance();
}

// Lane j's share of the page ids of chunk [base, base + 32) of an item: the id of page base + j.
__device__ __forceinline__ int LoadPageIds(const KernelParams& p, const WorkItem& it, int base,
                                           int lane) {
  return lane < it.num_pages - base ? __ldg(p.kv_indices + it.page_begin + base + lane) : 0;
}

// Where an item's query heads start in q (and in the output), in rows of head_dim.
template <class C>
__device__ __forceinline__ int64_t QueryRow(const KernelParams& p, int seq_head) {
  const int seq = seq_head / NumKvHeads<C>(p);
  const int kvh = seq_head % NumKvHeads<C>(p);
  return int64_t{seq} * NumQoHeads<C>(p) + kvh * Group<C>(p);
}

// Waits for a free stage, tags it and issues the copy of page `page` (id) of item `it` into it:
// the default shape, one page per stage.
template <class C, bool kTma>
__device__ __forceinline__ void IssueStage(const KernelParams& p, SharedStorage<C>& s,
                                           Ring<C>& ring, const WorkItem& it, int index, int page,
                                           int lane) {
  static_assert(C::kFixed);
  constexpr int kHalfBytes = C::kBoxBytes;  // one box: 64 tokens x 64 dims
  constexpr int kPageBytes = static_cast<int>(kPageElems * 2);
  const int kvh = it.seq_head % kNumKvHeads;
  const uint16_t* q_src = p.q + QueryRow<C>(p, it.seq_head) * kHeadDim;
  const bool first = index == 0;
  const int stage = ring.stage;
  const uint32_t full = ptx::SmemAddr(&s.full[stage]);
  const uint32_t empty = ptx::SmemAddr(&s.empty[stage]);
  const uint32_t dst = ptx::SmemAddr(s.stage[stage]);
  if constexpr (kTma) {
    if (lane == 0) {
      ptx::MbarWait(empty, ring.phase ^ 1);
      WriteTag(s, stage, index, it, it.num_pages, it.last_len);
      ptx::MbarArriveExpectTx(full, C::kStageBytes + (first ? C::kQBytes : 0));
      ptx::TmaLoad4d(dst, &p.k_map, 0, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + kHalfBytes, &p.k_map, 64, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + 2 * kHalfBytes, &p.v_map, 0, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + 3 * kHalfBytes, &p.v_map, 64, kvh, 0, page, full);
      if (first) ptx::BulkLoad(ptx::SmemAddr(s.q[stage]), q_src, C::kQBytes, full);
    }
  } else {
    ptx::MbarWait(empty, ring.phase ^ 1);
    if (lane == 0) WriteTag(s, stage, index, it, it.num_pages, it.last_len);
    const int64_t page_off = int64_t{page} * kPageBytes + kvh * kHeadDim * 2;
    const char* kp = reinterpret_cast<const char*>(p.k_cache) + page_off;
    const char* vp = reinterpret_cast<const char*>(p.v_cache) + page_off;
#pragma unroll 8
    for (int c = lane; c < kPageSize * 16; c += 32) {
      const int token = c >> 4;
      const int chunk = c & 15;
      const uint32_t off = SwizzledOffset<C>(token, chunk);
      const int src = token * static_cast<int>(kTokenElems * 2) + chunk * 16;
      ptx::CpAsync16(dst + off, kp + src);
      ptx::CpAsync16(dst + 2 * kHalfBytes + off, vp + src);
    }
    if (first) {
      for (int c = lane; c < C::kQBytes / 16; c += 32) {
        ptx::CpAsync16(ptx::SmemAddr(s.q[stage]) + c * 16,
                       reinterpret_cast<const char*>(q_src) + c * 16);
      }
    }
    ptx::CpAsyncArriveNoinc(full);
    if (lane == 0) ptx::MbarArrive(full);  // releases the tag
  }
  ring.Advance();
}

// The same for other shapes (TMA only): the stage takes the item's tiles from `index` on (of
// `num_tiles`), its pages `pages[0..n)` (ids): page j into tile j / pps, each page as page_size
// rows of every box of K and of V.
template <class C>
__device__ __forceinline__ void IssueStagePages(const KernelParams& p, SharedStorage<C>& s,
                                                Ring<C>& ring, const WorkItem& it, int index,
                                                int num_tiles, int last_valid,
                                                const int (&pages)[4 * C::kTilesPerStage], int n,
                                                int lane) {
  static_assert(!C::kFixed);
  if (lane != 0) {
    ring.Advance();
    return;
  }
  const int kvh = it.seq_head % p.num_kv_heads;
  const bool first = index == 0;
  const int stage = ring.stage;
  const uint32_t full = ptx::SmemAddr(&s.full[stage]);
  const uint32_t dst = ptx::SmemAddr(s.stage[stage]);
  const uint32_t page_bytes = static_cast<uint32_t>(p.page_size) * C::kRowBytes;
  const uint32_t q_bytes = static_cast<uint32_t>(p.group) * C::kHeadDim * 2;
  const int pps_log2 = __ffs(p.pages_per_tile) - 1;  // pages per tile: 1, 2 or 4
  float2 scales = make_float2(1.0f, 1.0f);
  if (C::kFp8 && first) scales = PageScales(p, pages[0]);  // before the wait: its load in flight
  ptx::MbarWait(ptx::SmemAddr(&s.empty[stage]), ring.phase ^ 1);
  WriteTag(s, stage, index, it, num_tiles, last_valid);
  if (C::kFp8 && first) {
    s.tag[stage].k_scale = scales.x;
    s.tag[stage].v_scale = scales.y;
  }
  ptx::MbarArriveExpectTx(full, 2 * C::kBoxes * page_bytes * n + (first ? q_bytes : 0));
#pragma unroll
  for (int j = 0; j < 4 * C::kTilesPerStage; ++j) {
    if (j >= n) break;
    const int tile = C::kTilesPerStage == 1 ? 0 : j >> pps_log2;
    const uint32_t page_dst =
        dst + tile * C::kStageBytes + (j - (tile << pps_log2)) * page_bytes;
#pragma unroll
    for (int b = 0; b < C::kBoxes; ++b) {
      const uint32_t at = page_dst + b * C::kBoxBytes;
      ptx::TmaLoad4d(at, &p.k_map, b * C::kBoxDims, kvh, 0, pages[j], full);
      ptx::TmaLoad4d(at + C::kHalfBytes, &p.v_map, b * C::kBoxDims, kvh, 0, pages[j], full);
    }
  }
  if (first) {
    const uint16_t* q_src = p.q + QueryRow<C>(p, it.seq_head) * C::kHeadDim;
    ptx::BulkLoad(ptx::SmemAddr(s.q[stage]), q_src, q_bytes, full);
  }
  ring.Advance();
}

// An appended token (decode_plan.h): its K row in lanes 0-15 and its V row in lanes 16-31, the
// item's KV head's part of each, 16 bytes per vector, C::kHeadDim / 128 vectors per lane (one
// for head dims 64 and 128; for 64 only lanes 0-7 and 16-23 hold one).
template <class C>
struct NewRow {
  static constexpr int kVecs = C::kHeadDim >= 128 ? C::kHeadDim / 128 : 1;
  uint4 v[kVecs];
};
template <class C>
__device__ __forceinline__ bool HoldsNewRow(int lane) {
  return (lane & 15) * NewRow<C>::kVecs < C::kHeadDim / 8;
}
template <class C>
__device__ __forceinline__ NewRow<C> LoadNewRow(const KernelParams& p, const WorkItem& it,
                                                int row, int lane) {
  const int kvh = it.seq_head % NumKvHeads<C>(p);
  const uint16_t* src = lane < 16 ? p.new_k : p.new_v;
  const int64_t token_elems = int64_t{NumKvHeads<C>(p)} * C::kHeadDim;
  const uint4* from = reinterpret_cast<const uint4*>(src + int64_t{row} * token_elems +
                                                     kvh * C::kHeadDim) +
                      (lane & 15) * NewRow<C>::kVecs;
  NewRow<C> r;
#pragma unroll
  for (int i = 0; i < NewRow<C>::kVecs; ++i) {
    r.v[i] = HoldsNewRow<C>(lane) ? __ldg(from + i) : make_uint4(0u, 0u, 0u, 0u);
  }
  return r;
}

// Eight values of the caller's type (one 16-byte vector) to eight e4m3 bytes of value / scale,
// the CPU's StoreKvValues bit for bit (IEEE division, then the saturating conversion).
__device__ __forceinline__ uint2 QuantizeVec(uint4 x, bool fp16, float scale) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t word = w[2 * i + k];
      const float lo = fp16 ? F16Bits(word & 0xffffu) : Bf16Bits(word & 0xffffu);
      const float hi = fp16 ? F16Bits(word >> 16) : Bf16Bits(word >> 16);
      const uint16_t q = ptx::F32x2ToE4m3x2(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale));
      packed |= uint32_t{q} << (16 * k);
    }
    out[i] = packed;
  }
  return make_uint2(out[0], out[1]);
}

// Stores the appended token into its place, the last valid token of page `page`, before that
// page's copy is issued: the stores, then a proxy fence in every lane and a warp barrier, so that
// the copy engine's read (TMA, the async proxy) or the lanes' cp.async see them. fp8 pages get
// the row quantized with their layer's scale.
template <class C, bool kTma>
__device__ __forceinline__ void StoreNewRow(const KernelParams& p, const WorkItem& it, int page,
                                            const NewRow<C>& row, int lane) {
  const int kvh = it.seq_head % NumKvHeads<C>(p);
  const int token = (it.last_len & kLastLenMask) - 1;
  const int64_t token_elems = int64_t{NumKvHeads<C>(p)} * C::kHeadDim;
  const int64_t page_elems = C::kFixed ? kPageElems : p.page_size * token_elems;
  const int64_t elem = int64_t{page} * page_elems + token * token_elems + kvh * C::kHeadDim;
  if (HoldsNewRow<C>(lane)) {
    if constexpr (C::kFp8) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(lane < 16 ? p.k_out : p.v_out) + elem;
      const float2 scales = PageScales(p, page);
      const float scale = lane < 16 ? scales.x : scales.y;
#pragma unroll
      for (int i = 0; i < NewRow<C>::kVecs; ++i) {
        reinterpret_cast<uint2*>(dst)[(lane & 15) * NewRow<C>::kVecs + i] =
            QuantizeVec(row.v[i], p.io_fp16 != 0, scale);
      }
    } else {
      uint16_t* dst = (lane < 16 ? p.k_out : p.v_out) + elem;
#pragma unroll
      for (int i = 0; i < NewRow<C>::kVecs; ++i) {
        reinterpret_cast<uint4*>(dst)[(lane & 15) * NewRow<C>::kVecs + i] = row.v[i];
      }
    }
  }
  if constexpr (kTma) ptx::FenceProxyAsyncGlobal();
  __syncwarp();
}

// The items of one part (head and its rest), page by page; each item's page ids 32 at a time
// (a lane each), the next item's work item in flight meanwhile. (Loading the work items two
// ahead and each next chunk of page ids a chunk ahead measured no faster.) Other shapes than
// the default issue a stage per 64 / page_size pages.
template <class C, bool kTma, bool kAppends>
__device__ void ProducePart(const KernelParams& p, SharedStorage<C>& s, Ring<C>& ring,
                            const WorkItem& head, int lane) {
  const int count = head.seq_head < 0 ? 0 : 1 + head.rest_count;
  WorkItem next = head;
  for (int i = 0; i < count; ++i) {
    const WorkItem it = next;
    if (i + 1 < count) next = LoadItem(p.items + head.rest_begin + i);  // in flight meanwhile
    if (it.num_pages == 0) {
      ProduceTagOnly<C, kTma>(s, ring, kTagEmpty, it, lane);
      continue;
    }
    // An item that ends a sequence the plan appends to loads the token's row now, while its page
    // ids make their trip, and stores it just before its last page is issued. (A plan without
    // appends runs the kernel built without this, which measured 0.1-1.1% faster.)
    const int append_row = kAppends ? (it.last_len >> kLastLenBits) - 1 : -1;
    NewRow<C> new_row{};
    if (kAppends && append_row >= 0) new_row = LoadNewRow<C>(p, it, append_row, lane);
    if constexpr (C::kFixed) {
      for (int base = 0; base < it.num_pages; base += 32) {
        const int ids = LoadPageIds(p, it, base, lane);
        const int n = min(32, it.num_pages - base);
        for (int j = 0; j < n; ++j) {
          const int page = __shfl_sync(0xffffffffu, ids, j);
          if (kAppends && append_row >= 0 && base + j == it.num_pages - 1) {
            StoreNewRow<C, kTma>(p, it, page, new_row, lane);
          }
          IssueStage<C, kTma>(p, s, ring, it, base + j, page, lane);
        }
      }
    } else {
      static_assert(kTma, "shapes other than the default use the TMA path");
      const int pps = p.pages_per_tile;  // pages of a tile: 1, 2 or 4
      const int per_stage = pps * C::kTilesPerStage;  // at most 16: a divisor of 32
      const int num_tiles = (it.num_pages + pps - 1) / pps;
      const int last_valid =
          ((it.num_pages - 1) % pps) * p.page_size + (it.last_len & kLastLenMask);
      for (int base = 0; base < it.num_pages; base += 32) {
        const int ids = LoadPageIds(p, it, base, lane);
        const int n = min(32, it.num_pages - base);
        for (int j = 0; j < n; j += per_stage) {
          int pages[4 * C::kTilesPerStage];
#pragma unroll
          for (int k = 0; k < 4 * C::kTilesPerStage; ++k) {
            pages[k] = __shfl_sync(0xffffffffu, ids, (j + k) & 31);
          }
          const int in_stage = min(per_stage, n - j);
          if (kAppends && append_row >= 0 && base + j + in_stage == it.num_pages) {
            StoreNewRow<C, kTma>(p, it, pages[in_stage - 1], new_row, lane);
          }
          IssueStagePages<C>(p, s, ring, it, (base + j) / pps, num_tiles, last_valid, pages,
                             in_stage, lane);
        }
      }
    }
  }
}

// The producer: this CTA's own part, then parts from the queue until it is empty, then the end.
// A part is taken from the queue once the previous one's last page is issued: the stages still
// hold up to kStages pages for the consumers while the counter, the part's first item and its
// first page ids make their trips.
template <class C, bool kTma, bool kAppends>
__device__ void Produce(const KernelParams& p, SharedStorage<C>& s, WorkItem head, int num_parts,
                        int lane) {
  const int num_ctas = static_cast<int>(gridDim.x);
  const bool queued = num_parts > num_ctas;
  Ring<C> ring;
  for (;;) {
    ProducePart<C, kTma, kAppends>(p, s, ring, head, lane);
    if (!queued) break;
    int next = 0;
    if (lane == 0) next = num_ctas + atomicAdd(p.queue, 1);
    next = __shfl_sync(0xffffffffu, next, 0);
    if (next >= num_parts) {
      // The queue is empty for this CTA. The last CTA to find it so resets both counters for
      // the next launch: by then every CTA has made its last draw.
      if (lane == 0) {
        __threadfence();
        if (atomicAdd(p.done, 1) == num_ctas - 1) {
          __threadfence();
          atomicExch(p.queue, 0);
          atomicExch(p.done, 0);
        }
      }
      break;
    }
    head = LoadItem(p.items + next);
  }
  ProduceTagOnly<C, kTma>(s, ring, kTagEnd, WorkItem{}, lane);
}

// ---------------------------------------------------------------------------------------------
// Consumers

// Zeroes the halves of a V fragment (ldmatrix .trans: tokens `token` and `token + 1`, the low and
// high 16-bit values) that lie at or past `valid`, so that whatever a last page holds past the
// sequence's last token (NaN included) cannot reach the output through P = 0.
__device__ __forceinline__ uint32_t MaskTokens(uint32_t frag, int token, int valid) {
  if (token >= valid) frag &= 0xffff0000u;
  if (token + 1 >= valid) frag &= 0x0000ffffu;
  return frag;
}

template <class C>
__device__ __forceinline__ void Mma(float& d0, float& d1, uint32_t a0, uint32_t a2, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (C::kF16Math) {
    ptx::MmaRows8F16(d0, d1, a0, a2, b0, b1);
  } else {
    ptx::MmaRows8(d0, d1, a0, a2, b0, b1);
  }
}

// The query fragments of rows g (lane / 4) for every k-step: for 16-bit pages, dims
// 16 ks + 2 quad (+1) and + 8; for fp8 pages (their K fragments read dims 4 quad .. 4 quad + 3
// of each 16 as k = 2 quad, 2 quad + 1, 2 quad + 8, 2 quad + 9), dims 16 ks + 4 quad (+1) and
// + 2 (+3), converted to fp16 where q is bf16. Rows past the group are zero.
template <class C>
__device__ __forceinline__ void LoadQuery(const KernelParams& p, uint32_t q_stage, int group,
                                          int lane, uint32_t (&qa)[C::kKSteps][2]) {
  const int g = lane >> 2;
  const int quad = lane & 3;
  if constexpr (!C::kFp8) {
    const uint32_t qrow = q_stage + g * C::kHeadDim * 2 + quad * 4;
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      qa[ks][0] = g < group ? ptx::LdsU32(qrow + ks * 32) : 0u;
      qa[ks][1] = g < group ? ptx::LdsU32(qrow + ks * 32 + 16) : 0u;
    }
  } else {
    const uint32_t qrow = q_stage + g * C::kHeadDim * 2 + quad * 8;
    const bool bf16 = p.io_fp16 == 0;
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      uint32_t w[2] = {0u, 0u};
      if (g < group) {
        w[0] = ptx::LdsU32(qrow + ks * 32);
        w[1] = ptx::LdsU32(qrow + ks * 32 + 4);
        if (bf16) {
#pragma unroll
          for (int i = 0; i < 2; ++i) w[i] = ptx::PackF16(Bf16Bits(w[i] & 0xffffu), Bf16Bits(w[i] >> 16));
        }
      }
      qa[ks][0] = w[0];
      qa[ks][1] = w[1];
    }
  }
}

// One warp's 16 tokens of kTiles (1 or 2) consecutive stages of an item, in one online-softmax
// update: scores, the new max, O rescaled once, O += P V. Two stages give the warp twice the
// independent loads and MMAs to overlap and halve the per-token cost of the softmax update.
// Every stage but the last is full; in the last, scores of tokens at or past `valid` are
// masked to -inf, and with mask_v their V fragments are zeroed too (the stage is a last page
// whose valid tokens end inside this warp's 16, and its V rows were not zeroed in shared
// memory). fp8 pages: o[2c] holds dims 16c + 2j and o[2c + 1] dims 16c + 2j + 1 (j the n-tile
// column), see Finalize.
template <class C, int kTiles>
__device__ __forceinline__ void ProcessTiles(const uint32_t (&base)[kTiles],
                                             const uint32_t (&qa)[C::kKSteps][2], int warp,
                                             int lane, int valid, bool mask_v, float scale_log2,
                                             float (&o)[C::kNTiles][2], float& m, float& l) {
  const int r = lane & 7;
  const int mi = lane >> 3;
  const int quad = lane & 3;
  const int t0 = warp * kTokensPerWarp;

  // S[group heads, 16 tokens] per stage: two n-tiles of 8 tokens, even and odd k-steps
  // accumulated apart.
  float acc[kTiles][4][2] = {};
  if constexpr (!C::kFp8) {
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      const int token = t0 + ((mi >> 1) << 3) + r;
      const int chunk = 2 * ks + (mi & 1);
      const int c = (ks & 1) * 2;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        uint32_t b[4];
        ptx::Ldsm4(base[t] + SwizzledOffset<C>(token, chunk), b);
        Mma<C>(acc[t][c][0], acc[t][c][1], qa[ks][0], qa[ks][1], b[0], b[1]);
        Mma<C>(acc[t][c + 1][0], acc[t][c + 1][1], qa[ks][0], qa[ks][1], b[2], b[3]);
      }
    }
  } else {
    // A 16-byte chunk of an fp8 row is one k-step: lane (g, quad) gets dims 4 quad..4 quad + 3
    // of token g, which are its k = 2 quad, 2 quad + 1 (b0) and 2 quad + 8, 2 quad + 9 (b1).
#pragma unroll
    for (int kp = 0; kp < C::kKSteps / 2; ++kp) {
      const int token = t0 + ((mi >> 1) << 3) + r;
      const int chunk = 2 * kp + (mi & 1);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        uint32_t b[4];
        ptx::Ldsm4(base[t] + SwizzledOffset<C>(token, chunk), b);
        // b[0]: tokens 0-7, k-step 2 kp; b[1]: tokens 0-7, 2 kp + 1; b[2], b[3]: tokens 8-15.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int ks = 2 * kp + (i & 1);
          const int c = (i & 1) * 2 + (i >> 1);
          Mma<C>(acc[t][c][0], acc[t][c][1], qa[ks][0], qa[ks][1], ptx::E4m3x2ToF16x2(b[i]),
                 ptx::E4m3x2ToF16x2(b[i] >> 16));
        }
      }
    }
  }
  float x[kTiles][2][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = t0 + 8 * j + 2 * quad + e;
        const float v = (acc[t][j][e] + acc[t][2 + j][e]) * scale_log2;
        x[t][j][e] = t + 1 < kTiles || token < valid ? v : -INFINITY;
      }
    }
  }
  float mx = -INFINITY;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    mx = fmaxf(mx, fmaxf(fmaxf(x[t][0][0], x[t][0][1]), fmaxf(x[t][1][0], x[t][1][1])));
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);  // finite: token t0 is valid and in every quad
  const float alpha = ptx::Exp2(m - m_new);
  float pr[kTiles][2][2];
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[t][j][e] = ptx::Exp2(x[t][j][e] - m_new);
    }
    sum += (pr[t][0][0] + pr[t][0][1]) + (pr[t][1][0] + pr[t][1][1]);
  }
  l = l * alpha + sum;
  m = m_new;
#pragma unroll
  for (int n = 0; n < C::kNTiles; ++n) {
    o[n][0] *= alpha;
    o[n][1] *= alpha;
  }
  uint32_t pa0[kTiles], pa2[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    pa0[t] = C::kF16Math ? ptx::PackF16(pr[t][0][0], pr[t][0][1]) : ptx::PackBf16(pr[t][0][0], pr[t][0][1]);
    pa2[t] = C::kF16Math ? ptx::PackF16(pr[t][1][0], pr[t][1][1]) : ptx::PackBf16(pr[t][1][0], pr[t][1][1]);
  }
  if constexpr (!C::kFp8) {
#pragma unroll
    for (int np = 0; np < C::kNTiles / 2; ++np) {
      const int token = t0 + ((mi & 1) << 3) + r;
      const int chunk = 2 * np + (mi >> 1);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        uint32_t b[4];
        ptx::Ldsm4Trans(base[t] + C::kHalfBytes + SwizzledOffset<C>(token, chunk), b);
        if (t + 1 == kTiles && mask_v) {
          // Fragment k holds tokens t0 + 8 * (k & 1) + 2 * quad and the next one.
#pragma unroll
          for (int k = 0; k < 4; ++k) b[k] = MaskTokens(b[k], t0 + ((k & 1) << 3) + 2 * quad, valid);
        }
        Mma<C>(o[2 * np][0], o[2 * np][1], pa0[t], pa2[t], b[0], b[1]);
        Mma<C>(o[2 * np + 1][0], o[2 * np + 1][1], pa0[t], pa2[t], b[2], b[3]);
      }
    }
  } else {
    // Transposed 8x8 matrices of 16-bit pairs: lane (g, quad) gets V[2 quad][2g, 2g + 1] in
    // bytes 0, 1 and V[2 quad + 1][2g, 2g + 1] in bytes 2, 3 (tokens of the 8, dims of the 16).
    // Bytes 0, 2 are the even dim's B fragment, bytes 1, 3 the odd dim's.
#pragma unroll
    for (int cp = 0; cp < C::kKSteps / 2; ++cp) {
      const int token = t0 + ((mi & 1) << 3) + r;
      const int chunk = 2 * cp + (mi >> 1);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        uint32_t b[4];
        ptx::Ldsm4Trans(base[t] + C::kHalfBytes + SwizzledOffset<C>(token, chunk), b);
        // b[0]: tokens 0-7 and b[1]: tokens 8-15 of chunk 2 cp; b[2], b[3]: of chunk 2 cp + 1.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t lo = ptx::Prmt(b[2 * h], 0u, 0x3120u);
          const uint32_t hi = ptx::Prmt(b[2 * h + 1], 0u, 0x3120u);
          uint32_t even0 = ptx::E4m3x2ToF16x2(lo), even1 = ptx::E4m3x2ToF16x2(hi);
          uint32_t odd0 = ptx::E4m3x2ToF16x2(lo >> 16), odd1 = ptx::E4m3x2ToF16x2(hi >> 16);
          if (t + 1 == kTiles && mask_v) {
            even0 = MaskTokens(even0, t0 + 2 * quad, valid);
            odd0 = MaskTokens(odd0, t0 + 2 * quad, valid);
            even1 = MaskTokens(even1, t0 + 8 + 2 * quad, valid);
            odd1 = MaskTokens(odd1, t0 + 8 + 2 * quad, valid);
          }
          const int c = 2 * cp + h;  // the 16-dim chunk
          Mma<C>(o[2 * c][0], o[2 * c][1], pa0[t], pa2[t], even0, even1);
          Mma<C>(o[2 * c + 1][0], o[2 * c + 1][1], pa0[t], pa2[t], odd0, odd1);
        }
      }
    }
  }
}

// Zeroes V rows [from, to) of a stage, so that whatever lies past the sequence's last token
// (NaN included) cannot reach the output through P = 0.
template <class C>
__device__ __forceinline__ void ZeroVRows(uint8_t* stage, int from, int to, int lane) {
  constexpr int kRowVecs = C::kRowBytes / 16;
  constexpr int kPerRow = kRowVecs * C::kBoxes;
  const int n = (to - from) * kPerRow;
  for (int idx = lane; idx < n; idx += 32) {
    const int row = from + idx / kPerRow;
    const int box = (idx / kRowVecs) % C::kBoxes;
    const int chunk = idx % kRowVecs;
    *reinterpret_cast<uint4*>(stage + C::kHalfBytes + box * C::kBoxBytes + row * C::kRowBytes +
                              chunk * 16) = make_uint4(0, 0, 0, 0);
  }
}

template <class C>
__device__ void WriteEmpty(const KernelParams& p, int64_t row0, int tid) {
  const int group = Group<C>(p);
#pragma unroll
  for (int g = 0; g < C::kMaxGroup; ++g) {
    if (g >= group) break;
#pragma unroll
    for (int i = 0; i < C::kDimsPerThread; ++i) {
      const int d = tid + i * kConsumerThreads;
      if (C::kHeadDim >= kConsumerThreads || d < C::kHeadDim) {
        p.output[(row0 + g) * C::kHeadDim + d] = 0;
      }
    }
  }
  if (tid < group) p.lse[row0 + tid] = -INFINITY;
}

// Combines the 4 consumer warps' (max, sum, unnormalised output) triples in scratch into the
// normalised output (dim d) and base-2 lse of the item's rows.
template <class C>
__device__ __forceinline__ void CombineWarps(const SharedStorage<C>& s, int d, int group,
                                             float (&out)[C::kMaxGroup],
                                             float (&lse)[C::kMaxGroup]) {
#pragma unroll
  for (int h = 0; h < C::kMaxGroup; ++h) {
    if (h >= group) break;
    float mx = s.scratch_m[0][h];
#pragma unroll
    for (int w = 1; w < kConsumerWarps; ++w) mx = fmaxf(mx, s.scratch_m[w][h]);
    float sum = 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float e = ptx::Exp2(s.scratch_m[w][h] - mx);
      sum += e * s.scratch_l[w][h];
      acc += e * s.scratch_o[w][h][d];
    }
    out[h] = acc / sum;
    lse[h] = mx + log2f(sum);
  }
}

// Writes dim d of rows row0.. of the output (the caller's type) and, for d == 0, their lse.
template <class C>
__device__ __forceinline__ void WriteRows(const KernelParams& p, int64_t row0, int d, int group,
                                          const float (&out)[C::kMaxGroup],
                                          const float (&lse)[C::kMaxGroup]) {
#pragma unroll
  for (int h = 0; h < C::kMaxGroup; ++h) {
    if (h >= group) break;
    p.output[(row0 + h) * C::kHeadDim + d] = ToIo<C>(p, out[h]);
  }
  if (d == 0) {
#pragma unroll
    for (int h = 0; h < C::kMaxGroup; ++h) {
      if (h >= group) break;
      p.lse[row0 + h] = lse[h];
    }
  }
}

// The end of an item by chunks of 4 dims of one row: chunk c of the item's group x head_dim
// outputs is row 4c / head_dim, dims 4c % head_dim onwards. A thread combines its chunks (the
// row's max, sum and weights once per chunk, the 4 warps' dims as float4s) before the barrier
// that frees the scratch and stores each chunk with one 8-byte (output) or 16-byte (partial)
// store after it; the thread holding dim 0 of a row writes the row's lse.
template <class C>
struct ItemChunks {
  static constexpr int kPerThread =
      (C::kMaxGroup * C::kHeadDim / 4 + kConsumerThreads - 1) / kConsumerThreads;
  float4 out[kPerThread];
  float lse[kPerThread];
};

// Where a thread's k-th chunk lies: its row h and first dim d; false past the item's chunks.
template <class C>
__device__ __forceinline__ bool ChunkAt(int tid, int k, int group, int& h, int& d) {
  const int c = tid + k * kConsumerThreads;
  if (c >= group * (C::kHeadDim / 4)) return false;
  h = c / (C::kHeadDim / 4);
  d = 4 * (c % (C::kHeadDim / 4));
  return true;
}

template <class C>
__device__ __forceinline__ void CombineChunks(const SharedStorage<C>& s, int tid, int group,
                                              ItemChunks<C>& r) {
#pragma unroll
  for (int k = 0; k < ItemChunks<C>::kPerThread; ++k) {
    int h, d;
    if (!ChunkAt<C>(tid, k, group, h, d)) break;
    float mw[kConsumerWarps];
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      mw[w] = s.scratch_m[w][h];
      mx = fmaxf(mx, mw[w]);
    }
    float sum = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float e = ptx::Exp2(mw[w] - mx);
      sum += e * s.scratch_l[w][h];
      const float4 o = *reinterpret_cast<const float4*>(&s.scratch_o[w][h][d]);
      acc.x += e * o.x;
      acc.y += e * o.y;
      acc.z += e * o.z;
      acc.w += e * o.w;
    }
    r.out[k] = make_float4(acc.x / sum, acc.y / sum, acc.z / sum, acc.w / sum);
    r.lse[k] = d == 0 ? mx + log2f(sum) : 0.0f;
  }
}

template <class C>
__device__ __forceinline__ void StoreChunks(const KernelParams& p, int64_t row0, int slot,
                                            int tid, int group, const ItemChunks<C>& r) {
#pragma unroll
  for (int k = 0; k < ItemChunks<C>::kPerThread; ++k) {
    int h, d;
    if (!ChunkAt<C>(tid, k, group, h, d)) break;
    const float4 v = r.out[k];
    if (slot < 0) {
      uint16_t* const dst = p.output + (row0 + h) * C::kHeadDim + d;
      const uint32_t lo = ToIo<C>(p, v.x) | (uint32_t{ToIo<C>(p, v.y)} << 16);
      const uint32_t hi = ToIo<C>(p, v.z) | (uint32_t{ToIo<C>(p, v.w)} << 16);
      if (p.output_vec) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      } else {
        dst[0] = static_cast<uint16_t>(lo);
        dst[1] = static_cast<uint16_t>(lo >> 16);
        dst[2] = static_cast<uint16_t>(hi);
        dst[3] = static_cast<uint16_t>(hi >> 16);
      }
      if (d == 0) p.lse[row0 + h] = r.lse[k];
    } else {
      *reinterpret_cast<float4*>(p.part_o + int64_t{slot} * C::kPartialFloats +
                                 h * C::kHeadDim + d) = v;
      if (d == 0) p.part_lse[slot * C::kMaxGroup + h] = r.lse[k];
    }
  }
}

// N consecutive floats of a partial output, loaded and kept together.
template <int N>
struct alignas(N >= 4 ? 16 : 8) Dims {
  float v[N];
};
template <int N>
__device__ __forceinline__ Dims<N> LoadDims(const float* src) {
  Dims<N> r;
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    if constexpr (N == 2) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(src));
      r.v[0] = x.x;
      r.v[1] = x.y;
    } else {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(src + i));
      r.v[i] = x.x;
      r.v[i + 1] = x.y;
      r.v[i + 2] = x.z;
      r.v[i + 3] = x.w;
    }
  }
  return r;
}
template <int N>
__device__ __forceinline__ void StoreDims(float* dst, const Dims<N>& x) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    if constexpr (N == 2) {
      *reinterpret_cast<float2*>(dst) = make_float2(x.v[0], x.v[1]);
    } else {
      *reinterpret_cast<float4*>(dst + i) = make_float4(x.v[i], x.v[i + 1], x.v[i + 2], x.v[i + 3]);
    }
  }
}

// Folds one piece (its base-2 lse and N dims of its normalised output) into a running online
// log-sum-exp merge (max m, sum l, unnormalised acc); padding (lse -inf) changes nothing.
template <int N>
__device__ __forceinline__ void FoldPiece(float lse, const Dims<N>& o, float& m, float& l,
                                          Dims<N>& acc) {
  const float m_new = fmaxf(m, lse);
  if (m_new == -INFINITY) return;  // only padding so far
  const float a = ptx::Exp2(m - m_new);
  const float b = ptx::Exp2(lse - m_new);
  l = l * a + b;
#pragma unroll
  for (int i = 0; i < N; ++i) acc.v[i] = acc.v[i] * a + b * o.v[i];
  m = m_new;
}

// The last CTA of a merge group combines its pieces' partial results by their log-sum-exp.
// Warp w takes pieces w, w+4, ...; lane holds dims N*lane..N*lane+N-1 (N = head_dim / 32) of
// every row and folds its pieces in with an online log-sum-exp (lse and output loads of
// kMergeRound pieces in flight at once); then the 4 warps combine through shared memory like
// the end of an item.
template <class C>
__device__ void Merge(const KernelParams& p, SharedStorage<C>& s, MergeGroup grp, int64_t row0,
                      int warp, int lane) {
  constexpr int N = C::kDimsPerLane;
  const int group = Group<C>(p);
  const int sb = grp.slot_begin;
  const int n = grp.num_pieces;
  const float* part = p.part_o + int64_t{sb} * C::kPartialFloats + N * lane;
  const float* part_lse = p.part_lse + int64_t{sb} * C::kMaxGroup;
  float m[C::kMaxGroup], l[C::kMaxGroup];
  Dims<N> acc[C::kMaxGroup];
#pragma unroll
  for (int g = 0; g < C::kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) acc[g].v[i] = 0.0f;
  }
  constexpr int kMergeRound = C::kMergeRound;
  for (int q0 = warp; q0 < n; q0 += kMergeRound * kConsumerWarps) {
    Dims<N> o[kMergeRound][C::kMaxGroup];
    float ls[kMergeRound][C::kMaxGroup];
#pragma unroll
    for (int u = 0; u < kMergeRound; ++u) {
      const int q = q0 + u * kConsumerWarps;
#pragma unroll
      for (int g = 0; g < C::kMaxGroup; ++g) {
        if (q < n && g < group) {
          o[u][g] = LoadDims<N>(part + int64_t{q} * C::kPartialFloats + g * C::kHeadDim);
          ls[u][g] = __ldcg(part_lse + q * C::kMaxGroup + g);
        } else {
#pragma unroll
          for (int i = 0; i < N; ++i) o[u][g].v[i] = 0.0f;
          ls[u][g] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kMergeRound; ++u) {
#pragma unroll
      for (int g = 0; g < C::kMaxGroup; ++g) {
        FoldPiece<N>(ls[u][g], o[u][g], m[g], l[g], acc[g]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < C::kMaxGroup; ++g) {
    StoreDims<N>(&s.scratch_o[warp][g][N * lane], acc[g]);
    if (lane == 0) {
      s.scratch_m[warp][g] = m[g];
      s.scratch_l[warp][g] = l[g];
    }
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  const int tid = warp * 32 + lane;
#pragma unroll
  for (int i = 0; i < C::kDimsPerThread; ++i) {
    const int d = tid + i * kConsumerThreads;
    if (C::kHeadDim >= kConsumerThreads || d < C::kHeadDim) {
      float out[C::kMaxGroup], lse[C::kMaxGroup];
      CombineWarps(s, d, group, out, lse);
      WriteRows<C>(p, row0, d, group, out, lse);
    }
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);  // scratch free again
}

// End of an item: combine the 4 warps, then write the output or a partial result; the CTA that
// completes a merge group merges it.
template <class C>
__device__ void Finalize(const KernelParams& p, SharedStorage<C>& s, const StageTag& it,
                         int64_t row0, int warp, int lane, const float (&o)[C::kNTiles][2],
                         float m, float l, float v_scale) {
  const int g = lane >> 2;
  const int quad = lane & 3;
  const int tid = warp * 32 + lane;
  const int group = Group<C>(p);
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < group) {
    if constexpr (!C::kFp8) {
#pragma unroll
      for (int n = 0; n < C::kNTiles; ++n) {
        *reinterpret_cast<float2*>(&s.scratch_o[warp][g][8 * n + 2 * quad]) =
            make_float2(o[n][0], o[n][1]);
      }
    } else {
      // o[2c] holds dims 16c + 4 quad and + 2, o[2c + 1] dims 16c + 4 quad + 1 and + 3.
      const float vs = v_scale;
#pragma unroll
      for (int c = 0; c < C::kNTiles / 2; ++c) {
        *reinterpret_cast<float4*>(&s.scratch_o[warp][g][16 * c + 4 * quad]) =
            make_float4(o[2 * c][0] * vs, o[2 * c + 1][0] * vs, o[2 * c][1] * vs,
                        o[2 * c + 1][1] * vs);
      }
    }
    if (quad == 0) {
      s.scratch_m[warp][g] = m;
      s.scratch_l[warp][g] = l;
    }
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  if constexpr (C::kDimsPerThread > 1) {
    // Head dim 256: each thread's dims one at a time, written before the barrier that frees the
    // scratch (holding them all at once spills).
    float* po = it.slot < 0 ? nullptr : p.part_o + int64_t{it.slot} * C::kPartialFloats;
#pragma unroll
    for (int i = 0; i < C::kDimsPerThread; ++i) {
      const int d = tid + i * kConsumerThreads;
      float out[C::kMaxGroup], lse2[C::kMaxGroup];
      CombineWarps(s, d, group, out, lse2);
      if (po == nullptr) {
        WriteRows<C>(p, row0, d, group, out, lse2);
      } else {
#pragma unroll
        for (int h = 0; h < C::kMaxGroup; ++h) {
          if (h >= group) break;
          po[h * C::kHeadDim + d] = out[h];
        }
        if (d == 0) {
#pragma unroll
          for (int h = 0; h < C::kMaxGroup; ++h) {
            if (h >= group) break;
            p.part_lse[it.slot * C::kMaxGroup + h] = lse2[h];
          }
        }
      }
    }
    ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
    if (it.slot < 0) return;
  } else {
    ItemChunks<C> r;
    CombineChunks<C>(s, tid, group, r);
    ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
    StoreChunks<C>(p, row0, it.slot, tid, group, r);
    if (it.slot < 0) return;
  }
  if (p.merge_mode == kMergeAfterGrid) return;
  // The barrier orders every thread's partial stores before thread 0's release (cumulativity),
  // so one release publishes them all before the counter moves.
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  if (p.merge_mode == kMergeOnSignal) {
    if (tid == 0) ptx::RedAddRelease(&p.counters[it.group], 1);
    return;
  }
  if (tid == 0) {
    const int pieces = __ldg(&p.groups[it.group].num_pieces);
    __threadfence();
    const int prev = atomicAdd(&p.counters[it.group], 1);
    const int last = prev == pieces - 1;
    if (last) {
      __threadfence();           // acquire: the other pieces' stores are visible from here
      p.counters[it.group] = 0;  // every piece has arrived: ready for the next launch
    }
    s.is_last = last;
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  if (s.is_last) {
    if (p.timeline != nullptr && tid == 0) ++s.merges;
    const int2 grp = __ldg(reinterpret_cast<const int2*>(p.groups + it.group));
    Merge<C>(p, s, MergeGroup{grp.x, grp.y}, row0, warp, lane);
  }
}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Benchmarking only: stamp `slot` of this CTA's timeline with `t`. The timeline is
// [gridDim.x][kTimelineSlots] and then one more element, the latest exit of a MergeKernel CTA.
// Per CTA: %globaltimer at entry, first page landed, last page consumed, exit; then
// smid << 32 | items finished; in-kernel merges << 32 | pages consumed; nanoseconds the
// consumers spent finishing items (merges included); nanoseconds they waited for stages.
inline constexpr int kTimelineSlots = 8;
__device__ __forceinline__ void Stamp(const KernelParams& p, int tid, int slot,
                                      unsigned long long t) {
  if (p.timeline != nullptr && tid == 0) p.timeline[blockIdx.x * kTimelineSlots + slot] = t;
}
__device__ __forceinline__ unsigned long long StampTime(const KernelParams& p) {
  return p.timeline != nullptr ? GlobalTimer() : 0ull;
}

// One round of a consumer warp: the item's tile at `tile0` and, with `two`, its next one at
// `tile1`, in one softmax update. valid: the valid tokens of the round's later tile (all 64
// unless it is the item's last). The V rows past a last tile's valid tokens are zeroed first
// (in shared memory or in the fragments, Tuning::zero_tail_in_shared).
template <class C>
__device__ __forceinline__ void ConsumeTiles(const KernelParams& p, uint8_t* tile0,
                                             uint8_t* tile1, bool two, int valid,
                                             const uint32_t (&qa)[C::kKSteps][2], int warp,
                                             int lane, float scale_log2,
                                             float (&o)[C::kNTiles][2], float& m, float& l) {
  const int t0 = warp * kTokensPerWarp;
  const uint32_t base = ptx::SmemAddr(tile0);
  const bool tail = valid < t0 + kTokensPerWarp;
  const bool in_shared = tail && p.zero_tail_in_shared;
  if (in_shared && t0 < valid) {
    ZeroVRows<C>(two ? tile1 : tile0, valid, t0 + kTokensPerWarp, lane);
    __syncwarp();
  }
  if (two && t0 < valid) {
    const uint32_t bases[2] = {base, ptx::SmemAddr(tile1)};
    ProcessTiles<C, 2>(bases, qa, warp, lane, valid, tail && !in_shared, scale_log2, o, m, l);
  } else if (two || t0 < valid) {
    // A pair whose second tile has no valid token of this warp's 16: the first alone.
    const uint32_t bases[1] = {base};
    ProcessTiles<C, 1>(bases, qa, warp, lane, two ? kStageTokens : valid,
                       !two && tail && !in_shared, scale_log2, o, m, l);
  }
  if (in_shared && t0 < valid) ptx::FenceProxyAsync();
}

// The consumers follow the stages' tags until the end tag.
template <class C, bool kAppends>
__device__ void Consume(const KernelParams& p, SharedStorage<C>& s, int warp, int lane) {
  const int tid = warp * 32 + lane;
  int stage = 0;
  uint32_t phase = 0;
  bool first_page = true;
  unsigned long long last_page_time = 0;
  float o[C::kNTiles][2];
  float m = -INFINITY;
  float l = 0.0f;
  uint32_t qa[C::kKSteps][2];
  // The item's softmax scale in base 2 (fp8 pages: its layer's K scale folded in) and V scale.
  float scale_log2 = p.scale_log2;
  float v_scale = 1.0f;
  const bool timed = p.timeline != nullptr;
  unsigned long long items = 0, pages = 0, finish_ns = 0, wait_ns = 0;
  if (timed && tid == 0) s.merges = 0;
  for (;;) {
    const unsigned long long wait_from = timed ? GlobalTimer() : 0ull;
    ptx::MbarWait(ptx::SmemAddr(&s.full[stage]), phase);
    if (timed) wait_ns += GlobalTimer() - wait_from;
    const StageTag it = s.tag[stage];
    if (it.tile == kTagEnd) break;
    bool pair = false;         // this round takes the ring's next stage too
    int last_index = it.tile;  // the item's last tile this round takes
    const int64_t row0 = QueryRow<C>(p, it.seq_head);
    if (it.tile == kTagEmpty) {
      WriteEmpty<C>(p, row0, tid);
    } else {
      if (first_page) {
        Stamp(p, tid, 1, StampTime(p));
        first_page = false;
      }
      if (it.tile == 0) {
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n) o[n][0] = o[n][1] = 0.0f;
        m = -INFINITY;
        l = 0.0f;
        LoadQuery<C>(p, ptx::SmemAddr(s.q[stage]), Group<C>(p), lane, qa);
        if constexpr (C::kFp8) {
          scale_log2 = p.scale_log2 * it.k_scale;
          v_scale = it.v_scale;
        }
      }
      const int last = kAppends ? it.last_len & kLastLenMask : it.last_len;
      if constexpr (C::kTilesPerStage == 1) {
        // With pairs, the item's next tile is the ring's next stage whenever the item has one.
        pair = C::kPairs && it.tile + 1 < it.num_tiles;
        const int next = stage + 1 == C::kStages ? 0 : stage + 1;
        if (pair) ptx::MbarWait(ptx::SmemAddr(&s.full[next]), next == 0 ? phase ^ 1 : phase);
        last_index = pair ? it.tile + 1 : it.tile;
        pages += pair ? 2 : 1;
        const int valid = last_index == it.num_tiles - 1 ? last : kStageTokens;
        if (!p.skip_attention) {
          ConsumeTiles<C>(p, s.stage[stage], s.stage[next], pair, valid, qa, warp, lane,
                          scale_log2, o, m, l);
        }
      } else {
        const int tiles = min(C::kTilesPerStage, it.num_tiles - it.tile);
        last_index = it.tile + tiles - 1;
        pages += tiles;
        if (!p.skip_attention) {
#pragma unroll
          for (int t = 0; t < C::kTilesPerStage; t += 2) {
            if (t >= tiles) break;
            const bool two = t + 1 < tiles;
            const int later = it.tile + t + (two ? 1 : 0);
            const int valid = later == it.num_tiles - 1 ? last : kStageTokens;
            uint8_t* tile = s.stage[stage] + t * C::kStageBytes;
            ConsumeTiles<C>(p, tile, tile + C::kStageBytes, two, valid, qa, warp, lane,
                            scale_log2, o, m, l);
          }
        }
      }
    }
    __syncwarp();
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      if (lane == 0) ptx::MbarArrive(ptx::SmemAddr(&s.empty[stage]));
      if (++stage == C::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    if (it.tile >= 0 && last_index == it.num_tiles - 1) {
      last_page_time = StampTime(p);
      Finalize<C>(p, s, it, row0, warp, lane, o, m, l, v_scale);
      if (timed) {
        ++items;
        finish_ns += GlobalTimer() - last_page_time;
      }
    }
  }
  Stamp(p, tid, 2, last_page_time);
  Stamp(p, tid, 3, StampTime(p));
  if (timed) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    Stamp(p, tid, 4, (static_cast<unsigned long long>(smid) << 32) | items);
    Stamp(p, tid, 5, (static_cast<unsigned long long>(s.merges) << 32) | pages);
    Stamp(p, tid, 6, finish_ns);
    Stamp(p, tid, 7, wait_ns);
  }
}

// kAppends: the plan has appends (decode_plan.h), the producer writes them.
template <class C, bool kTma, bool kAppends>
__global__ void __launch_bounds__(kThreads, 1) PagedDecodeKernel(const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<C>& s = *reinterpret_cast<SharedStorage<C>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  ptx::LaunchDependents();  // MergeKernel's CTAs may take their place and wait for this grid
  const WorkItem head = p.first_from_params ? p.first[blockIdx.x] : LoadItem(p.items + blockIdx.x);
  const int num_parts = p.first_from_params ? p.num_parts : __ldg(&p.header->num_parts);
  // A CTA whose own part is empty has nothing to do unless the plan has a queue of parts (then
  // every CTA's own part has work, but it must take part in the queue's reset regardless).
  if (head.seq_head < 0 && num_parts <= static_cast<int>(gridDim.x)) return;
  Stamp(p, threadIdx.x, 0, StampTime(p));
  if (threadIdx.x == 0) {
    for (int i = 0; i < C::kStages; ++i) {
      ptx::MbarInit(ptx::SmemAddr(&s.full[i]), kTma ? kFullArrivalsTma : kFullArrivalsCpAsync);
      ptx::MbarInit(ptx::SmemAddr(&s.empty[i]), kConsumerWarps);
    }
    ptx::FenceBarrierInit();
  }
  if (kTma && warp == kConsumerWarps && lane == 0) {
    ptx::PrefetchTensorMap(&p.k_map);
    ptx::PrefetchTensorMap(&p.v_map);
  }
  __syncthreads();
  if (warp == kConsumerWarps) {
    Produce<C, kTma, kAppends>(p, s, head, num_parts, lane);
  } else {
    Consume<C, kAppends>(p, s, warp, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// The merge of split (seq, head)s as a kernel of its own, launched right after the decode
// kernel (programmatic dependent launch: its CTAs are resident and waiting while the decode
// grid runs). A unit is one query head of one merge group; a CTA takes units blockIdx.x,
// + gridDim.x, ...; warp w folds pieces w, w+4, ... (kMergeUnroll per round, loads in flight
// together), lane holds dims N*lane..N*lane+N-1 (N = head_dim / 32); the 4 warps combine
// through shared memory. It starts merging either once the decode grid is complete
// (griddepcontrol.wait), or, with on_signal, each group as soon as counters[group] shows all its
// pieces written (the merges then overlap the rest of the decode grid); then the last of a
// group's units resets its two counters for the next launch, and the kernel still waits for the
// decode grid before it ends, so that work after it on the stream may rely on every output.
inline constexpr int kMergeThreads = 128;
inline constexpr int kMergeUnroll = 12;

struct MergeParams {
  const PlanHeader* header;
  const MergeGroup* groups;
  const float* part_o;
  const float* part_lse;
  uint16_t* output;
  float* lse;
  int32_t* counters;  // on_signal: pieces written per group; zero between launches
  int32_t* merged;    // on_signal: units merged per group; zero between launches
  int32_t on_signal;
  unsigned long long* end_stamp;  // benchmarking only: the latest CTA exit (%globaltimer), or null
  // Shapes other than the default (as KernelParams).
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t group;
  int32_t io_fp16;
};

template <class C>
__global__ void __launch_bounds__(kMergeThreads) MergeKernel(const __grid_constant__ MergeParams p) {
  constexpr int N = C::kDimsPerLane;
  const int group = C::kFixed ? kGroupSize : p.group;
  const int num_kv_heads = C::kFixed ? kNumKvHeads : p.num_kv_heads;
  const int num_qo_heads = C::kFixed ? kNumQoHeads : p.num_qo_heads;
  __shared__ alignas(16) float s_o[kConsumerWarps][32 * N];
  __shared__ float s_m[kConsumerWarps];
  __shared__ float s_l[kConsumerWarps];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // The plan was copied before the decode kernel started: readable before the wait.
  const int num_units = __ldg(&p.header->num_groups) * group;
  int unit = blockIdx.x;
  int4 grp = unit < num_units ? __ldg(reinterpret_cast<const int4*>(p.groups + unit / group))
                              : make_int4(0, 0, 0, 0);
  if (!p.on_signal) ptx::WaitForPrerequisite();
  for (; unit < num_units; unit += gridDim.x) {
    const int g = unit / group;
    if (unit >= static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x)) {
      grp = __ldg(reinterpret_cast<const int4*>(p.groups + g));
    }
    if (p.on_signal) {
      // Thread 0 acquires the count; the barrier orders every thread's loads after it.
      if (threadIdx.x == 0) {
        while (ptx::LoadAcquire(p.counters + g) < grp.y) __nanosleep(64);
      }
      __syncthreads();
    }
    const int h = unit % group;
    const int sb = grp.x;
    const int n = grp.y;
    float m = -INFINITY;
    float l = 0.0f;
    Dims<N> acc;
#pragma unroll
    for (int i = 0; i < N; ++i) acc.v[i] = 0.0f;
    for (int q0 = warp; q0 < n; q0 += kMergeUnroll * kConsumerWarps) {
      Dims<N> o[kMergeUnroll];
      float ls[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const int q = q0 + u * kConsumerWarps;
        if (q < n) {
          const int64_t slot = int64_t{sb} + q;
          o[u] = LoadDims<N>(p.part_o + slot * C::kPartialFloats + h * C::kHeadDim + N * lane);
          ls[u] = __ldcg(p.part_lse + slot * C::kMaxGroup + h);
        } else {
#pragma unroll
          for (int i = 0; i < N; ++i) o[u].v[i] = 0.0f;
          ls[u] = -INFINITY;
        }
      }
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        FoldPiece<N>(ls[u], o[u], m, l, acc);
      }
    }
    StoreDims<N>(&s_o[warp][N * lane], acc);
    if (lane == 0) {
      s_m[warp] = m;
      s_l[warp] = l;
    }
    __syncthreads();
    float mx = s_m[0];
#pragma unroll
    for (int w = 1; w < kConsumerWarps; ++w) mx = fmaxf(mx, s_m[w]);
    const int seq = grp.z / num_kv_heads;
    const int kvh = grp.z % num_kv_heads;
    const int64_t row = int64_t{seq} * num_qo_heads + kvh * group + h;
#pragma unroll
    for (int i = 0; i < C::kDimsPerThread; ++i) {
      const int t = threadIdx.x + i * kMergeThreads;  // dim
      if (C::kHeadDim >= kMergeThreads || t < C::kHeadDim) {
        float sum = 0.0f;
        float out = 0.0f;
#pragma unroll
        for (int w = 0; w < kConsumerWarps; ++w) {
          const float e = ptx::Exp2(s_m[w] - mx);
          sum += e * s_l[w];
          out += e * s_o[w][t];
        }
        const bool fp16 = C::kPages == PageKind::kFp16 || (C::kFp8 && p.io_fp16 != 0);
        p.output[row * C::kHeadDim + t] = fp16 ? ToF16(out / sum) : ToBf16(out / sum);
        if (t == 0) p.lse[row] = mx + log2f(sum);
      }
    }
    __syncthreads();
    if (p.on_signal && threadIdx.x == 0 && atomicAdd(p.merged + g, 1) == group - 1) {
      p.counters[g] = 0;  // every unit of the group is past its wait
      p.merged[g] = 0;
    }
  }
  if (p.on_signal) ptx::WaitForPrerequisite();
  if (p.end_stamp != nullptr && threadIdx.x == 0) atomicMax(p.end_stamp, GlobalTimer());
}

}  // namespace pagedattn::kernels::detail

namespace pagedattn::kernels::detail {

using DecodeFn = void (*)(KernelParams);
using MergeFn = void (*)(MergeParams);

// The kernels of one Config and what their launches need.
struct KernelSet {
  DecodeFn decode[2][2] = {};  // [TMA][appends]; the cp.async path (TMA 0) only for kFixed
  MergeFn merge = nullptr;
  size_t smem_bytes = 0;
  int32_t partial_floats = 0;  // floats of one partial-output slot
  int32_t max_group = 0;       // query heads per slot (partial lse)
  int32_t box_dims = 0;        // dims of a TMA box
  int32_t row_bytes = 0;       // bytes of a box row: 128 (128-byte swizzle) or 64 (64-byte)
  int32_t stages = 0;
};

template <class C>
KernelSet MakeKernelSet() {
  KernelSet k;
  k.decode[1][0] = PagedDecodeKernel<C, true, false>;
  k.decode[1][1] = PagedDecodeKernel<C, true, true>;
  if constexpr (C::kFixed) {
    k.decode[0][0] = PagedDecodeKernel<C, false, false>;
    k.decode[0][1] = PagedDecodeKernel<C, false, true>;
  }
  k.merge = MergeKernel<C>;
  k.smem_bytes = kSmemBytes<C>;
  k.partial_floats = C::kPartialFloats;
  k.max_group = C::kMaxGroup;
  k.box_dims = C::kBoxDims;
  k.row_bytes = C::kRowBytes;
  k.stages = C::kStages;
  static_assert(kSmemBytes<C> <= kSmemLimit, "more shared memory than a Hopper block may opt in to");
  return k;
}

}  // namespace pagedattn::kernels::detail
