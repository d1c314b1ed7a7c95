#include "server/backend/cuda_staging.h"

#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {
namespace {

namespace k = kernels;

StagingCapacity Cap(int32_t seqs, int64_t copies, int64_t tokens, int64_t indices) {
  StagingCapacity c;
  c.max_sequences = seqs;
  c.max_page_copies = copies;
  c.max_tokens = tokens;
  c.max_kv_indices = indices;
  return c;
}

std::vector<int32_t> Indptr(const std::vector<int32_t>& pages) {
  std::vector<int32_t> indptr{0};
  for (int32_t p : pages) indptr.push_back(indptr.back() + p);
  return indptr;
}

// Every copy, token and sequence in exactly one round, in order, and phases never go back.
void ExpectCoversInPhaseOrder(const std::vector<Round>& rounds, int64_t copies, int64_t tokens,
                              int32_t seqs) {
  int64_t c = 0, t = 0;
  int32_t s = 0;
  for (const Round& r : rounds) {
    EXPECT_EQ(r.copy_begin, c);
    EXPECT_EQ(r.token_begin, t);
    EXPECT_EQ(r.seq_begin, s);
    EXPECT_TRUE(r.num_copies() > 0 || r.num_tokens() > 0 || r.num_sequences() > 0);
    if (r.num_tokens() > 0) {
      EXPECT_EQ(r.copy_end, copies) << "writes before every copy is done";
    }
    if (r.num_sequences() > 0) {
      EXPECT_EQ(r.copy_end, copies);
      EXPECT_EQ(r.token_end, tokens) << "attention before every write is done";
    }
    c = r.copy_end;
    t = r.token_end;
    s = r.seq_end;
  }
  EXPECT_EQ(c, copies);
  EXPECT_EQ(t, tokens);
  EXPECT_EQ(s, seqs);
}

TEST(StagingCapacityTest, FollowsThePoolShape) {
  const StagingCapacity c =
      StagingCapacity::For({.num_layers = 2, .num_pages = 1000, .max_batch_size = 64}, 8192);
  EXPECT_EQ(c.max_sequences, 64);
  EXPECT_EQ(c.max_page_copies, 64);
  EXPECT_EQ(c.max_tokens, 8192);
  EXPECT_EQ(c.max_kv_indices, 2000);  // min(64 sequences, 2 layers) x 1000 pages
}

TEST(StagingCapacityTest, ADecodeStepAlwaysFitsOneRound) {
  const StagingCapacity c =
      StagingCapacity::For({.num_layers = 80, .num_pages = 100, .max_batch_size = 512}, 16);
  EXPECT_EQ(c.max_tokens, 512);          // raised to max_batch_size
  EXPECT_EQ(c.max_kv_indices, 80 * 100); // bounded by the layers, not the batch
  EXPECT_GE(c.max_kv_indices, 100);      // one sequence of every page fits
}

TEST(StagingCapacityTest, ArenaHoldsAnyRoundWithinCapacity) {
  const StagingCapacity c = Cap(64, 64, 8192, 4096);
  const RoundLayout full = LayoutRound(k::Shape{}, 64, 4096, 64, 8192);
  EXPECT_EQ(c.ArenaBytes(), full.bytes);
  EXPECT_LE(LayoutRound(k::Shape{}, 1, 1, 1, 1).bytes, c.ArenaBytes());
  EXPECT_LE(LayoutRound(k::Shape{}, 64, 4096, 0, 0).bytes, c.ArenaBytes());
  EXPECT_EQ(c.OutputBytes(), 64 * (k::kQueryElems * 2 + k::kNumQoHeads * 4));
}

TEST(RoundLayoutTest, PartsAreAlignedAndDisjoint) {
  const RoundLayout l = LayoutRound(k::Shape{}, 3, 7, 5, 11);
  for (int64_t off : {l.q, l.indices, l.copies, l.slots, l.k_rows, l.v_rows}) {
    EXPECT_EQ(off % RoundLayout::kAlignment, 0);
  }
  // The rows back to back (one run for a batch of one request), then the tables.
  EXPECT_EQ(l.q, 0);
  EXPECT_EQ(l.k_rows, 3 * k::kQueryElems * 2);
  EXPECT_EQ(l.v_rows, l.k_rows + 11 * k::kTokenElems * 2);
  EXPECT_EQ(l.indices, l.v_rows + 11 * k::kTokenElems * 2);
  EXPECT_GE(l.copies, l.indices + 7 * 4);
  EXPECT_GE(l.slots, l.copies + 5 * 8);
  EXPECT_GE(l.plan, l.slots + 11 * 8);
  EXPECT_EQ(l.plan % RoundLayout::kAlignment, 0);
  EXPECT_EQ(l.bytes, l.plan);  // no plan tables asked for
  const RoundLayout with_plan = LayoutRound(k::Shape{}, 3, 7, 5, 11, 1000);
  EXPECT_EQ(with_plan.plan, l.plan);
  EXPECT_EQ(with_plan.bytes, l.plan + 1000);
}

TEST(RoundLayoutTest, EmptyPartsTakeNoSpace) {
  const RoundLayout l = LayoutRound(k::Shape{}, 2, 0, 0, 0);
  EXPECT_EQ(l.bytes, 2 * k::kQueryElems * 2);
  EXPECT_EQ(LayoutRound(k::Shape{}, 0, 0, 0, 0).bytes, 0);
}

TEST(OutputLayoutTest, LseFollowsTheOutputRows) {
  EXPECT_EQ(LseOffset(k::Shape{}, 3), 3 * 24 * 128 * 2);
  EXPECT_EQ(OutputBytes(k::Shape{}, 3), 3 * 24 * 128 * 2 + 3 * 24 * 4);
  EXPECT_EQ(LseOffset(k::Shape{}, 5) % 16, 0);
}

// Another model's shape sizes every part: Llama 3.1 8B in fp16 with fp8 pages (q 32 x 128 x 2
// bytes, rows 8 x 128 x 2 as callers send them, lse 32 x 4).
TEST(RoundLayoutTest, PartsFollowTheModelShape) {
  const k::Shape m{32, 8, 128, 16, k::DType::kFp16, k::DType::kFp8E4m3};
  const RoundLayout l = LayoutRound(m, 3, 7, 0, 5);
  EXPECT_EQ(l.k_rows - l.q, 3 * 8192);
  EXPECT_EQ(l.v_rows - l.k_rows, 5 * 2048);
  EXPECT_EQ(l.indices - l.v_rows, 5 * 2048);
  EXPECT_EQ(LseOffset(m, 3), 3 * 8192);
  EXPECT_EQ(OutputBytes(m, 3), 3 * 8192 + 3 * 128);
  const StagingCapacity c = StagingCapacity::For(
      {.num_layers = 2, .num_pages = 100, .max_batch_size = 4, .model = m}, 16);
  EXPECT_EQ(c.OutputBytes(), OutputBytes(m, 4));
  EXPECT_EQ(c.ArenaBytes(), LayoutRound(m, 4, 200, 4, 16).bytes);
}

TEST(SplitRoundsTest, EmptyBatchHasNoRounds) {
  std::vector<Round> rounds(3);
  ASSERT_TRUE(SplitRounds(Cap(8, 8, 8, 8), 0, 0, {0}, &rounds).ok());
  EXPECT_TRUE(rounds.empty());
}

TEST(SplitRoundsTest, ABatchWithinCapacityIsOneRound) {
  std::vector<Round> rounds;
  const std::vector<int32_t> indptr = Indptr({3, 0, 5});
  ASSERT_TRUE(SplitRounds(Cap(8, 4, 16, 8), 2, 16, indptr, &rounds).ok());
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].num_copies(), 2);
  EXPECT_EQ(rounds[0].num_tokens(), 16);
  EXPECT_EQ(rounds[0].num_sequences(), 3);
  ExpectCoversInPhaseOrder(rounds, 2, 16, 3);
}

TEST(SplitRoundsTest, LongWritesAreStagedInRoundsBeforeTheAttention) {
  std::vector<Round> rounds;
  const std::vector<int32_t> indptr = Indptr({2, 2});
  ASSERT_TRUE(SplitRounds(Cap(8, 4, 100, 8), 1, 250, indptr, &rounds).ok());
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_EQ(rounds[0].num_copies(), 1);
  EXPECT_EQ(rounds[0].num_tokens(), 100);
  EXPECT_EQ(rounds[0].num_sequences(), 0);
  EXPECT_EQ(rounds[1].num_tokens(), 100);
  EXPECT_EQ(rounds[2].num_tokens(), 50);
  EXPECT_EQ(rounds[2].num_sequences(), 2);  // the attention rides with the last writes
  ExpectCoversInPhaseOrder(rounds, 1, 250, 2);
}

TEST(SplitRoundsTest, ManyCopiesComeFirst) {
  std::vector<Round> rounds;
  ASSERT_TRUE(SplitRounds(Cap(8, 3, 100, 8), 7, 5, {0}, &rounds).ok());
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_EQ(rounds[0].num_tokens(), 0);
  EXPECT_EQ(rounds[1].num_tokens(), 0);
  EXPECT_EQ(rounds[2].num_copies(), 1);
  EXPECT_EQ(rounds[2].num_tokens(), 5);
  ExpectCoversInPhaseOrder(rounds, 7, 5, 0);
}

TEST(SplitRoundsTest, SharedPagesOverTheIndexCapacitySplitBySequence) {
  std::vector<Round> rounds;
  // Six forks of a 4-page sequence: 24 page ids, 10 per round.
  const std::vector<int32_t> indptr = Indptr({4, 4, 4, 4, 4, 4});
  ASSERT_TRUE(SplitRounds(Cap(8, 8, 8, 10), 0, 0, indptr, &rounds).ok());
  ASSERT_EQ(rounds.size(), 3u);
  for (const Round& r : rounds) {
    EXPECT_EQ(r.num_sequences(), 2);
    EXPECT_LE(indptr[r.seq_end] - indptr[r.seq_begin], 10);
  }
  ExpectCoversInPhaseOrder(rounds, 0, 0, 6);
}

TEST(SplitRoundsTest, EmptySequencesJoinARound) {
  std::vector<Round> rounds;
  const std::vector<int32_t> indptr = Indptr({0, 5, 0, 0, 5, 0});
  ASSERT_TRUE(SplitRounds(Cap(8, 8, 8, 5), 0, 0, indptr, &rounds).ok());
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[0].seq_end, 4);
  EXPECT_EQ(rounds[1].seq_end, 6);
  ExpectCoversInPhaseOrder(rounds, 0, 0, 6);
}

TEST(SplitRoundsTest, RefusesASequenceLargerThanTheCapacity) {
  std::vector<Round> rounds;
  EXPECT_EQ(SplitRounds(Cap(8, 8, 8, 4), 0, 0, Indptr({2, 5}), &rounds).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(SplitRounds(Cap(1, 8, 8, 8), 0, 0, Indptr({1, 1}), &rounds).code(),
            absl::StatusCode::kInternal);
}

// Rows whose every element encodes (token, element) so that a misplaced row is visible.
std::vector<uint16_t> Rows(int32_t n, uint16_t tag) {
  std::vector<uint16_t> rows(n * k::kTokenElems);
  for (int32_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < k::kTokenElems; ++e) {
      rows[t * k::kTokenElems + e] = static_cast<uint16_t>(tag + t * 7 + e % 5);
    }
  }
  return rows;
}

TEST(PackTokensTest, PacksWritesInOrderAcrossRounds) {
  const std::vector<uint16_t> k1 = Rows(3, 100), v1 = Rows(3, 200);
  const std::vector<uint16_t> k2 = Rows(4, 300), v2 = Rows(4, 400);
  BackendBatch batch;
  batch.write_slots = {50, 51, 52, 7, 8, 9, 10};
  batch.writes.push_back({k1.data(), v1.data(), 3, 0});
  batch.writes.push_back({nullptr, nullptr, 0, 3});  // an empty write is skipped
  batch.writes.push_back({k2.data(), v2.data(), 4, 3});
  ASSERT_EQ(WrittenTokens(batch), 7);

  TokenCursor cursor;
  std::vector<int64_t> slots;
  std::vector<uint16_t> kk, vv;
  for (int64_t chunk : {2, 4, 1}) {  // rounds of 2, 4 and 1 tokens
    std::vector<int64_t> s(chunk);
    std::vector<uint16_t> kr(chunk * k::kTokenElems), vr(chunk * k::kTokenElems);
    CopyList copies;
    PackTokens(k::Shape{}, batch, chunk, &cursor, s.data(), kr.data(), vr.data(), &copies);
    copies.Run(nullptr);
    slots.insert(slots.end(), s.begin(), s.end());
    kk.insert(kk.end(), kr.begin(), kr.end());
    vv.insert(vv.end(), vr.begin(), vr.end());
  }
  EXPECT_EQ(slots, batch.write_slots);
  std::vector<uint16_t> want_k = k1, want_v = v1;
  want_k.insert(want_k.end(), k2.begin(), k2.end());
  want_v.insert(want_v.end(), v2.begin(), v2.end());
  EXPECT_EQ(kk, want_k);
  EXPECT_EQ(vv, want_v);
  EXPECT_EQ(cursor.write, 3u);
}

TEST(PackTokensTest, WithoutRowBuffersPacksOnlyTheSlots) {
  const std::vector<uint16_t> k1 = Rows(3, 100), v1 = Rows(3, 200);
  BackendBatch batch;
  batch.write_slots = {50, 51, 52};
  batch.writes.push_back({k1.data(), v1.data(), 3, 0});
  TokenCursor cursor;
  std::vector<int64_t> s(3);
  CopyList copies;
  PackTokens(k::Shape{}, batch, 3, &cursor, s.data(), nullptr, nullptr, &copies);
  EXPECT_EQ(copies.bytes(), 3 * sizeof(int64_t));
  copies.Run(nullptr);
  EXPECT_EQ(s, batch.write_slots);
}

// A batch of decode steps: sequence s reads pages[s] (pool pages) with last[s] tokens in the
// last page (no pages: empty); `stepped` lists the sequences that wrote their last token, in
// plan order.
BackendBatch Steps(const std::vector<std::vector<int32_t>>& pages, const std::vector<int32_t>& last,
                   const std::vector<int32_t>& stepped) {
  BackendBatch batch;
  for (size_t s = 0; s < pages.size(); ++s) {
    batch.plan.kv_indices.insert(batch.plan.kv_indices.end(), pages[s].begin(), pages[s].end());
    batch.plan.kv_indptr.push_back(static_cast<int32_t>(batch.plan.kv_indices.size()));
    batch.plan.kv_last_page_len.push_back(pages[s].empty() ? 1 : last[s]);
  }
  for (int32_t s : stepped) {
    batch.writes.push_back({nullptr, nullptr, 1, static_cast<int64_t>(batch.write_slots.size())});
    batch.write_slots.push_back(int64_t{pages[s].back()} * 64 + last[s] - 1);
  }
  batch.sequences_distinct = true;
  return batch;
}

Round WholeBatch(const BackendBatch& batch) {
  Round r;
  r.token_end = static_cast<int64_t>(batch.write_slots.size());
  r.seq_end = batch.plan.batch_size();
  return r;
}

TEST(KernelAppendRowsTest, EachStepsTokenIsItsSequencesLastRow) {
  // Sequences 0, 2 and 4 step, 1 attends only, 3 is empty.
  const BackendBatch batch =
      Steps({{5, 9}, {7}, {30, 31, 32}, {}, {40}}, {17, 3, 64, 0, 1}, {0, 2, 4});
  std::vector<int32_t> rows;
  ASSERT_TRUE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, -1, 1, -1, 2}));
  // A round of sequences 2..4 and tokens 1..2: round-local rows.
  Round r;
  r.token_begin = 1;
  r.token_end = 3;
  r.seq_begin = 2;
  r.seq_end = 5;
  ASSERT_TRUE(KernelAppendRows(k::Shape{}, batch, r, &rows));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, -1, 1}));
}

// A sequence's last slot is its last page * page_size + last_len - 1 in the model's pages.
TEST(KernelAppendRowsTest, LastSlotsFollowThePageSize) {
  const k::Shape m{32, 8, 128, 16, k::DType::kBf16, k::DType::kFp8E4m3};
  BackendBatch batch;
  batch.plan.kv_indices = {5, 9, 7};
  batch.plan.kv_indptr = {0, 2, 3};
  batch.plan.kv_last_page_len = {11, 16};
  batch.write_slots = {9 * 16 + 10, 7 * 16 + 15};
  batch.writes = {{nullptr, nullptr, 1, 0}, {nullptr, nullptr, 1, 1}};
  batch.sequences_distinct = true;
  std::vector<int32_t> rows;
  ASSERT_TRUE(KernelAppendRows(m, batch, WholeBatch(batch), &rows));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1}));
  // The same slots read in pages of 64 are no sequence's last.
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
}

TEST(KernelAppendRowsTest, OtherWritesNeedTheScatter) {
  std::vector<int32_t> rows;
  // Not distinct (the engine's word).
  BackendBatch batch = Steps({{5, 9}, {7}}, {17, 3}, {0, 1});
  batch.sequences_distinct = false;
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  // A token that is no sequence's last (an append's), before and after the steps.
  batch = Steps({{5, 9}, {7}}, {17, 3}, {0, 1});
  batch.write_slots.push_back(int64_t{9} * 64 + 20);
  batch.writes.push_back({nullptr, nullptr, 1, 2});
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  batch = Steps({{5, 9}, {7}}, {17, 3}, {0, 1});
  batch.write_slots.insert(batch.write_slots.begin(), int64_t{9} * 64 + 15);
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  // Tokens in another order than their sequences.
  batch = Steps({{5, 9}, {7}}, {17, 3}, {1, 0});
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  // The slot before the last token.
  batch = Steps({{5, 9}}, {17}, {0});
  batch.write_slots[0] -= 1;
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
  // No tokens at all: nothing to append.
  batch = Steps({{5, 9}}, {17}, {});
  EXPECT_FALSE(KernelAppendRows(k::Shape{}, batch, WholeBatch(batch), &rows));
}

TEST(PackTokensTest, WithNoBuffersOnlyMovesTheCursor) {
  const std::vector<uint16_t> k1 = Rows(2, 100), v1 = Rows(2, 200);
  BackendBatch batch;
  batch.write_slots = {50, 51, 7};
  batch.writes.push_back({k1.data(), v1.data(), 2, 0});
  batch.writes.push_back({k1.data(), v1.data(), 1, 2});
  TokenCursor cursor;
  CopyList copies;
  PackTokens(k::Shape{}, batch, 3, &cursor, nullptr, nullptr, nullptr, &copies);
  EXPECT_EQ(copies.bytes(), 0u);
  EXPECT_EQ(cursor.write, 2u);
  EXPECT_EQ(cursor.offset, 0);
}

TEST(DeviceRunsTest, AddRunJoinsPiecesContiguousOnBothSides) {
  std::vector<char> host(1000);
  std::vector<DeviceRun> runs;
  AddRun(host.data(), 0, 100, &runs);
  AddRun(host.data() + 100, 100, 50, &runs);   // continues both: joined
  AddRun(host.data() + 150, 300, 50, &runs);   // host continues, buffer does not
  AddRun(host.data() + 400, 350, 10, &runs);   // buffer continues, host does not
  AddRun(host.data() + 410, 360, 0, &runs);    // empty: nothing
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].host, host.data());
  EXPECT_EQ(runs[0].offset, 0);
  EXPECT_EQ(runs[0].bytes, 150);
  EXPECT_EQ(runs[1].offset, 300);
  EXPECT_EQ(runs[2].host, host.data() + 400);
  EXPECT_EQ(runs[2].bytes, 10);
}

// A request's block laid out as the engine lays it out: q rows, K rows, V rows back to back.
TEST(DeviceRunsTest, ABatchOfOneRequestBlockIsOneRowRunAndOneOutputRun) {
  constexpr int32_t b = 3;
  constexpr int64_t q_bytes = k::kQueryElems * 2, row_bytes = k::kTokenElems * 2;
  std::vector<char> block(b * (2 * q_bytes + 2 * row_bytes) + b * k::kNumQoHeads * 4);
  char* const q = block.data();
  char* const kk = q + b * q_bytes;
  char* const vv = kk + b * row_bytes;
  char* const out = vv + b * row_bytes;
  char* const lse = out + b * q_bytes;
  BackendBatch batch;
  for (int32_t i = 0; i < b; ++i) {
    batch.q.push_back(reinterpret_cast<const uint16_t*>(q + i * q_bytes));
    batch.output.push_back(reinterpret_cast<uint16_t*>(out + i * q_bytes));
    batch.lse.push_back(reinterpret_cast<float*>(lse + i * k::kNumQoHeads * 4));
    batch.writes.push_back({reinterpret_cast<const uint16_t*>(kk + i * row_bytes),
                            reinterpret_cast<const uint16_t*>(vv + i * row_bytes), 1, i});
    batch.write_slots.push_back(64 * i);
    batch.plan.kv_indptr.push_back(i);
    batch.plan.kv_last_page_len.push_back(1);
    batch.plan.kv_indices.push_back(i);
  }
  batch.plan.kv_indptr.push_back(b);
  ASSERT_EQ(batch.plan.batch_size(), b);
  const RoundLayout l = LayoutRound(k::Shape{}, b, b, 0, b);
  std::vector<DeviceRun> runs;
  RowRuns(k::Shape{}, batch, 0, b, b, TokenCursor{}, l, &runs);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].host, q);
  EXPECT_EQ(runs[0].offset, 0);
  EXPECT_EQ(runs[0].bytes, l.indices);
  OutputRuns(k::Shape{}, batch, &runs);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].host, out);
  EXPECT_EQ(runs[0].offset, 0);
  EXPECT_EQ(runs[0].bytes, OutputBytes(k::Shape{}, b));
}

TEST(DeviceRunsTest, RowsOfSeveralSourcesAreOneRunPerSourcePiece) {
  // Two requests' rows in separate memory, and the second round of a split batch.
  const std::vector<uint16_t> q1(2 * k::kQueryElems), q2(1 * k::kQueryElems);
  const std::vector<uint16_t> k1 = Rows(2, 1), v1 = Rows(2, 2), k2 = Rows(1, 3), v2 = Rows(1, 4);
  BackendBatch batch;
  batch.q = {q1.data(), q1.data() + k::kQueryElems, q2.data()};
  batch.writes.push_back({k1.data(), v1.data(), 2, 0});
  batch.writes.push_back({k2.data(), v2.data(), 1, 2});
  const RoundLayout l = LayoutRound(k::Shape{}, 3, 0, 0, 3);
  std::vector<DeviceRun> runs;
  RowRuns(k::Shape{}, batch, 0, 3, 3, TokenCursor{}, l, &runs);
  // q: 2 runs; K: 2; V: 2.
  ASSERT_EQ(runs.size(), 6u);
  EXPECT_EQ(runs[0].bytes, 2 * k::kQueryElems * 2);
  EXPECT_EQ(runs[2].host, reinterpret_cast<const char*>(k1.data()));
  EXPECT_EQ(runs[2].offset, l.k_rows);
  EXPECT_EQ(runs[3].offset, l.k_rows + 2 * k::kTokenElems * 2);
  EXPECT_EQ(runs[4].host, reinterpret_cast<const char*>(v1.data()));
  EXPECT_EQ(runs[4].offset, l.v_rows);
  int64_t bytes = 0;
  for (const DeviceRun& r : runs) bytes += r.bytes;
  EXPECT_EQ(bytes, l.indices);
  // From a cursor inside the first write: one token of it, then the second write.
  const RoundLayout l2 = LayoutRound(k::Shape{}, 0, 0, 0, 2);
  RowRuns(k::Shape{}, batch, 3, 0, 2, TokenCursor{.write = 0, .offset = 1}, l2, &runs);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].host, reinterpret_cast<const char*>(k1.data() + k::kTokenElems));
  EXPECT_EQ(runs[1].host, reinterpret_cast<const char*>(k2.data()));
  EXPECT_EQ(runs[1].offset, l2.k_rows + k::kTokenElems * 2);
}

class ValidateBatchTest : public ::testing::Test {
 protected:
  ValidateBatchTest() {
    shape_ = {.num_layers = 2, .num_pages = 10, .max_batch_size = 4};
    batch_.plan.kv_indptr = {0, 2};
    batch_.plan.kv_indices = {3, 19};
    batch_.plan.kv_last_page_len = {5};
    batch_.q = {q_.data()};
    batch_.output = {out_.data()};
    batch_.lse = {lse_.data()};
    batch_.sm_scale = 0.1f;
    batch_.write_slots = {0, 2 * 10 * 64 - 1};
    batch_.writes.push_back({rows_.data(), rows_.data(), 2, 0});
    batch_.page_copies.push_back({0, 9});
  }
  Backend::PoolShape shape_;
  BackendBatch batch_;
  std::vector<uint16_t> q_ = std::vector<uint16_t>(k::kQueryElems);
  std::vector<uint16_t> out_ = std::vector<uint16_t>(k::kQueryElems);
  std::vector<float> lse_ = std::vector<float>(k::kNumQoHeads);
  std::vector<uint16_t> rows_ = std::vector<uint16_t>(2 * k::kTokenElems);
};

TEST_F(ValidateBatchTest, AcceptsAWellFormedBatch) {
  EXPECT_TRUE(ValidateBatch(batch_, shape_).ok());
}

TEST_F(ValidateBatchTest, RejectsAPoolPageOutOfRange) {
  batch_.plan.kv_indices[1] = 20;
  EXPECT_EQ(ValidateBatch(batch_, shape_).code(), absl::StatusCode::kInternal);
}

// The page check goes eight at a time, then one at a time: a bad page is found at every
// position of a longer list, on both sides of the range; the pages at the range's ends pass.
TEST_F(ValidateBatchTest, FindsABadPageAnywhereInALongList) {
  std::vector<int32_t> pages(37);
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = i % 2 == 0 ? 0 : 19;
  batch_.plan.kv_indices = pages;
  batch_.plan.kv_indptr = {0, static_cast<int32_t>(pages.size())};
  ASSERT_TRUE(ValidateBatch(batch_, shape_).ok());
  for (size_t at = 0; at < pages.size(); ++at) {
    for (int32_t bad : {20, -1, std::numeric_limits<int32_t>::min(),
                        std::numeric_limits<int32_t>::max()}) {
      batch_.plan.kv_indices = pages;
      batch_.plan.kv_indices[at] = bad;
      EXPECT_EQ(ValidateBatch(batch_, shape_).code(), absl::StatusCode::kInternal)
          << "page " << bad << " at " << at;
    }
  }
}

TEST_F(ValidateBatchTest, RejectsASlotOutOfRange) {
  batch_.write_slots[1] = 2 * 10 * 64;
  EXPECT_EQ(ValidateBatch(batch_, shape_).code(), absl::StatusCode::kInternal);
}

TEST_F(ValidateBatchTest, RejectsAPageCopyOutOfTheLayer) {
  batch_.page_copies[0].dst = 10;  // page ids of a copy are per layer
  EXPECT_EQ(ValidateBatch(batch_, shape_).code(), absl::StatusCode::kInternal);
}

TEST_F(ValidateBatchTest, RejectsAWriteBeyondItsSlots) {
  batch_.writes[0].num_tokens = 3;
  EXPECT_EQ(ValidateBatch(batch_, shape_).code(), absl::StatusCode::kInternal);
}

TEST_F(ValidateBatchTest, RejectsMalformedPlans) {
  BackendBatch bad = batch_;
  bad.plan.kv_last_page_len[0] = 65;
  EXPECT_EQ(ValidateBatch(bad, shape_).code(), absl::StatusCode::kInternal);
  bad = batch_;
  bad.plan.kv_indptr = {0, 1};
  EXPECT_EQ(ValidateBatch(bad, shape_).code(), absl::StatusCode::kInternal);
  bad = batch_;
  bad.output.clear();
  EXPECT_EQ(ValidateBatch(bad, shape_).code(), absl::StatusCode::kInternal);
  bad = batch_;
  bad.sm_scale = 0.0f;
  EXPECT_EQ(ValidateBatch(bad, shape_).code(), absl::StatusCode::kInternal);
}

TEST(PagesThatFitTest, DividesWhatIsLeftAfterTheFixedPart) {
  EXPECT_EQ(PagesThatFit(1000, 100, 9, 1), 100);
  EXPECT_EQ(PagesThatFit(1000, 1000, 9, 1), 0);
  EXPECT_EQ(PagesThatFit(100, 1000, 9, 1), 0);
  EXPECT_EQ(PagesThatFit(1000, 0, 0, 1), 0);
}

TEST(PagesThatFitTest, KeepsThePoolIndexInInt32) {
  constexpr int64_t kHuge = int64_t{1} << 50;
  EXPECT_EQ(PagesThatFit(kHuge, 0, 1, 1), std::numeric_limits<int32_t>::max());
  EXPECT_EQ(PagesThatFit(kHuge, 0, 1, 4), std::numeric_limits<int32_t>::max() / 4);
}

TEST(PagesThatFitTest, AnH200HoldsAboutAMillionPagesOfOneLayer) {
  // 0.9 of 140 GB, 128 KiB of K+V a page: about 0.96 million pages.
  const int64_t budget = static_cast<int64_t>(0.9 * 140e9);
  const int64_t pages = PagesThatFit(budget, int64_t{300} << 20, 2 * k::kPageElems * 2 + 8, 1);
  EXPECT_GT(pages, 900000);
  EXPECT_LT(pages, 1000000);
}

}  // namespace
}  // namespace pagedattn
