// The C++ client's bf16 conversion (client/bf16.cc) as a filter, so the Python package's numpy
// conversion can be compared with it bit for bit (bf16_test.py).
//   bf16_reference encode < fp32 bytes > bf16 bytes   (EncodeBf16)
//   bf16_reference decode < bf16 bytes > fp32 bytes   (DecodeBf16)
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "client/bf16.h"

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode != "encode" && mode != "decode") {
    std::fprintf(stderr, "usage: %s encode|decode < input > output\n", argv[0]);
    return 2;
  }
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::string output;
  if (mode == "encode") {
    std::vector<float> values(input.size() / 4);
    std::memcpy(values.data(), input.data(), values.size() * 4);
    output = pagedattn::client::EncodeBf16(values);
  } else {
    const std::vector<float> values = pagedattn::client::DecodeBf16(input);
    output.assign(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  }
  std::cout.write(output.data(), static_cast<std::streamsize>(output.size()));
  return std::cout.good() ? 0 : 1;
}
