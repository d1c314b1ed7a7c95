// Helpers shared by the fuzz targets: a reader that turns the fuzzer's bytes into choices, and
// FUZZ_CHECK, which prints what went wrong and aborts (libFuzzer then saves the input).
//
// The reader never fails: once the bytes run out every read returns 0 (and Bytes() an empty
// view), so a short input is simply a short run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace pagedattn::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  size_t remaining() const { return size_ - pos_; }

  uint8_t Byte() { return empty() ? 0 : data_[pos_++]; }
  uint16_t U16() {
    const uint16_t lo = Byte();
    return static_cast<uint16_t>(lo | (uint16_t{Byte()} << 8));
  }
  // Up to n bytes (fewer at the end of the input).
  std::string_view Bytes(size_t n) {
    const size_t take = n < remaining() ? n : remaining();
    std::string_view out(reinterpret_cast<const char*>(data_ + pos_), take);
    pos_ += take;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

[[noreturn]] inline void FailCheck(const char* file, int line, const char* condition,
                                   const std::string& detail) {
  std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n  %s\n", file, line, condition,
               detail.c_str());
  std::fflush(stderr);
  std::abort();
}

// With PAGEDATTN_FUZZ_TRACE set in the environment, the targets print every operation and its
// result (to read what a saved input does).
inline bool TraceOn() {
  static const bool on = std::getenv("PAGEDATTN_FUZZ_TRACE") != nullptr;
  return on;
}

template <typename... Parts>
void Trace(const Parts&... parts) {
  if (TraceOn()) std::fprintf(stderr, "%s\n", absl::StrCat(parts...).c_str());
}

}  // namespace pagedattn::fuzz

// FUZZ_CHECK(condition, parts...): aborts with absl::StrCat(parts...) when condition is false.
#define FUZZ_CHECK(condition, ...)                                                        \
  do {                                                                                    \
    if (!(condition)) {                                                                   \
      ::pagedattn::fuzz::FailCheck(__FILE__, __LINE__, #condition, absl::StrCat(__VA_ARGS__)); \
    }                                                                                     \
  } while (0)
