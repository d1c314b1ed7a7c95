// What the tier benches share: stop with a message on a failed status, and the median of a set
// of timings.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pagedattn::testing {

inline void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}
template <typename T>
void Check(const absl::StatusOr<T>& s, const char* what) {
  Check(s.status(), what);
}
#define CHECK_OK(expr) ::pagedattn::testing::Check((expr), #expr)

// 0 for no timings.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace pagedattn::testing
