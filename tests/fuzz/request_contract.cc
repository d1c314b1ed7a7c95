#include "tests/fuzz/request_contract.h"

#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn::fuzz {

namespace k = kernels;

bool Verdict::Allows(absl::StatusCode code) const {
  if (code == absl::StatusCode::kOk) return valid();
  if (code == absl::StatusCode::kInvalidArgument) return invalid;
  if (code == absl::StatusCode::kNotFound) return not_found;
  return false;
}

std::string Verdict::ToString() const {
  if (valid()) return "valid";
  return absl::StrCat(invalid ? "INVALID_ARGUMENT" : "", invalid && not_found ? " or " : "",
                      not_found ? "NOT_FOUND" : "");
}

namespace {

// One tensor, given inline (`inline_bytes` of them) or by reference (`has_ref`): exactly one
// way, `expected` bytes either way. Sets *place for a reference that keeps its own rules.
void JudgeTensor(size_t inline_bytes, bool has_ref, const v1::TensorRef& ref, int64_t expected,
                 Verdict* verdict, std::optional<Place>* place) {
  if (!has_ref) {
    if (static_cast<int64_t>(inline_bytes) != expected) verdict->invalid = true;
    return;
  }
  bool ok = inline_bytes == 0;  // not both ways
  if (expected < 0 || ref.byte_size() != static_cast<uint64_t>(expected)) ok = false;
  if (ref.offset() % 16 != 0) ok = false;
  if (!ok) verdict->invalid = true;
  const SharedMemory::Region* region = SharedMemory::Find(ref.region());
  if (region == nullptr) {
    verdict->not_found = true;
    return;
  }
  if (ref.offset() > region->size || ref.byte_size() > region->size - ref.offset()) {
    verdict->invalid = true;
    return;
  }
  if (ok) {
    const uint64_t begin = region->offset + ref.offset();
    *place = Place{region->object, begin, begin + ref.byte_size()};
  }
}

}  // namespace

DecodeJudgement JudgeDecode(const v1::DecodeRequest& r, int32_t num_layers, int32_t max_batch) {
  DecodeJudgement j;
  Verdict& verdict = j.verdict;
  const int64_t b = r.sequence_ids_size();
  if (b < 1 || b > max_batch) verdict.invalid = true;
  if (r.layer() < 0 || r.layer() >= num_layers) verdict.invalid = true;
  absl::flat_hash_set<uint64_t> ids(r.sequence_ids().begin(), r.sequence_ids().end());
  if (static_cast<int64_t>(ids.size()) != b) verdict.invalid = true;
  JudgeTensor(r.q().size(), r.has_q_ref(), r.q_ref(), b * k::kQueryBytes, &verdict, &j.q);
  const bool has_k = !r.k().empty() || r.has_k_ref();
  const bool has_v = !r.v().empty() || r.has_v_ref();
  if (has_k != has_v) {
    verdict.invalid = true;
  } else if (has_k) {
    JudgeTensor(r.k().size(), r.has_k_ref(), r.k_ref(), b * k::kTokenBytes, &verdict, &j.k);
    JudgeTensor(r.v().size(), r.has_v_ref(), r.v_ref(), b * k::kTokenBytes, &verdict, &j.v);
  }
  if (r.has_output_ref()) {
    JudgeTensor(0, true, r.output_ref(), b * k::kQueryBytes, &verdict, &j.output);
  }
  if (r.has_lse_ref()) {
    JudgeTensor(0, true, r.lse_ref(), b * k::kNumQoHeads * 4, &verdict, &j.lse);
  }
  // Outputs overlap neither each other nor an input; inputs may overlap each other.
  if (j.output && j.lse && Intersect(*j.output, *j.lse)) verdict.invalid = true;
  for (const std::optional<Place>* out : {&j.output, &j.lse}) {
    for (const std::optional<Place>* in : {&j.q, &j.k, &j.v}) {
      if (*out && *in && Intersect(**out, **in)) verdict.invalid = true;
    }
  }
  if (!std::isfinite(r.sm_scale()) || r.sm_scale() < 0.0f) verdict.invalid = true;
  return j;
}

AppendJudgement JudgeAppend(const v1::AppendKVRequest& r, int32_t num_layers) {
  AppendJudgement j;
  if (r.layer() < 0 || r.layer() >= num_layers || r.num_tokens() < 1) j.verdict.invalid = true;
  const int64_t bytes = int64_t{r.num_tokens()} * k::kTokenBytes;
  JudgeTensor(r.k().size(), r.has_k_ref(), r.k_ref(), bytes, &j.verdict, &j.k);
  JudgeTensor(r.v().size(), r.has_v_ref(), r.v_ref(), bytes, &j.verdict, &j.v);
  return j;
}

void FitRef(v1::TensorRef* ref, int64_t bytes) {
  ref->set_byte_size(static_cast<uint64_t>(bytes));
  const SharedMemory::Region* region = SharedMemory::Find(ref->region());
  if (region == nullptr || region->size < static_cast<uint64_t>(bytes)) return;
  ref->set_offset(ref->offset() % (region->size - bytes + 1) / 16 * 16);
}

}  // namespace pagedattn::fuzz
