// The host cost of BuildDecodePlan, which the CUDA backend runs on the launch path of every
// batch (in line when the batch's rows need no packing). A measurement, not a test:
//
//   pagedattn_plan_bench [--ctas=132] [--reps=20000]
//
// For each case (the service's default shape: 4 KV heads, pages of 64, one CTA per SM, the
// decoder's default capacity and item cost) prints the mean and p50 of one plan in
// nanoseconds, the p50 of a PlanMemo that reuses the plan (the next step's lengths, the same
// pages: what the decoder pays on most steps of one sequence set) and of one that misses
// (pages that change every time), and the plan's parts and items.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/kernels/decode_plan.h"

namespace {

namespace k = pagedattn::kernels;

struct Case {
  std::string name;
  std::vector<int32_t> pages;  // per sequence
  bool appends = false;        // every sequence's newest token written by the kernel
};

std::vector<int32_t> Uniform(int32_t batch, int32_t pages) {
  return std::vector<int32_t>(batch, pages);
}

std::vector<int32_t> Uneven(int32_t batch, int32_t lo, int32_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> v(batch);
  for (int32_t& p : v) p = d(rng);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int32_t ctas = 132;
  int32_t reps = 20000;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ctas=", 7) == 0) {
      ctas = std::atoi(argv[i] + 7);
    } else if (std::strncmp(argv[i], "--reps=", 7) == 0) {
      reps = std::atoi(argv[i] + 7);
    } else {
      std::fprintf(stderr, "usage: pagedattn_plan_bench [--ctas=132] [--reps=20000]\n");
      return 2;
    }
  }
  if (ctas < 1 || ctas > k::kMaxPlanCtas || reps < 1) return 2;

  const std::vector<Case> cases = {
      {"b1 x 8 pages", Uniform(1, 8), true},
      {"b1 x 1024 pages", Uniform(1, 1024), true},
      {"b8 x 65 pages", Uniform(8, 65), true},
      {"b64 x 65 pages", Uniform(64, 65), true},
      {"b64 x 65 pages, attend only", Uniform(64, 65), false},
      {"b64 x 1..256 pages", Uneven(64, 1, 256, 7), true},
      {"b512 x 1..8 pages", Uneven(512, 1, 8, 9), true},
  };
  k::PlanCapacity cap;
  cap.num_ctas = ctas;
  cap.max_batch_size = 512;
  cap.parts_per_cta = 1;
  cap.min_part_units = 8;
  cap.item_cost_units = 1;  // the decoder's default for this shape (32 KiB of K and V per page)
  std::vector<char> table(cap.TableBytes() + 64);
  void* aligned =
      reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(table.data()) + 31) & ~uintptr_t{31});

  std::printf("%-30s %10s %10s %10s %10s %6s %6s %7s\n", "case", "mean ns", "p50 ns",
              "memo hit", "memo miss", "parts", "items", "groups");
  for (const Case& c : cases) {
    const int32_t b = static_cast<int32_t>(c.pages.size());
    std::vector<int32_t> indptr(b + 1, 0), last(b, 64), rows(b);
    for (int32_t i = 0; i < b; ++i) {
      indptr[i + 1] = indptr[i] + c.pages[i];
      last[i] = 1 + (i * 37) % 64;
      rows[i] = i;
    }
    const int32_t* append_rows = c.appends ? rows.data() : nullptr;
    k::PlanSummary summary;
    // One way of planning, timed over reps; p50 and mean in ns.
    const auto time = [&](auto&& plan, double* mean) -> double {
      std::vector<double> ns(static_cast<size_t>(reps));
      for (int32_t r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        const k::KernelStatus st = plan(r);
        const auto t1 = std::chrono::steady_clock::now();
        if (!st.ok()) {
          std::fprintf(stderr, "%s: %s\n", c.name.c_str(), st.message.c_str());
          std::exit(1);
        }
        ns[static_cast<size_t>(r)] = std::chrono::duration<double, std::nano>(t1 - t0).count();
      }
      double sum = 0;
      for (double x : ns) sum += x;
      if (mean != nullptr) *mean = sum / reps;
      std::nth_element(ns.begin(), ns.begin() + reps / 2, ns.end());
      return ns[reps / 2];
    };
    double mean = 0;
    const double p50 = time(
        [&](int32_t) {
          return k::BuildDecodePlan(indptr.data(), last.data(), b, cap, aligned, &summary,
                                    append_rows);
        },
        &mean);
    const k::PlanSummary built = summary;
    k::PlanMemo memo(cap);
    const double hit = time(
        [&](int32_t r) {
          last[0] = 1 + r % 64;  // the next step: same pages, another length
          return memo.Build(indptr.data(), last.data(), b, aligned, &summary, append_rows);
        },
        nullptr);
    if (!memo.last_hit()) {
      std::fprintf(stderr, "%s: the memo did not reuse its plan\n", c.name.c_str());
      return 1;
    }
    // Alternating between two page sets: every plan is new.
    std::vector<int32_t> moved = indptr;
    for (int32_t i = 1; i <= b; ++i) ++moved[i];
    last[0] = 1;  // its value in the plain plan's runs
    const double miss = time(
        [&](int32_t r) {
          const int32_t* p = r % 2 == 0 ? moved.data() : indptr.data();
          return memo.Build(p, last.data(), b, aligned, &summary, append_rows);
        },
        nullptr);
    if (memo.last_hit()) {
      std::fprintf(stderr, "%s: the memo reused a plan of other pages\n", c.name.c_str());
      return 1;
    }
    std::printf("%-30s %10.0f %10.0f %10.0f %10.0f %6d %6d %7d\n", c.name.c_str(), mean, p50,
                hit, miss, built.num_parts, built.num_items, built.num_groups);
  }
  return 0;
}
