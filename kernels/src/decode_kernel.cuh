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
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "ptx.cuh"

namespace pagedattn::kernels::detail {

inline constexpr int kStages = 6;
inline constexpr int kConsumerWarps = 4;
inline constexpr int kConsumerThreads = kConsumerWarps * 32;
inline constexpr int kThreads = kConsumerThreads + 32;
inline constexpr int kTokensPerWarp = kPageSize / kConsumerWarps;  // 16
inline constexpr int kHalfBytes = kPageSize * 64 * 2;              // one TMA box: 64 tokens x 64 dims
inline constexpr int kStageBytes = 4 * kHalfBytes;                 // K lo, K hi, V lo, V hi
inline constexpr int kQBytes = kGroupSize * kHeadDim * 2;          // 6 query heads, bf16
inline constexpr int kPageBytes = static_cast<int>(kPageElems * 2);  // one page of K (or V)
inline constexpr int kPartialFloats = kGroupSize * kHeadDim;       // one slot of partial output
inline constexpr uint32_t kConsumerBarrier = 1;                    // named barrier of warps 0..3
inline constexpr int kMergeRound = 3;  // pieces per warp whose loads a merge round keeps in flight
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
  int32_t page;       // >= 0: page `page` of the item; else kTagEmpty or kTagEnd
  int32_t num_pages;  // the item's
  int32_t seq_head;
  int32_t last_len;
  int32_t slot;
  int32_t group;
  int32_t unused[2];
};

struct KernelParams {
  CUtensorMap k_map;  // k_cache as [pages][64 tokens][4 heads][128 dims] bf16, box 64x1x64x1
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
  unsigned long long* timeline;
  // The plan's header and each CTA's first item, copied into the launch parameters (when
  // first_from_params): a CTA starts with its page ids' load instead of a table load first.
  int32_t first_from_params;
  int32_t num_parts;
  WorkItem first[kMaxPlanCtas];  // benchmarking only: [ctas][4] %globaltimer stamps, or null
};

struct alignas(1024) SharedStorage {
  uint8_t stage[kStages][kStageBytes];  // 1024-aligned boxes (128-byte swizzle)
  uint8_t q[kStages][kQBytes];
  float scratch_o[kConsumerWarps][kGroupSize][kHeadDim];
  float scratch_m[kConsumerWarps][kGroupSize];
  float scratch_l[kConsumerWarps][kGroupSize];
  StageTag tag[kStages];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  int32_t is_last;
  uint32_t merges;  // benchmarking only (timeline): in-kernel merges done by this CTA
};
inline constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + alignment slack
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper block may opt in to");

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

// Offset of 16-byte chunk `chunk` (0..15 over 128 dims) of token row `token` within a K or V
// half of a stage: TMA's 128-byte swizzle XORs the chunk index with the row index mod 8.
__device__ __forceinline__ uint32_t SwizzledOffset(int token, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kHalfBytes + token * 128 +
                               (((chunk & 7) ^ (token & 7)) << 4));
}

// ---------------------------------------------------------------------------------------------
// Producer

// The producer's position in the ring.
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

__device__ __forceinline__ void WriteTag(SharedStorage& s, int stage, int32_t page,
                                         const WorkItem& it) {
  StageTag& t = s.tag[stage];
  t.page = page;
  t.num_pages = it.num_pages;
  t.seq_head = it.seq_head;
  t.last_len = it.last_len;
  t.slot = it.slot;
  t.group = it.group;
}

// A stage without data (kTagEmpty or kTagEnd): lane 0 waits for it, tags it and completes its
// full barrier with every arrival the barrier expects.
template <bool kTma>
__device__ void ProduceTagOnly(SharedStorage& s, Ring& ring, int32_t tag, const WorkItem& it,
                               int lane) {
  if (lane == 0) {
    ptx::MbarWait(ptx::SmemAddr(&s.empty[ring.stage]), ring.phase ^ 1);
    WriteTag(s, ring.stage, tag, it);
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

// Waits for a free stage, tags it and issues the copy of page `page` (id) of item `it` into it.
template <bool kTma>
__device__ __forceinline__ void IssueStage(const KernelParams& p, SharedStorage& s, Ring& ring,
                                           const WorkItem& it, int index, int page, int lane) {
  const int seq = it.seq_head / kNumKvHeads;
  const int kvh = it.seq_head % kNumKvHeads;
  const uint16_t* q_src = p.q + (int64_t{seq} * kNumQoHeads + kvh * kGroupSize) * int64_t{kHeadDim};
  const bool first = index == 0;
  const int stage = ring.stage;
  const uint32_t full = ptx::SmemAddr(&s.full[stage]);
  const uint32_t empty = ptx::SmemAddr(&s.empty[stage]);
  const uint32_t dst = ptx::SmemAddr(s.stage[stage]);
  if constexpr (kTma) {
    if (lane == 0) {
      ptx::MbarWait(empty, ring.phase ^ 1);
      WriteTag(s, stage, index, it);
      ptx::MbarArriveExpectTx(full, kStageBytes + (first ? kQBytes : 0));
      ptx::TmaLoad4d(dst, &p.k_map, 0, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + kHalfBytes, &p.k_map, 64, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + 2 * kHalfBytes, &p.v_map, 0, kvh, 0, page, full);
      ptx::TmaLoad4d(dst + 3 * kHalfBytes, &p.v_map, 64, kvh, 0, page, full);
      if (first) ptx::BulkLoad(ptx::SmemAddr(s.q[stage]), q_src, kQBytes, full);
    }
  } else {
    ptx::MbarWait(empty, ring.phase ^ 1);
    if (lane == 0) WriteTag(s, stage, index, it);
    const int64_t page_off = int64_t{page} * kPageBytes + kvh * kHeadDim * 2;
    const char* kp = reinterpret_cast<const char*>(p.k_cache) + page_off;
    const char* vp = reinterpret_cast<const char*>(p.v_cache) + page_off;
#pragma unroll 8
    for (int c = lane; c < kPageSize * 16; c += 32) {
      const int token = c >> 4;
      const int chunk = c & 15;
      const uint32_t off = SwizzledOffset(token, chunk);
      const int src = token * static_cast<int>(kTokenElems * 2) + chunk * 16;
      ptx::CpAsync16(dst + off, kp + src);
      ptx::CpAsync16(dst + 2 * kHalfBytes + off, vp + src);
    }
    if (first) {
      for (int c = lane; c < kQBytes / 16; c += 32) {
        ptx::CpAsync16(ptx::SmemAddr(s.q[stage]) + c * 16,
                       reinterpret_cast<const char*>(q_src) + c * 16);
      }
    }
    ptx::CpAsyncArriveNoinc(full);
    if (lane == 0) ptx::MbarArrive(full);  // releases the tag
  }
  ring.Advance();
}

// An appended token (decode_plan.h): lanes 0-15 hold 16 bytes each of the item's KV head's part
// of its K row, lanes 16-31 of its V row.
__device__ __forceinline__ uint4 LoadNewRow(const KernelParams& p, const WorkItem& it, int row,
                                            int lane) {
  const int kvh = it.seq_head % kNumKvHeads;
  const uint16_t* src = lane < 16 ? p.new_k : p.new_v;
  return __ldg(reinterpret_cast<const uint4*>(src + int64_t{row} * kTokenElems + kvh * kHeadDim) +
               (lane & 15));
}

// Stores the appended token into its place, the last valid token of page `page`, before that
// page's copy is issued: the stores, then a proxy fence in every lane and a warp barrier, so that
// the copy engine's read (TMA, the async proxy) or the lanes' cp.async see them.
template <bool kTma>
__device__ __forceinline__ void StoreNewRow(const KernelParams& p, const WorkItem& it, int page,
                                            const uint4& row, int lane) {
  const int kvh = it.seq_head % kNumKvHeads;
  const int token = (it.last_len & kLastLenMask) - 1;
  uint16_t* dst = (lane < 16 ? p.k_out : p.v_out) + int64_t{page} * kPageElems +
                  token * kTokenElems + kvh * kHeadDim;
  reinterpret_cast<uint4*>(dst)[lane & 15] = row;
  if constexpr (kTma) ptx::FenceProxyAsyncGlobal();
  __syncwarp();
}

// The items of one part (head and its rest), page by page; each item's page ids 32 at a time
// (a lane each), the next item's work item in flight meanwhile. (Loading the work items two
// ahead and each next chunk of page ids a chunk ahead measured no faster.)
template <bool kTma, bool kAppends>
__device__ void ProducePart(const KernelParams& p, SharedStorage& s, Ring& ring,
                            const WorkItem& head, int lane) {
  const int count = head.seq_head < 0 ? 0 : 1 + head.rest_count;
  WorkItem next = head;
  for (int i = 0; i < count; ++i) {
    const WorkItem it = next;
    if (i + 1 < count) next = LoadItem(p.items + head.rest_begin + i);  // in flight meanwhile
    if (it.num_pages == 0) {
      ProduceTagOnly<kTma>(s, ring, kTagEmpty, it, lane);
      continue;
    }
    // An item that ends a sequence the plan appends to loads the token's row now, while its page
    // ids make their trip, and stores it just before its last page is issued. (A plan without
    // appends runs the kernel built without this, which measured 0.1-1.1% faster.)
    const int append_row = kAppends ? (it.last_len >> kLastLenBits) - 1 : -1;
    uint4 new_row = make_uint4(0u, 0u, 0u, 0u);
    if (kAppends && append_row >= 0) new_row = LoadNewRow(p, it, append_row, lane);
    for (int base = 0; base < it.num_pages; base += 32) {
      const int ids = LoadPageIds(p, it, base, lane);
      const int n = min(32, it.num_pages - base);
      for (int j = 0; j < n; ++j) {
        const int page = __shfl_sync(0xffffffffu, ids, j);
        if (kAppends && append_row >= 0 && base + j == it.num_pages - 1) {
          StoreNewRow<kTma>(p, it, page, new_row, lane);
        }
        IssueStage<kTma>(p, s, ring, it, base + j, page, lane);
      }
    }
  }
}

// The producer: this CTA's own part, then parts from the queue until it is empty, then the end.
// A part is taken from the queue once the previous one's last page is issued: the stages still
// hold up to kStages pages for the consumers while the counter, the part's first item and its
// first page ids make their trips.
template <bool kTma, bool kAppends>
__device__ void Produce(const KernelParams& p, SharedStorage& s, WorkItem head, int num_parts,
                        int lane) {
  const int num_ctas = static_cast<int>(gridDim.x);
  const bool queued = num_parts > num_ctas;
  Ring ring;
  for (;;) {
    ProducePart<kTma, kAppends>(p, s, ring, head, lane);
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
  ProduceTagOnly<kTma>(s, ring, kTagEnd, WorkItem{}, lane);
}

// ---------------------------------------------------------------------------------------------
// Consumers

// Zeroes the halves of a V fragment (ldmatrix .trans: tokens `token` and `token + 1`, the low and
// high bf16) that lie at or past `valid`, so that whatever a last page holds past the sequence's
// last token (NaN included) cannot reach the output through P = 0.
__device__ __forceinline__ uint32_t MaskTokens(uint32_t frag, int token, int valid) {
  if (token >= valid) frag &= 0xffff0000u;
  if (token + 1 >= valid) frag &= 0x0000ffffu;
  return frag;
}

// One warp's 16 tokens of one stage: scores, online softmax update, O += P V. Scores of tokens
// at or past `valid` are masked to -inf; mask_v: their V fragments are zeroed too (the stage is
// a last page whose valid tokens end inside this warp's 16, and its V rows were not zeroed in
// shared memory).
__device__ __forceinline__ void ProcessTile(uint32_t base, const uint32_t (&qa)[8][2], int warp,
                                            int lane, int valid, bool mask_v, float scale_log2,
                                            float (&o)[16][2], float& m, float& l) {
  const int r = lane & 7;
  const int mi = lane >> 3;
  const int quad = lane & 3;
  const int t0 = warp * kTokensPerWarp;

  // S[6 heads, 16 tokens]: two n-tiles of 8 tokens, even and odd k-steps accumulated apart.
  float acc[4][2] = {};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const int token = t0 + ((mi >> 1) << 3) + r;
    const int chunk = 2 * ks + (mi & 1);
    uint32_t b[4];
    ptx::Ldsm4(base + SwizzledOffset(token, chunk), b);
    const int c = (ks & 1) * 2;
    ptx::MmaRows8(acc[c][0], acc[c][1], qa[ks][0], qa[ks][1], b[0], b[1]);
    ptx::MmaRows8(acc[c + 1][0], acc[c + 1][1], qa[ks][0], qa[ks][1], b[2], b[3]);
  }
  float x[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int token = t0 + 8 * j + 2 * quad + e;
      const float v = (acc[j][e] + acc[2 + j][e]) * scale_log2;
      x[j][e] = token < valid ? v : -INFINITY;
    }
  }
  float mx = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);  // finite: token t0 is valid and in every quad
  const float alpha = ptx::Exp2(m - m_new);
  float pr[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) pr[j][e] = ptx::Exp2(x[j][e] - m_new);
  }
  l = l * alpha + ((pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]));
  m = m_new;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    o[n][0] *= alpha;
    o[n][1] *= alpha;
  }
  const uint32_t pa0 = ptx::PackBf16(pr[0][0], pr[0][1]);
  const uint32_t pa2 = ptx::PackBf16(pr[1][0], pr[1][1]);
  const uint32_t vbase = base + 2 * kHalfBytes;
#pragma unroll
  for (int np = 0; np < 8; ++np) {
    const int token = t0 + ((mi & 1) << 3) + r;
    const int chunk = 2 * np + (mi >> 1);
    uint32_t b[4];
    ptx::Ldsm4Trans(vbase + SwizzledOffset(token, chunk), b);
    if (mask_v) {
      // Fragment k holds tokens t0 + 8 * (k & 1) + 2 * quad and the next one.
#pragma unroll
      for (int k = 0; k < 4; ++k) b[k] = MaskTokens(b[k], t0 + ((k & 1) << 3) + 2 * quad, valid);
    }
    ptx::MmaRows8(o[2 * np][0], o[2 * np][1], pa0, pa2, b[0], b[1]);
    ptx::MmaRows8(o[2 * np + 1][0], o[2 * np + 1][1], pa0, pa2, b[2], b[3]);
  }
}

// Zeroes V rows [from, to) of a stage, so that whatever lies past the sequence's last token
// (NaN included) cannot reach the output through P = 0.
__device__ __forceinline__ void ZeroVRows(uint8_t* stage, int from, int to, int lane) {
  const int n = (to - from) * 16;
  for (int idx = lane; idx < n; idx += 32) {
    const int row = from + (idx >> 4);
    const int half = (idx >> 3) & 1;
    const int chunk = idx & 7;
    *reinterpret_cast<uint4*>(stage + 2 * kHalfBytes + half * kHalfBytes + row * 128 +
                              chunk * 16) = make_uint4(0, 0, 0, 0);
  }
}

__device__ void WriteEmpty(const KernelParams& p, int row0, int tid) {
#pragma unroll
  for (int g = 0; g < kGroupSize; ++g) p.output[int64_t{row0 + g} * kHeadDim + tid] = 0;
  if (tid < kGroupSize) p.lse[row0 + tid] = -INFINITY;
}

// Combines the 4 consumer warps' (max, sum, unnormalised output) triples in scratch into the
// normalised output and base-2 lse of the item's 6 rows: thread tid gets dim tid of each row.
__device__ __forceinline__ void CombineWarps(const SharedStorage& s, int tid,
                                             float (&out)[kGroupSize], float (&lse)[kGroupSize]) {
#pragma unroll
  for (int h = 0; h < kGroupSize; ++h) {
    float mx = s.scratch_m[0][h];
#pragma unroll
    for (int w = 1; w < kConsumerWarps; ++w) mx = fmaxf(mx, s.scratch_m[w][h]);
    float sum = 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float e = ptx::Exp2(s.scratch_m[w][h] - mx);
      sum += e * s.scratch_l[w][h];
      acc += e * s.scratch_o[w][h][tid];
    }
    out[h] = acc / sum;
    lse[h] = mx + log2f(sum);
  }
}

// Writes rows row0..row0+5 of the output (bf16) and lse; thread tid writes dim tid.
__device__ __forceinline__ void WriteRows(const KernelParams& p, int64_t row0, int tid,
                                          const float (&out)[kGroupSize],
                                          const float (&lse)[kGroupSize]) {
#pragma unroll
  for (int h = 0; h < kGroupSize; ++h) p.output[(row0 + h) * kHeadDim + tid] = ToBf16(out[h]);
  if (tid == 0) {
#pragma unroll
    for (int h = 0; h < kGroupSize; ++h) p.lse[row0 + h] = lse[h];
  }
}

// Folds one piece (its base-2 lse and 4 dims of its normalised output) into a running online
// log-sum-exp merge (max m, sum l, unnormalised acc); padding (lse -inf) changes nothing.
__device__ __forceinline__ void FoldPiece(float lse, const float4& o, float& m, float& l,
                                          float4& acc) {
  const float m_new = fmaxf(m, lse);
  if (m_new == -INFINITY) return;  // only padding so far
  const float a = ptx::Exp2(m - m_new);
  const float b = ptx::Exp2(lse - m_new);
  l = l * a + b;
  acc.x = acc.x * a + b * o.x;
  acc.y = acc.y * a + b * o.y;
  acc.z = acc.z * a + b * o.z;
  acc.w = acc.w * a + b * o.w;
  m = m_new;
}

// The last CTA of a merge group combines its pieces' partial results by their log-sum-exp.
// Warp w takes pieces w, w+4, ...; lane holds dims 4*lane..4*lane+3 of all 6 rows and folds its
// pieces in with an online log-sum-exp (lse and output loads of kMergeRound pieces in flight at
// once); then the 4 warps combine through shared memory like the end of an item.
__device__ void Merge(const KernelParams& p, SharedStorage& s, MergeGroup grp, int64_t row0,
                      int warp, int lane) {
  const int sb = grp.slot_begin;
  const int n = grp.num_pieces;
  constexpr int kSlotVecs = kPartialFloats / 4;
  const float4* part = reinterpret_cast<const float4*>(p.part_o) + int64_t{sb} * kSlotVecs + lane;
  const float* part_lse = p.part_lse + int64_t{sb} * kGroupSize;
  float m[kGroupSize], l[kGroupSize];
  float4 acc[kGroupSize];
#pragma unroll
  for (int g = 0; g < kGroupSize; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    acc[g] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int q0 = warp; q0 < n; q0 += kMergeRound * kConsumerWarps) {
    float4 o[kMergeRound][kGroupSize];
    float ls[kMergeRound][kGroupSize];
#pragma unroll
    for (int u = 0; u < kMergeRound; ++u) {
      const int q = q0 + u * kConsumerWarps;
#pragma unroll
      for (int g = 0; g < kGroupSize; ++g) {
        if (q < n) {
          o[u][g] = __ldcg(part + int64_t{q} * kSlotVecs + g * 32);
          ls[u][g] = __ldcg(part_lse + q * kGroupSize + g);
        } else {
          o[u][g] = make_float4(0.f, 0.f, 0.f, 0.f);
          ls[u][g] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kMergeRound; ++u) {
#pragma unroll
      for (int g = 0; g < kGroupSize; ++g) {
        FoldPiece(ls[u][g], o[u][g], m[g], l[g], acc[g]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kGroupSize; ++g) {
    *reinterpret_cast<float4*>(&s.scratch_o[warp][g][4 * lane]) = acc[g];
    if (lane == 0) {
      s.scratch_m[warp][g] = m[g];
      s.scratch_l[warp][g] = l[g];
    }
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  const int tid = warp * 32 + lane;
  float out[kGroupSize], lse[kGroupSize];
  CombineWarps(s, tid, out, lse);
  WriteRows(p, row0, tid, out, lse);
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);  // scratch free again
}

// End of an item: combine the 4 warps, then write the output or a partial result; the CTA that
// completes a merge group merges it.
__device__ void Finalize(const KernelParams& p, SharedStorage& s, const StageTag& it,
                         int64_t row0, int warp, int lane, const float (&o)[16][2], float m,
                         float l) {
  const int g = lane >> 2;
  const int quad = lane & 3;
  const int tid = warp * 32 + lane;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < kGroupSize) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      *reinterpret_cast<float2*>(&s.scratch_o[warp][g][8 * n + 2 * quad]) =
          make_float2(o[n][0], o[n][1]);
    }
    if (quad == 0) {
      s.scratch_m[warp][g] = m;
      s.scratch_l[warp][g] = l;
    }
  }
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  float out[kGroupSize];
  float lse2[kGroupSize];
  CombineWarps(s, tid, out, lse2);
  ptx::NamedBarrierSync(kConsumerBarrier, kConsumerThreads);
  if (it.slot < 0) {
    WriteRows(p, row0, tid, out, lse2);
    return;
  }
  float* po = p.part_o + int64_t{it.slot} * kPartialFloats;
#pragma unroll
  for (int h = 0; h < kGroupSize; ++h) po[h * kHeadDim + tid] = out[h];
  if (tid == 0) {
#pragma unroll
    for (int h = 0; h < kGroupSize; ++h) p.part_lse[it.slot * kGroupSize + h] = lse2[h];
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
    Merge(p, s, MergeGroup{grp.x, grp.y}, row0, warp, lane);
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

// The consumers follow the stages' tags until the end tag.
template <bool kAppends>
__device__ void Consume(const KernelParams& p, SharedStorage& s, int warp, int lane) {
  const int g = lane >> 2;
  const int quad = lane & 3;
  const int tid = warp * 32 + lane;
  const int t0 = warp * kTokensPerWarp;
  int stage = 0;
  uint32_t phase = 0;
  bool first_page = true;
  unsigned long long last_page_time = 0;
  float o[16][2];
  float m = -INFINITY;
  float l = 0.0f;
  uint32_t qa[8][2];
  const bool timed = p.timeline != nullptr;
  unsigned long long items = 0, pages = 0, finish_ns = 0, wait_ns = 0;
  if (timed && tid == 0) s.merges = 0;
  for (;;) {
    const unsigned long long wait_from = timed ? GlobalTimer() : 0ull;
    ptx::MbarWait(ptx::SmemAddr(&s.full[stage]), phase);
    if (timed) wait_ns += GlobalTimer() - wait_from;
    const StageTag it = s.tag[stage];
    if (it.page == kTagEnd) break;
    const int seq = it.seq_head / kNumKvHeads;
    const int kvh = it.seq_head % kNumKvHeads;
    const int64_t row0 = int64_t{seq} * kNumQoHeads + kvh * kGroupSize;
    if (it.page == kTagEmpty) {
      WriteEmpty(p, static_cast<int>(row0), tid);
    } else {
      if (first_page) {
        Stamp(p, tid, 1, StampTime(p));
        first_page = false;
      }
      ++pages;
      if (it.page == 0) {
#pragma unroll
        for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = 0.0f;
        m = -INFINITY;
        l = 0.0f;
        const uint32_t qrow = ptx::SmemAddr(s.q[stage]) + g * kHeadDim * 2 + quad * 4;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          qa[ks][0] = g < kGroupSize ? ptx::LdsU32(qrow + ks * 32) : 0u;
          qa[ks][1] = g < kGroupSize ? ptx::LdsU32(qrow + ks * 32 + 16) : 0u;
        }
      }
      const int last = kAppends ? it.last_len & kLastLenMask : it.last_len;
      const int valid = it.page == it.num_pages - 1 ? last : kPageSize;
      if (t0 < valid && !p.skip_attention) {
        const bool tail = valid < t0 + kTokensPerWarp;
        const bool in_shared = tail && p.zero_tail_in_shared;
        if (in_shared) {
          ZeroVRows(s.stage[stage], valid, t0 + kTokensPerWarp, lane);
          __syncwarp();
        }
        ProcessTile(ptx::SmemAddr(s.stage[stage]), qa, warp, lane, valid, tail && !in_shared,
                    p.scale_log2, o, m, l);
        if (in_shared) ptx::FenceProxyAsync();
      }
    }
    __syncwarp();
    if (lane == 0) ptx::MbarArrive(ptx::SmemAddr(&s.empty[stage]));
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
    if (it.page >= 0 && it.page == it.num_pages - 1) {
      last_page_time = StampTime(p);
      Finalize(p, s, it, row0, warp, lane, o, m, l);
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
template <bool kTma, bool kAppends>
__global__ void __launch_bounds__(kThreads, 1) PagedDecodeKernel(const __grid_constant__ KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(
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
    for (int i = 0; i < kStages; ++i) {
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
    Produce<kTma, kAppends>(p, s, head, num_parts, lane);
  } else {
    Consume<kAppends>(p, s, warp, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// The merge of split (seq, head)s as a kernel of its own, launched right after the decode
// kernel (programmatic dependent launch: its CTAs are resident and waiting while the decode
// grid runs). A unit is one query head of one merge group; a CTA takes units blockIdx.x,
// + gridDim.x, ...; warp w folds pieces w, w+4, ... (kMergeUnroll per round, loads in flight
// together), lane holds dims 4*lane..4*lane+3; the 4 warps combine through shared memory.
// It starts merging either once the decode grid is complete (griddepcontrol.wait), or, with
// on_signal, each group as soon as counters[group] shows all its pieces written (the merges
// then overlap the rest of the decode grid); then the last of a group's 6 units resets its two
// counters for the next launch, and the kernel still waits for the decode grid before it ends,
// so that work after it on the stream may rely on every output.
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
};

__global__ void __launch_bounds__(kMergeThreads) MergeKernel(const __grid_constant__ MergeParams p) {
  __shared__ float4 s_o[kConsumerWarps][32];
  __shared__ float s_m[kConsumerWarps];
  __shared__ float s_l[kConsumerWarps];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // The plan was copied before the decode kernel started: readable before the wait.
  const int num_units = __ldg(&p.header->num_groups) * kGroupSize;
  int unit = blockIdx.x;
  int4 grp = unit < num_units ? __ldg(reinterpret_cast<const int4*>(p.groups + unit / kGroupSize))
                              : make_int4(0, 0, 0, 0);
  if (!p.on_signal) ptx::WaitForPrerequisite();
  for (; unit < num_units; unit += gridDim.x) {
    const int g = unit / kGroupSize;
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
    const int h = unit % kGroupSize;
    const int sb = grp.x;
    const int n = grp.y;
    float m = -INFINITY;
    float l = 0.0f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q0 = warp; q0 < n; q0 += kMergeUnroll * kConsumerWarps) {
      float4 o[kMergeUnroll];
      float ls[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const int q = q0 + u * kConsumerWarps;
        if (q < n) {
          const int64_t slot = int64_t{sb} + q;
          o[u] = __ldcg(reinterpret_cast<const float4*>(p.part_o + (slot * kGroupSize + h) * kHeadDim) + lane);
          ls[u] = __ldcg(p.part_lse + slot * kGroupSize + h);
        } else {
          o[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          ls[u] = -INFINITY;
        }
      }
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        FoldPiece(ls[u], o[u], m, l, acc);
      }
    }
    s_o[warp][lane] = acc;
    if (lane == 0) {
      s_m[warp] = m;
      s_l[warp] = l;
    }
    __syncthreads();
    const int t = threadIdx.x;  // dim
    float mx = s_m[0];
#pragma unroll
    for (int w = 1; w < kConsumerWarps; ++w) mx = fmaxf(mx, s_m[w]);
    float sum = 0.0f;
    float out = 0.0f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float e = ptx::Exp2(s_m[w] - mx);
      sum += e * s_l[w];
      out += e * reinterpret_cast<const float*>(&s_o[w][0])[t];
    }
    const int seq = grp.z / kNumKvHeads;
    const int kvh = grp.z % kNumKvHeads;
    const int64_t row = int64_t{seq} * kNumQoHeads + kvh * kGroupSize + h;
    p.output[row * kHeadDim + t] = ToBf16(out / sum);
    if (t == 0) p.lse[row] = mx + log2f(sum);
    __syncthreads();
    if (p.on_signal && t == 0 && atomicAdd(p.merged + g, 1) == kGroupSize - 1) {
      p.counters[g] = 0;  // every unit of the group is past its wait
      p.merged[g] = 0;
    }
  }
  if (p.on_signal) ptx::WaitForPrerequisite();
  if (p.end_stamp != nullptr && threadIdx.x == 0) atomicMax(p.end_stamp, GlobalTimer());
}

}  // namespace pagedattn::kernels::detail
