// The host cost of building one decode step: StepBuilder::Build for one Decode of B sequences
// of T committed tokens each (a step: each sequence appends a token), on the real sequence
// table and block allocator, with q/k/v/output/lse as views (tensors by reference, as over the
// local channel). The builder's part of the server's `prepare` stage.
//
//   pagedattn_step_builder_bench [--batch=64] [--tokens=4096] [--steps=2000] [--layers=1]
//                                [--flush_mib=0]
//
// --flush_mib: bytes written between builds, so that each build starts with cold caches (as in
// a server whose executor did other work, or whose CPU kernel streamed the pool, in between).
// Prints the mean, p50 and p90 of Build in microseconds over `steps` steps (each sequence grows
// by one token per step; the table is rebuilt every 256 steps so that contexts stay near T).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "server/engine/step_builder.h"
#include "server/engine/work_item.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "server/metrics/metrics.h"

namespace pagedattn {
namespace {

struct Args {
  int32_t batch = 64;
  int64_t tokens = 4096;
  int32_t steps = 2000;
  int32_t layers = 1;
  int64_t flush_mib = 0;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const char* s = argv[i];
    auto value = [s](const char* name, auto* out) {
      const size_t n = std::strlen(name);
      if (std::strncmp(s, name, n) != 0 || s[n] != '=') return false;
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(std::atoll(s + n + 1));
      return true;
    };
    if (!value("--batch", &a->batch) && !value("--tokens", &a->tokens) &&
        !value("--steps", &a->steps) && !value("--layers", &a->layers) &&
        !value("--flush_mib", &a->flush_mib)) {
      std::fprintf(stderr, "unknown flag %s\n", s);
      return false;
    }
  }
  return a->batch > 0 && a->tokens > 0 && a->steps > 0 && a->layers > 0 && a->flush_mib >= 0;
}

struct Fixture {
  std::unique_ptr<BlockAllocator> allocator;
  std::unique_ptr<SequenceTable> table;
};

Fixture MakeFixture(const Args& a, const kernels::Shape& model, int64_t num_pages) {
  Fixture f;
  f.allocator = *BlockAllocator::Create({.num_pages = num_pages});
  f.table = *SequenceTable::Create({.num_layers = a.layers, .page_size = model.page_size},
                                   f.allocator.get());
  std::vector<PageCopy> copies;
  for (int32_t i = 0; i < a.batch; ++i) {
    const uint64_t id = 1000 + 7 * static_cast<uint64_t>(i);
    (void)f.table->Add(id);
    for (int32_t l = 0; l < a.layers; ++l) {
      (void)f.table->ApplyStep(id, l, static_cast<int32_t>(a.tokens), &copies);
    }
  }
  return f;
}

int Main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) return 2;
  const kernels::Shape model{};
  constexpr int32_t kRebuildEvery = 256;
  const int64_t num_pages =
      int64_t{a.batch} * (kernels::PagesFor(a.tokens + kRebuildEvery, model.page_size) + 1);
  Metrics metrics;
  auto builder = *StepBuilder::Create(
      {.num_layers = a.layers, .num_pages = num_pages, .model = model}, &metrics);

  // Request memory, random normal bf16-sized bytes (the builder only takes pointers into it).
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random_bytes = [&](int64_t n) {
    std::string s(static_cast<size_t>(n), '\0');
    for (auto& c : s) c = static_cast<char>(normal(rng) * 40.0f);
    return s;
  };
  std::string q = random_bytes(a.batch * model.query_bytes());
  std::string kv = random_bytes(2 * a.batch * model.token_bytes());
  std::string out(static_cast<size_t>(a.batch * model.query_bytes()), '\0');
  std::string lse(static_cast<size_t>(a.batch * model.lse_bytes()), '\0');
  auto view = [](std::string& s, int64_t offset, int64_t bytes) {
    return Tensor::View(s.data() + offset, bytes, false, RegionLease());
  };

  std::vector<char> flush(static_cast<size_t>(a.flush_mib) << 20);
  Fixture f;
  InFlight in;
  std::vector<double> us;
  us.reserve(static_cast<size_t>(a.steps) * a.layers);
  const absl::Time now = absl::Now();
  for (int32_t step = 0; step < a.steps; ++step) {
    if (step % kRebuildEvery == 0) f = MakeFixture(a, model, num_pages);
    for (int32_t layer = 0; layer < a.layers; ++layer) {
      auto item = std::make_unique<WorkItem>();
      item->is_decode = true;
      item->decode_kv = true;
      item->num_sequences = a.batch;
      item->sm_scale = 0.088f;
      DecodeWork& w = item->decode;
      w.layer = layer;
      for (int32_t i = 0; i < a.batch; ++i) w.sequence_ids.push_back(1000 + 7 * uint64_t(i));
      w.q = view(q, 0, static_cast<int64_t>(q.size()));
      w.k = view(kv, 0, a.batch * model.token_bytes());
      w.v = view(kv, a.batch * model.token_bytes(), a.batch * model.token_bytes());
      w.output = view(out, 0, static_cast<int64_t>(out.size()));
      w.lse = view(lse, 0, static_cast<int64_t>(lse.size()));
      w.sm_scale = item->sm_scale;
      in.items.clear();
      in.items.push_back(std::move(item));
      for (size_t i = 0; i < flush.size(); i += 64) flush[i] = static_cast<char>(i + step);

      const auto begin = std::chrono::steady_clock::now();
      builder->Build({.now = now}, *f.table, *f.allocator, &in);
      const auto end = std::chrono::steady_clock::now();
      if (!in.items[0]->status.ok() || in.batch.plan.batch_size() != a.batch) {
        std::fprintf(stderr, "step %d failed: %s\n", step,
                     std::string(in.items[0]->status.message()).c_str());
        return 1;
      }
      us.push_back(std::chrono::duration<double, std::micro>(end - begin).count());
    }
  }
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double x : us) sum += x;
  std::printf("Build, B=%d x %lld tokens, %d layer(s), flush %lld MiB, %zu builds: "
              "mean %.2f us, p50 %.2f us, p90 %.2f us, min %.2f us\n",
              a.batch, static_cast<long long>(a.tokens), a.layers,
              static_cast<long long>(a.flush_mib), us.size(), sum / us.size(),
              us[us.size() / 2], us[us.size() * 9 / 10], us.front());
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) { return pagedattn::Main(argc, argv); }
