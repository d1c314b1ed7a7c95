// The engine's KV tiers on the CPU backend: the shared checks of tier_checks.h (the GPU suite
// runs them on the CUDA backend), and the sequence table's tier bookkeeping: links of shared
// pages across tiers, the lru plan, all-or-nothing failures.
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "tests/engine/tier_checks.h"

namespace pagedattn {
namespace {

std::unique_ptr<Backend> MakeCpu() {
  auto b = CpuBackend::Create({.num_threads = 2});
  EXPECT_TRUE(b.ok());
  return b.ok() ? std::unique_ptr<Backend>(std::move(*b)) : nullptr;
}

TEST(EngineTiersTest, OffloadThenRestoreGivesBitwiseEqualDecodes) {
  testing::CheckOffloadRestoreIsBitwise(MakeCpu);
}

TEST(EngineTiersTest, ExportThenImportGivesBitwiseEqualDecodes) {
  testing::CheckExportImportIsBitwise(MakeCpu);
}

TEST(EngineTiersTest, ExportIntoRegionAndImportFromSpansAreBitwise) {
  std::vector<char> host(4 << 20);
  testing::RegionMemory memory{host.data(), static_cast<int64_t>(host.size()), false,
                               [&](int64_t at, int64_t n) { return std::string(host.data() + at, n); },
                               [&](int64_t at, const std::string& b) { std::memcpy(host.data() + at, b.data(), b.size()); }};
  testing::CheckRegionExportImportIsBitwise(MakeCpu, memory);
}

TEST(EngineTiersTest, WholeSequenceMovesInOneRunPerLayer) {
  testing::CheckWholeSequenceMovesInOneRunPerLayer(MakeCpu);
}

TEST(EngineTiersTest, LruNeedsAHostTier) {
  auto e = Engine::Create({.num_pages = 8, .offload_lru = true}, MakeCpu(), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << e.status();
}

class SequenceTableTiersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = *BlockAllocator::Create({.num_pages = 8});
    host_ = *BlockAllocator::Create({.num_pages = 4});
    table_ = *SequenceTable::Create({.num_layers = 1}, device_.get(), host_.get());
  }
  void Grow(uint64_t id, int32_t tokens) {
    std::vector<PageCopy> copies;
    ASSERT_TRUE(table_->ApplyStep(id, 0, tokens, &copies).ok());
  }
  std::unique_ptr<BlockAllocator> device_, host_;
  std::unique_ptr<SequenceTable> table_;
};

TEST_F(SequenceTableTiersTest, SharedPagesKeepOneCopyPerTier) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 100);  // 2 pages
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  std::vector<SequenceTable::PageMove> moves;
  ASSERT_TRUE(table_->Offload(1, &moves).ok());
  EXPECT_EQ(moves.size(), 2u);
  EXPECT_EQ(device_->num_free(), 6);  // 2 still holds them
  EXPECT_EQ(host_->num_free(), 2);
  absl::flat_hash_set<int32_t> linked;
  table_->LinkedDevicePages(1, &linked);
  EXPECT_EQ(linked, absl::flat_hash_set<int32_t>({0, 1}));  // what 1's restore would share
  moves.clear();
  EXPECT_EQ(*table_->OffloadCost(2), 0);  // linked: no new copy
  ASSERT_TRUE(table_->Offload(2, &moves).ok());
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 8);
  EXPECT_EQ(host_->num_free(), 2);
  EXPECT_EQ(table_->num_offloaded(), 2);
  // Restoring 1 copies; 2 then shares the restored pages.
  ASSERT_TRUE(table_->Restore(1, &moves).ok());
  EXPECT_EQ(moves.size(), 2u);
  moves.clear();
  EXPECT_EQ(*table_->RestoreCost(2), 0);
  ASSERT_TRUE(table_->Restore(2, &moves).ok());
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 6);
  EXPECT_EQ(host_->num_free(), 4);
  ASSERT_TRUE(table_->Remove(1).ok());
  ASSERT_TRUE(table_->Remove(2).ok());
  EXPECT_EQ(device_->num_free(), 8);
}

TEST_F(SequenceTableTiersTest, AWriteEndsTheLinkOfItsPage) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 10);  // one partial page
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  std::vector<SequenceTable::PageMove> moves;
  ASSERT_TRUE(table_->Offload(2, &moves).ok());  // 1 keeps the page, linked to 2's host copy
  Grow(1, 5);  // 1 alone holds it now and writes past token 10: the host copy is stale for 1
  EXPECT_EQ(*table_->OffloadCost(1), 1);  // a copy of its own, not the stale link
  moves.clear();
  ASSERT_TRUE(table_->Offload(1, &moves).ok());
  EXPECT_EQ(moves.size(), 1u);
  EXPECT_EQ(host_->num_free(), 2);
}

TEST_F(SequenceTableTiersTest, FailuresChangeNothing) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 64 * 5);  // 5 pages, the host tier holds 4
  std::vector<SequenceTable::PageMove> moves;
  EXPECT_TRUE(absl::IsResourceExhausted(table_->Offload(1, &moves)));
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 3);
  EXPECT_EQ(host_->num_free(), 4);
  EXPECT_FALSE(table_->IsOffloaded(1));
  EXPECT_TRUE(absl::IsNotFound(table_->Offload(9, &moves)));
  // Mid-step.
  ASSERT_TRUE(table_->Add(2).ok());
  auto two_layers = *SequenceTable::Create({.num_layers = 2}, device_.get(), host_.get());
  ASSERT_TRUE(two_layers->Add(3).ok());
  std::vector<PageCopy> copies;
  ASSERT_TRUE(two_layers->ApplyStep(3, 0, 1, &copies).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(two_layers->Offload(3, &moves)));
  // The lru plan: too little room in both tiers.
  EXPECT_TRUE(absl::IsResourceExhausted(table_->PlanOffload(4, {}).status()));
}

TEST_F(SequenceTableTiersTest, LruPlanTakesTheLeastRecentlyUsedFirst) {
  for (uint64_t id : {1, 2, 3}) {
    ASSERT_TRUE(table_->Add(id).ok());
    Grow(id, 64);
  }
  table_->Touch(1);  // 2 is now the oldest
  auto plan = table_->PlanOffload(1, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({2}));
  plan = table_->PlanOffload(2, {3});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({2, 1}));
  // A page the batch still reads keeps its holder: 2 holds page 1 (ids are handed out in order).
  plan = table_->PlanOffload(1, {}, {1});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({3}));
}

// Random adds, steps, forks, releases, offloads and restores over a small pool and host tier,
// with page contents simulated (the copies each call asks for are made on the simulated
// memories): after every call, every committed token of every sequence is found where its pages
// say, in the tier it is in, and each tier's free pages plus its distinct held pages add up.
TEST(SequenceTableTiersRandomTest, EveryTokenStaysFindableAcrossTiers) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    auto device = *BlockAllocator::Create({.num_pages = 12});
    auto host = *BlockAllocator::Create({.num_pages = 10});
    auto table = *SequenceTable::Create({.num_layers = 1}, device.get(), host.get());
    std::map<int32_t, std::vector<int64_t>> device_mem, host_mem;  // page -> 64 slots
    auto slot = [](std::map<int32_t, std::vector<int64_t>>& mem, int32_t page) -> std::vector<int64_t>& {
      auto& p = mem[page];
      p.resize(64, -1);
      return p;
    };
    std::map<uint64_t, std::vector<int64_t>> tokens;  // the model: each sequence's tokens
    int64_t next_value = 0;
    for (int op = 0; op < 400; ++op) {
      const uint64_t id = rng() % 6;
      const bool live = tokens.contains(id);
      switch (rng() % 6) {
        case 0:
          if (table->Add(id).ok()) tokens[id] = {};
          break;
        case 1: {  // a step of 1..80 tokens, restoring first as the engine does
          if (!live) break;
          std::vector<SequenceTable::PageMove> moves;
          if (!table->Restore(id, &moves).ok()) break;
          for (const auto& m : moves) slot(device_mem, m.device) = slot(host_mem, m.host);
          const int32_t n = 1 + static_cast<int32_t>(rng() % 80);
          std::vector<PageCopy> copies;
          absl::StatusOr<SequenceTable::StepResult> r = table->ApplyStep(id, 0, n, &copies);
          if (!r.ok()) {
            ASSERT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
            break;
          }
          for (const PageCopy& c : copies) slot(device_mem, c.dst) = slot(device_mem, c.src);
          auto view = *table->Get(id);
          for (int64_t pos = r->first_position; pos < r->visible_tokens; ++pos) {
            slot(device_mem, view.pages[pos / 64])[pos % 64] = next_value;
            tokens[id].push_back(next_value++);
          }
          break;
        }
        case 2: {
          const uint64_t child = rng() % 6;
          if (table->Fork(id, child).ok()) tokens[child] = tokens[id];
          break;
        }
        case 3:
          if (table->Remove(id).ok()) tokens.erase(id);
          break;
        case 4: {
          std::vector<SequenceTable::PageMove> moves;
          if (table->Offload(id, &moves).ok()) {
            for (const auto& m : moves) slot(host_mem, m.host) = slot(device_mem, m.device);
          }
          break;
        }
        case 5: {
          std::vector<SequenceTable::PageMove> moves;
          if (table->Restore(id, &moves).ok()) {
            for (const auto& m : moves) slot(device_mem, m.device) = slot(host_mem, m.host);
          }
          break;
        }
      }
      std::set<int32_t> held_device, held_host;
      for (const auto& [sid, want] : tokens) {
        auto view = table->Get(sid);
        ASSERT_TRUE(view.ok());
        ASSERT_EQ(view->length, static_cast<int64_t>(want.size()));
        auto& mem = view->offloaded ? host_mem : device_mem;
        for (int64_t pos = 0; pos < view->length; ++pos) {
          ASSERT_EQ(slot(mem, view->pages[pos / 64])[pos % 64], want[pos])
              << "op " << op << " sequence " << sid << " token " << pos
              << (view->offloaded ? " (host)" : " (device)");
        }
        for (int32_t page : view->pages) (view->offloaded ? held_host : held_device).insert(page);
      }
      ASSERT_EQ(device->num_free() + static_cast<int64_t>(held_device.size()), 12) << "op " << op;
      ASSERT_EQ(host->num_free() + static_cast<int64_t>(held_host.size()), 10) << "op " << op;
    }
  }
}

}  // namespace
}  // namespace pagedattn
