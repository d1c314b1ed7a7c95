// fuzz_request_validation: bytes -> pagedattn.v1 request messages -> the service's validation
// (server/service/validation.h) -> the engine, in process, on the CPU backend with a small pool
// (2 layers x 6 pages, max_batch_size 4) shared by every input.
//
// Checked for every message:
//   - validation accepts exactly the requests the proto contract calls valid (an independent
//     predicate below), and the work it builds carries the request's fields unchanged;
//   - the engine's status code for every call is the one KvModel predicts (so: state never
//     changes on error, all-or-nothing page use, layer order, fork and release rules), and
//     GetStats (pages free, sequences, tokens, queue) agrees with the model after every call;
//   - Decode output and lse have B rows, the request id comes back, and a sequence with no
//     tokens reads zeros with lse -inf.
// After each input every sequence it left is released: all pages must be free again.
//
// Input: records until the bytes run out (at most kMaxRecords):
//   tag (1 byte): low 3 bits pick the message (0 CreateSequence, 1 AppendKV, 2 Decode,
//                 3 ForkSequence, 4 ReleaseSequence, 5 GetStats + GetModelConfig, 6 and 7 parse
//                 the payload as every request type and validate only); bit 3 "fit": after
//                 parsing, resize q/k/v to the sizes the message's own sequence_ids or
//                 num_tokens call for (repeating the bytes given), so that short inputs reach
//                 the engine; bit 4 "queue": an AppendKV or Decode is submitted without
//                 waiting for it, so that the next ones share its batch (up to kMaxQueued;
//                 any other call first waits for everything submitted).
//   length (2 bytes, little endian), then that many payload bytes: the serialized message.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_join.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/service/validation.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/kv_model.h"

namespace pagedattn::fuzz {
namespace {

using Code = absl::StatusCode;
namespace k = kernels;

constexpr int32_t kLayers = 2;
constexpr int64_t kPages = 6;
constexpr int32_t kMaxBatch = 4;
constexpr int kMaxRecords = 64;
constexpr int kMaxQueued = 8;  // below the engine's max_queue_depth (16): never UNAVAILABLE
// Fitted k/v stay below 128 KiB each: larger blocks are mmapped afresh on every allocation under
// ASan, which costs more than the rest of an input. Three fitted appends fill the pool.
constexpr int32_t kMaxFitTokens = 127;

Engine& SharedEngine() {
  static Engine* const engine = [] {
    auto backend = CpuBackend::Create({.num_threads = 1});
    FUZZ_CHECK(backend.ok(), backend.status().ToString());
    auto created = Engine::Create({.num_layers = kLayers,
                                   .num_pages = kPages,
                                   .max_batch_size = kMaxBatch,
                                   .max_queue_delay = absl::ZeroDuration(),
                                   .max_queue_depth = 16},
                                  std::move(*backend), nullptr);
    FUZZ_CHECK(created.ok(), created.status().ToString());
    return created->release();
  }();
  return *engine;
}

std::string Name(Code code) { return absl::StatusCodeToString(code); }

// `bytes` repeated (or a fixed pattern when empty) to exactly `size` bytes.
std::string Stretch(const std::string& bytes, int64_t size) {
  std::string out = bytes.empty() ? std::string("\x80\x3f", 2) : bytes;  // bf16 1.0
  out.reserve(size);
  while (static_cast<int64_t>(out.size()) < size) {
    out.append(out, 0, std::min<int64_t>(out.size(), size - out.size()));
  }
  out.resize(size);
  return out;
}

// The contract's validity rules (proto/pagedattn/v1/pagedattn.proto), written independently of
// server/service/validation.cc.
bool DecodeIsValid(const v1::DecodeRequest& r) {
  const int64_t b = r.sequence_ids_size();
  if (b < 1 || b > kMaxBatch) return false;
  if (r.layer() < 0 || r.layer() >= kLayers) return false;
  absl::flat_hash_set<uint64_t> ids(r.sequence_ids().begin(), r.sequence_ids().end());
  if (static_cast<int64_t>(ids.size()) != b) return false;
  if (static_cast<int64_t>(r.q().size()) != b * k::kQueryBytes) return false;
  if (r.k().empty() != r.v().empty()) return false;
  if (!r.k().empty() && (static_cast<int64_t>(r.k().size()) != b * k::kTokenBytes ||
                         static_cast<int64_t>(r.v().size()) != b * k::kTokenBytes)) {
    return false;
  }
  return std::isfinite(r.sm_scale()) && r.sm_scale() >= 0.0f;
}

bool AppendIsValid(const v1::AppendKVRequest& r) {
  if (r.layer() < 0 || r.layer() >= kLayers || r.num_tokens() < 1) return false;
  const int64_t bytes = int64_t{r.num_tokens()} * k::kTokenBytes;
  return static_cast<int64_t>(r.k().size()) == bytes && static_cast<int64_t>(r.v().size()) == bytes;
}

class RequestRun {
 public:
  RequestRun(Engine& engine, const ModelConfig& config)
      : engine_(engine), config_(config), model_(kLayers, kPages, k::kPageSize) {}

  void Run(FuzzInput& in) {
    CheckStats("start of input");
    for (int i = 0; i < kMaxRecords && !in.empty(); ++i) {
      const uint8_t tag = in.Byte();
      const bool fit = tag & 0x08;
      const bool queue = tag & 0x10;
      const std::string_view payload = in.Bytes(in.U16());
      const int kind = tag & 0x07;
      // Only Appends and Decodes may wait in the engine's queue: the other calls act at once,
      // so the work before them must have run for the model's order to hold.
      if (kind != 1 && kind != 2 && kind < 6) Drain();
      switch (kind) {
        case 0: Create(payload); break;
        case 1: Append(payload, fit); break;
        case 2: Decode(payload, fit); break;
        case 3: Fork(payload); break;
        case 4: Release(payload); break;
        case 5: Stats(payload); break;
        default: ParseAsEverything(payload); break;
      }
      if (!queue || static_cast<int>(pending_.size()) >= kMaxQueued) Drain();
      if (pending_.empty()) CheckStats("after record ", i);
    }
    Drain();
    ReleaseEverything();
  }

 private:
  template <typename Message>
  static bool Parse(std::string_view payload, Message* m) {
    return m->ParseFromArray(payload.data(), static_cast<int>(payload.size()));
  }

  void Create(std::string_view payload) {
    v1::CreateSequenceRequest r;
    if (!Parse(payload, &r)) return;
    const Code want = model_.Add(r.sequence_id());
    const absl::Status got = engine_.CreateSequence(r.sequence_id());
    Trace("CreateSequence(", r.sequence_id(), ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "CreateSequence(", r.sequence_id(), "): ", got.ToString(),
               ", model ", Name(want));
  }

  void Fork(std::string_view payload) {
    v1::ForkSequenceRequest r;
    if (!Parse(payload, &r)) return;
    const Code want = model_.Fork(r.parent_id(), r.child_id());
    const absl::Status got = engine_.ForkSequence(r.parent_id(), r.child_id());
    Trace("ForkSequence(", r.parent_id(), ", ", r.child_id(), ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "ForkSequence(", r.parent_id(), ", ", r.child_id(), "): ",
               got.ToString(), ", model ", Name(want));
  }

  void Release(std::string_view payload) {
    v1::ReleaseSequenceRequest r;
    if (!Parse(payload, &r)) return;
    ReleaseId(r.sequence_id());
  }

  void ReleaseId(uint64_t id) {
    const Code want = model_.Remove(id);
    const absl::Status got = engine_.ReleaseSequence(id);
    Trace("ReleaseSequence(", id, ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "ReleaseSequence(", id, "): ", got.ToString(), ", model ",
               Name(want));
  }

  void Stats(std::string_view payload) {
    v1::GetStatsRequest stats;
    v1::GetModelConfigRequest config;
    (void)Parse(payload, &stats);
    (void)Parse(payload, &config);
    const ModelConfig c = engine_.config();
    FUZZ_CHECK(c.num_layers == kLayers && c.num_pages == kPages && c.max_batch_size == kMaxBatch &&
                   c.num_qo_heads == k::kNumQoHeads && c.num_kv_heads == k::kNumKvHeads &&
                   c.head_dim == k::kHeadDim && c.page_size == k::kPageSize && c.backend == "cpu",
               "model config changed");
    FUZZ_CHECK(engine_.health().ok(), engine_.health().ToString());
  }

  void ParseAsEverything(std::string_view payload) {
    v1::GetModelConfigRequest config;
    v1::CreateSequenceRequest create;
    v1::ForkSequenceRequest fork;
    v1::ReleaseSequenceRequest release;
    v1::GetStatsRequest stats;
    (void)Parse(payload, &config);
    (void)Parse(payload, &create);
    (void)Parse(payload, &fork);
    (void)Parse(payload, &release);
    (void)Parse(payload, &stats);
    v1::AppendKVRequest append;
    if (Parse(payload, &append)) (void)CheckAppendValidation(append);
    v1::DecodeRequest decode;
    if (Parse(payload, &decode)) (void)CheckDecodeValidation(decode);
  }

  absl::StatusOr<AppendWork> CheckAppendValidation(const v1::AppendKVRequest& r) {
    absl::StatusOr<AppendWork> work = ToAppendWork(r, config_);
    if (!work.ok()) Trace("ToAppendWork -> ", work.status().ToString());
    const bool valid = AppendIsValid(r);
    FUZZ_CHECK(work.ok() == valid, "ToAppendWork: ", work.status().ToString(), "; the contract says ",
               valid ? "valid" : "invalid", " (layer ", r.layer(), ", num_tokens ", r.num_tokens(),
               ", k ", r.k().size(), " B, v ", r.v().size(), " B)");
    if (!work.ok()) {
      FUZZ_CHECK(absl::IsInvalidArgument(work.status()), work.status().ToString());
      return work;
    }
    FUZZ_CHECK(work->sequence_id == r.sequence_id() && work->layer == r.layer() &&
                   work->num_tokens == r.num_tokens() && work->k.host_bytes() == r.k() && work->v.host_bytes() == r.v(),
               "ToAppendWork changed the request's fields");
    return work;
  }

  absl::StatusOr<DecodeWork> CheckDecodeValidation(const v1::DecodeRequest& r) {
    absl::StatusOr<DecodeWork> work = ToDecodeWork(r, config_);
    if (!work.ok()) Trace("ToDecodeWork -> ", work.status().ToString());
    const bool valid = DecodeIsValid(r);
    FUZZ_CHECK(work.ok() == valid, "ToDecodeWork: ", work.status().ToString(), "; the contract says ",
               valid ? "valid" : "invalid", " (B ", r.sequence_ids_size(), ", layer ", r.layer(),
               ", q ", r.q().size(), " B, k ", r.k().size(), " B, v ", r.v().size(),
               " B, sm_scale ", r.sm_scale(), ")");
    if (!work.ok()) {
      FUZZ_CHECK(absl::IsInvalidArgument(work.status()), work.status().ToString());
      return work;
    }
    const float scale = r.sm_scale() == 0.0f ? 1.0f / std::sqrt(128.0f) : r.sm_scale();
    FUZZ_CHECK(work->request_id == r.request_id() && work->layer == r.layer() &&
                   std::equal(work->sequence_ids.begin(), work->sequence_ids.end(),
                              r.sequence_ids().begin(), r.sequence_ids().end()) &&
                   work->q.host_bytes() == r.q() && work->k.host_bytes() == r.k() && work->v.host_bytes() == r.v(),
               "ToDecodeWork changed the request's fields");
    FUZZ_CHECK(std::fabs(work->sm_scale - scale) <= 1e-6f * scale && work->sm_scale > 0.0f,
               "sm_scale ", r.sm_scale(), " resolved to ", work->sm_scale);
    return work;
  }

  void Append(std::string_view payload, bool fit) {
    v1::AppendKVRequest r;
    if (!Parse(payload, &r)) return;
    if (fit && r.num_tokens() >= 1 && r.num_tokens() <= kMaxFitTokens) {
      const int64_t bytes = int64_t{r.num_tokens()} * k::kTokenBytes;
      r.set_k(Stretch(r.k(), bytes));
      r.set_v(Stretch(r.v().empty() ? r.k() : r.v(), bytes));
    }
    absl::StatusOr<AppendWork> work = CheckAppendValidation(r);
    if (!work.ok()) return;
    KvModel::StepResult step;
    const Code want = model_.ApplyStep(r.sequence_id(), r.layer(), r.num_tokens(), &step);
    auto done = std::make_shared<std::promise<absl::StatusOr<int64_t>>>();
    std::shared_future<absl::StatusOr<int64_t>> future = done->get_future().share();
    engine_.Append(*std::move(work), [done](absl::StatusOr<int64_t> result) {
      done->set_value(std::move(result));
    });
    pending_.push_back([future, want, length = step.length, id = r.sequence_id(), layer = r.layer(),
                        tokens = r.num_tokens()] {
      const absl::StatusOr<int64_t>& got = future.get();
      Trace("AppendKV(", id, ", layer ", layer, ", ", tokens, " tokens) -> ", got.status().ToString());
      FUZZ_CHECK(got.status().code() == want, "AppendKV(", id, ", layer ", layer, ", ", tokens,
                 " tokens): ", got.status().ToString(), ", model ", Name(want));
      if (got.ok()) FUZZ_CHECK(*got == length, "AppendKV length ", *got, ", model ", length);
    });
  }

  void Decode(std::string_view payload, bool fit) {
    v1::DecodeRequest r;
    if (!Parse(payload, &r)) return;
    const int64_t b = r.sequence_ids_size();
    if (fit && b >= 1 && b <= kMaxBatch) {
      r.set_q(Stretch(r.q(), b * k::kQueryBytes));
      if (!r.k().empty() || !r.v().empty()) {
        r.set_k(Stretch(r.k(), b * k::kTokenBytes));
        r.set_v(Stretch(r.v().empty() ? r.k() : r.v(), b * k::kTokenBytes));
      }
    }
    absl::StatusOr<DecodeWork> work = CheckDecodeValidation(r);
    if (!work.ok()) return;
    std::vector<int64_t> visible = ExpectDecode(r);
    const Code want = visible.empty() ? last_decode_error_ : Code::kOk;
    auto done = std::make_shared<std::promise<absl::StatusOr<DecodeOutput>>>();
    std::shared_future<absl::StatusOr<DecodeOutput>> future = done->get_future().share();
    engine_.Decode(*std::move(work), [done](absl::StatusOr<DecodeOutput> result) {
      done->set_value(std::move(result));
    });
    std::vector<uint64_t> ids(r.sequence_ids().begin(), r.sequence_ids().end());
    pending_.push_back([future, want, visible = std::move(visible), ids = std::move(ids),
                        request_id = r.request_id(), layer = r.layer(), step = !r.k().empty()] {
      CheckDecodeResult(future.get(), want, visible, ids, request_id, layer, step);
    });
  }

  static void CheckDecodeResult(const absl::StatusOr<DecodeOutput>& got, Code want,
                                const std::vector<int64_t>& visible,
                                const std::vector<uint64_t>& ids, uint64_t request_id,
                                int32_t layer, bool step) {
    const int64_t b = static_cast<int64_t>(ids.size());
    Trace("Decode(", absl::StrJoin(ids, ","), ", layer ", layer, step ? ", step" : ", attend only",
          ") -> ", got.status().ToString());
    FUZZ_CHECK(got.status().code() == want, "Decode(", absl::StrJoin(ids, ","), ", layer ", layer,
               step ? ", step" : ", attend only", "): ", got.status().ToString(), ", model ",
               Name(want));
    if (!got.ok()) return;
    FUZZ_CHECK(got->request_id == request_id, "request id ", got->request_id, " for ", request_id);
    FUZZ_CHECK(static_cast<int64_t>(got->output.size()) == b * k::kQueryBytes &&
                   static_cast<int64_t>(got->lse.size()) == b * k::kNumQoHeads * 4,
               "Decode output ", got->output.size(), " B, lse ", got->lse.size(), " B for B ", b);
    for (int64_t i = 0; i < b; ++i) {
      if (visible[i] != 0) continue;
      const char* out = got->output.data() + i * k::kQueryBytes;
      FUZZ_CHECK(std::all_of(out, out + k::kQueryBytes, [](char c) { return c == 0; }),
                 "sequence ", ids[i], " has no tokens but a non-zero output");
      for (int h = 0; h < k::kNumQoHeads; ++h) {
        float lse;
        std::memcpy(&lse, got->lse.data() + (i * k::kNumQoHeads + h) * 4, 4);
        FUZZ_CHECK(std::isinf(lse) && lse < 0, "sequence ", ids[i], " has no tokens but lse ", lse);
      }
    }
  }

  // Checks the results of everything submitted, in order.
  void Drain() {
    for (const auto& check : pending_) check();
    pending_.clear();
  }

  // Applies the Decode to the model as the engine should, all or nothing. Returns the visible
  // token count of each sequence, or an empty vector with last_decode_error_ set.
  std::vector<int64_t> ExpectDecode(const v1::DecodeRequest& r) {
    const bool step = !r.k().empty();
    std::vector<int64_t> visible;
    int64_t needed = 0;
    for (uint64_t id : r.sequence_ids()) {
      if (step) {
        const KvModel::StepCheck check = model_.CheckStep(id, r.layer(), 1);
        if (check.code != Code::kOk) {
          last_decode_error_ = check.code;
          return {};
        }
        needed += check.needed;
      } else if (model_.Find(id) == nullptr) {
        last_decode_error_ = Code::kNotFound;
        return {};
      }
    }
    if (needed > model_.num_free()) {
      last_decode_error_ = Code::kResourceExhausted;
      return {};
    }
    for (uint64_t id : r.sequence_ids()) {
      if (step) {
        KvModel::StepResult result;
        const Code code = model_.ApplyStep(id, r.layer(), 1, &result);
        FUZZ_CHECK(code == Code::kOk, "model step after check: ", Name(code));
        visible.push_back(result.visible_tokens);
      } else {
        visible.push_back(model_.Find(id)->length);
      }
    }
    return visible;
  }

  template <typename... Parts>
  void CheckStats(const Parts&... where) {
    const EngineStats s = engine_.GetStats();
    FUZZ_CHECK(s.pages_total == kPages && s.pages_free == model_.num_free() &&
                   s.sequences == static_cast<int64_t>(model_.sequences().size()) &&
                   s.tokens == model_.total_tokens() && s.queue_depth == 0 && s.healthy,
               absl::StrCat(where...), ": stats pages ", s.pages_free, "/", s.pages_total,
               " sequences ", s.sequences, " tokens ", s.tokens, " queue ", s.queue_depth,
               " healthy ", s.healthy, "; model pages ", model_.num_free(), " sequences ",
               model_.sequences().size(), " tokens ", model_.total_tokens());
  }

  void ReleaseEverything() {
    std::vector<uint64_t> ids;
    for (const auto& [id, seq] : model_.sequences()) ids.push_back(id);
    for (uint64_t id : ids) ReleaseId(id);
    CheckStats("after releasing every sequence");
    const EngineStats s = engine_.GetStats();
    FUZZ_CHECK(s.pages_free == s.pages_total && s.sequences == 0 && s.tokens == 0,
               "leak: ", s.pages_free, " of ", s.pages_total, " pages free, ", s.sequences,
               " sequences left");
  }

  Engine& engine_;
  const ModelConfig config_;
  KvModel model_;
  // Appends and Decodes submitted, whose results are still to be checked (in order).
  std::vector<std::function<void()>> pending_;
  Code last_decode_error_ = Code::kOk;
};

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedattn::Engine& engine = pagedattn::fuzz::SharedEngine();
  static const pagedattn::ModelConfig config = engine.config();
  pagedattn::fuzz::FuzzInput in(data, size);
  pagedattn::fuzz::RequestRun run(engine, config);
  run.Run(in);
  return 0;
}
