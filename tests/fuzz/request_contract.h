// The validity rules of DecodeRequest and AppendKVRequest as the proto contract states them
// (proto/pagedattn/v1/pagedattn.proto, "Tensors by reference" included), written independently
// of server/service/validation.cc, for fuzz_request_validation to check validation against.
// References are judged against the regions of fuzz_regions.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "tests/fuzz/fuzz_regions.h"

namespace pagedattn::fuzz {

// The codes the contract allows for a request: OK when it breaks no rule, else the code of any
// rule it breaks (the contract does not order the rules).
struct Verdict {
  bool invalid = false;    // a rule whose code is INVALID_ARGUMENT is broken
  bool not_found = false;  // a reference names an unknown region
  bool valid() const { return !invalid && !not_found; }
  bool Allows(absl::StatusCode code) const;
  std::string ToString() const;
};

// A verdict, and where the request's references lead when they keep their own rules.
struct DecodeJudgement {
  Verdict verdict;
  std::optional<Place> q, k, v, output, lse;
};
struct AppendJudgement {
  Verdict verdict;
  std::optional<Place> k, v;
};

DecodeJudgement JudgeDecode(const v1::DecodeRequest& r, int32_t num_layers, int32_t max_batch);
AppendJudgement JudgeAppend(const v1::AppendKVRequest& r, int32_t num_layers);

// The fuzzer's "fit" for a reference: byte_size set to `bytes`, and in a known region large
// enough the offset folded into it (a multiple of 16).
void FitRef(v1::TensorRef* ref, int64_t bytes);

}  // namespace pagedattn::fuzz
