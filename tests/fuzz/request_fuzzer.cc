// fuzz_request_validation: bytes -> pagedattn.v1 request messages -> the service's validation
// (server/service/validation.h) -> the engine, in process, on the CPU backend with a small pool
// (2 layers x 6 pages, max_batch_size 4) shared by every input.
//
// Checked for every message:
//   - validation accepts exactly the requests the proto contract calls valid (an independent
//     predicate, request_contract.h), and the work it builds carries the request's fields
//     unchanged (inline bytes, or views of the bytes its references name);
//   - the engine's status code for every call is the one KvModel predicts (so: state never
//     changes on error, all-or-nothing page use, layer order, fork and release rules), and
//     GetStats (pages free, sequences, tokens, queue) agrees with the model after every call;
//   - Decode output and lse have B rows, the request id comes back, and a sequence with no
//     tokens reads zeros with lse -inf.
// After each input every sequence it left is released: all pages must be free again.
//
// Tensors by reference: the regions of fuzz_regions.h (two POSIX shared-memory objects of random
// bf16 data registered with a MemoryRegistry of the process's own as "fz-a", "fz-a-mid", a
// window of the same object, and "fz-b"; unlinked at once). Every input starts from the same
// region contents. Validation gets the registry, and the predicate knows
// the ref rules: NOT_FOUND for an unknown region, INVALID_ARGUMENT for a wrong byte_size, an
// offset not a multiple of 16, a range outside the region, a tensor given both ways, an output
// overlapping an input or the other output (within one object, whatever region names it).
// When a request breaks rules of both codes, either code is accepted (the contract gives no
// order). Work built from references must view the same bytes. After each group of submitted
// work (what one Drain checks): bytes outside the successful Decodes' output_ref / lse_ref
// ranges are unchanged; a Decode with output_ref / lse_ref has empty response fields, its
// region results read zeros / -inf for a sequence with no tokens, and, when nothing else in
// the group wrote near its ranges and it attended to exactly the committed tokens, its results
// equal those of the same Decode rerun attend-only with inline tensors.
//
// Input: records until the bytes run out (at most kMaxRecords):
//   tag (1 byte): low 3 bits pick the message (0 CreateSequence, 1 AppendKV, 2 Decode,
//                 3 ForkSequence, 4 ReleaseSequence, 5 GetStats + GetModelConfig, 6 and 7 parse
//                 the payload as every request type and validate only); bit 3 "fit": after
//                 parsing, resize q/k/v to the sizes the message's own sequence_ids or
//                 num_tokens call for (repeating the bytes given), so that short inputs reach
//                 the engine; bit 4 "queue": an AppendKV or Decode is submitted without
//                 waiting for it, so that the next ones share its batch (up to kMaxQueued;
//                 any other call first waits for everything submitted). "fit" also sets
//                 every TensorRef's byte_size to its tensor's size and, in a known region,
//                 folds its offset into the region (a multiple of 16); a tensor given by
//                 reference is not stretched inline.
//   length (2 bytes, little endian), then that many payload bytes: the serialized message.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/stubs/logging.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/service/validation.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_regions.h"
#include "tests/fuzz/kv_model.h"
#include "tests/fuzz/request_contract.h"

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

class RequestRun {
 public:
  RequestRun(Engine& engine, const ModelConfig& config)
      : engine_(engine),
        shm_(SharedMemory::Get()),
        config_(config),
        model_(kLayers, kPages, k::kPageSize) {}

  void Run(FuzzInput& in) {
    shm_.Reset();
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
    // A TensorRef region that is not UTF-8 fails the parse, which protobuf also logs: the
    // fuzzer makes such bytes all the time, and the log would drown its own output.
    google::protobuf::LogSilencer silence;
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
    AppendJudgement append_judged;
    if (Parse(payload, &append)) (void)CheckAppendValidation(append, &append_judged);
    v1::DecodeRequest decode;
    DecodeJudgement decode_judged;
    if (Parse(payload, &decode)) (void)CheckDecodeValidation(decode, &decode_judged);
  }

  absl::StatusOr<AppendWork> CheckAppendValidation(const v1::AppendKVRequest& r,
                                                   AppendJudgement* judged) {
    absl::StatusOr<AppendWork> work = ToAppendWork(r, config_, shm_.registry());
    if (!work.ok()) Trace("ToAppendWork -> ", work.status().ToString());
    *judged = JudgeAppend(r, kLayers);
    FUZZ_CHECK(judged->verdict.Allows(work.status().code()), "ToAppendWork: ",
               work.status().ToString(), "; the contract says ", judged->verdict.ToString(),
               " (layer ", r.layer(), ", num_tokens ", r.num_tokens(), ", k ", r.k().size(),
               " B", RefText(r.has_k_ref(), r.k_ref()), ", v ", r.v().size(), " B",
               RefText(r.has_v_ref(), r.v_ref()), ")");
    if (!work.ok()) return work;
    FUZZ_CHECK(work->sequence_id == r.sequence_id() && work->layer == r.layer() &&
                   work->num_tokens == r.num_tokens(),
               "ToAppendWork changed the request's fields");
    CheckTensor("k", work->k, r.k(), judged->k);
    CheckTensor("v", work->v, r.v(), judged->v);
    return work;
  }

  absl::StatusOr<DecodeWork> CheckDecodeValidation(const v1::DecodeRequest& r,
                                                   DecodeJudgement* judged) {
    absl::StatusOr<DecodeWork> work = ToDecodeWork(r, config_, shm_.registry());
    if (!work.ok()) Trace("ToDecodeWork -> ", work.status().ToString());
    *judged = JudgeDecode(r, kLayers, kMaxBatch);
    FUZZ_CHECK(judged->verdict.Allows(work.status().code()), "ToDecodeWork: ",
               work.status().ToString(), "; the contract says ", judged->verdict.ToString(),
               " (B ", r.sequence_ids_size(), ", layer ", r.layer(), ", q ", r.q().size(), " B",
               RefText(r.has_q_ref(), r.q_ref()), ", k ", r.k().size(), " B",
               RefText(r.has_k_ref(), r.k_ref()), ", v ", r.v().size(), " B",
               RefText(r.has_v_ref(), r.v_ref()), ", output",
               RefText(r.has_output_ref(), r.output_ref()),
               ", lse", RefText(r.has_lse_ref(), r.lse_ref()), ", sm_scale ", r.sm_scale(), ")");
    if (!work.ok()) return work;
    const float scale = r.sm_scale() == 0.0f ? 1.0f / std::sqrt(128.0f) : r.sm_scale();
    FUZZ_CHECK(work->request_id == r.request_id() && work->layer == r.layer() &&
                   std::equal(work->sequence_ids.begin(), work->sequence_ids.end(),
                              r.sequence_ids().begin(), r.sequence_ids().end()),
               "ToDecodeWork changed the request's fields");
    CheckTensor("q", work->q, r.q(), judged->q);
    CheckTensor("k", work->k, r.k(), judged->k);
    CheckTensor("v", work->v, r.v(), judged->v);
    CheckTensor("output", work->output, "", judged->output);
    CheckTensor("lse", work->lse, "", judged->lse);
    FUZZ_CHECK(std::fabs(work->sm_scale - scale) <= 1e-6f * scale && work->sm_scale > 0.0f,
               "sm_scale ", r.sm_scale(), " resolved to ", work->sm_scale);
    return work;
  }

  static std::string RefText(bool has_ref, const v1::TensorRef& ref) {
    if (!has_ref) return "";
    return absl::StrCat(" ref {\"", absl::CHexEscape(ref.region()), "\", ", ref.offset(), ", ",
                        ref.byte_size(), "}");
  }

  // A work tensor holds the request's inline bytes, or views the bytes its reference names.
  void CheckTensor(const char* field, const Tensor& t, std::string_view inline_bytes,
                   const std::optional<Place>& place) const {
    if (place) {
      // The server maps the object itself (at another address), so the view is compared by
      // content, and only while no earlier work is queued: that work may be writing the bytes.
      const std::string_view named(shm_.data(*place), place->end - place->begin);
      FUZZ_CHECK(t.is_view() && !t.on_device() && t.host_bytes().size() == named.size() &&
                     (!pending_.empty() || t.host_bytes() == named),
                 field, " does not view the bytes its reference names");
    } else {
      FUZZ_CHECK(!t.is_view() && t.host_bytes() == inline_bytes, field,
                 " is not the request's inline bytes");
    }
  }

  // Before work is submitted: the regions' contents a group of work starts from.
  void StartWork() {
    if (pending_.empty()) before_ = shm_.Snapshot();
  }

  void Append(std::string_view payload, bool fit) {
    v1::AppendKVRequest r;
    if (!Parse(payload, &r)) return;
    if (fit && r.num_tokens() >= 1 && r.num_tokens() <= kMaxFitTokens) {
      const int64_t bytes = int64_t{r.num_tokens()} * k::kTokenBytes;
      const std::string k_seed = r.k();
      if (r.has_k_ref()) FitRef(r.mutable_k_ref(), bytes); else r.set_k(Stretch(r.k(), bytes));
      if (r.has_v_ref()) FitRef(r.mutable_v_ref(), bytes);
      else r.set_v(Stretch(r.v().empty() ? k_seed : r.v(), bytes));
    }
    AppendJudgement judged;
    absl::StatusOr<AppendWork> work = CheckAppendValidation(r, &judged);
    if (!work.ok()) return;
    KvModel::StepResult step;
    const Code want = model_.ApplyStep(r.sequence_id(), r.layer(), r.num_tokens(), &step);
    auto done = std::make_shared<std::promise<absl::StatusOr<int64_t>>>();
    std::shared_future<absl::StatusOr<int64_t>> future = done->get_future().share();
    StartWork();
    engine_.Append(*std::move(work), [done](absl::StatusOr<int64_t> result) {
      done->set_value(std::move(result));
    });
    Pending pending;
    for (const auto* p : {&judged.k, &judged.v}) {
      if (*p) pending.reads.push_back(**p);
    }
    pending.check = [future, want, length = step.length, id = r.sequence_id(), layer = r.layer(),
                     tokens = r.num_tokens()](bool, bool) {
      const absl::StatusOr<int64_t>& got = future.get();
      Trace("AppendKV(", id, ", layer ", layer, ", ", tokens, " tokens) -> ", got.status().ToString());
      FUZZ_CHECK(got.status().code() == want, "AppendKV(", id, ", layer ", layer, ", ", tokens,
                 " tokens): ", got.status().ToString(), ", model ", Name(want));
      if (got.ok()) FUZZ_CHECK(*got == length, "AppendKV length ", *got, ", model ", length);
      return got.ok();
    };
    pending_.push_back(std::move(pending));
  }

  // What a Decode's result is checked against.
  struct DecodeExpectation {
    Code want = Code::kOk;
    std::vector<int64_t> visible;  // tokens each sequence attends to
    std::vector<uint64_t> ids;
    uint64_t request_id = 0;
    int32_t layer = 0;
    bool step = false;
    float sm_scale = 0.0f;
    std::optional<Place> output, lse;
    // Every sequence attends to exactly its committed tokens after the call, so an attend-only
    // rerun sees the same tokens.
    bool rerunnable = false;
    std::string q;            // inline q (for the rerun)
    std::optional<Place> q_ref;
  };

  void Decode(std::string_view payload, bool fit) {
    v1::DecodeRequest r;
    if (!Parse(payload, &r)) return;
    const int64_t b = r.sequence_ids_size();
    if (fit && b >= 1 && b <= kMaxBatch) {
      if (r.has_q_ref()) FitRef(r.mutable_q_ref(), b * k::kQueryBytes);
      else r.set_q(Stretch(r.q(), b * k::kQueryBytes));
      if (!r.k().empty() || !r.v().empty() || r.has_k_ref() || r.has_v_ref()) {
        const std::string k_seed = r.k();
        if (r.has_k_ref()) FitRef(r.mutable_k_ref(), b * k::kTokenBytes);
        else r.set_k(Stretch(r.k(), b * k::kTokenBytes));
        if (r.has_v_ref()) FitRef(r.mutable_v_ref(), b * k::kTokenBytes);
        else r.set_v(Stretch(r.v().empty() ? k_seed : r.v(), b * k::kTokenBytes));
      }
      if (r.has_output_ref()) FitRef(r.mutable_output_ref(), b * k::kQueryBytes);
      if (r.has_lse_ref()) FitRef(r.mutable_lse_ref(), b * k::kNumQoHeads * 4);
    }
    DecodeJudgement judged;
    absl::StatusOr<DecodeWork> work = CheckDecodeValidation(r, &judged);
    if (!work.ok()) return;
    DecodeExpectation e;
    e.visible = ExpectDecode(r);
    e.want = e.visible.empty() ? last_decode_error_ : Code::kOk;
    e.ids.assign(r.sequence_ids().begin(), r.sequence_ids().end());
    e.request_id = r.request_id();
    e.layer = r.layer();
    e.step = work->k.size() > 0;
    e.sm_scale = r.sm_scale();
    e.output = judged.output;
    e.lse = judged.lse;
    e.q = r.q();
    e.q_ref = judged.q;
    e.rerunnable = e.want == Code::kOk && (e.output || e.lse);
    for (size_t i = 0; e.rerunnable && i < e.ids.size(); ++i) {
      e.rerunnable = e.visible[i] == model_.Find(e.ids[i])->length;
    }
    auto done = std::make_shared<std::promise<absl::StatusOr<DecodeOutput>>>();
    std::shared_future<absl::StatusOr<DecodeOutput>> future = done->get_future().share();
    StartWork();
    engine_.Decode(*std::move(work), [done](absl::StatusOr<DecodeOutput> result) {
      done->set_value(std::move(result));
    });
    Pending pending;
    for (const auto* p : {&judged.q, &judged.k, &judged.v}) {
      if (*p) pending.reads.push_back(**p);
    }
    for (const auto* p : {&judged.output, &judged.lse}) {
      if (*p) pending.writes.push_back(**p);
    }
    pending.check = [this, future, e = std::move(e)](bool quiet, bool last) {
      return CheckDecodeResult(future.get(), e, quiet, last);
    };
    pending_.push_back(std::move(pending));
  }

  // `quiet`: nothing else in the group wrote where this Decode reads or writes, so its region
  // results can be read; `last`: nothing was submitted after it, so the engine is idle.
  bool CheckDecodeResult(const absl::StatusOr<DecodeOutput>& got, const DecodeExpectation& e,
                         bool quiet, bool last) {
    const int64_t b = static_cast<int64_t>(e.ids.size());
    const std::string what = absl::StrCat(
        "Decode(", absl::StrJoin(e.ids, ","), ", layer ", e.layer,
        e.step ? ", step" : ", attend only", e.output ? ", output_ref" : "",
        e.lse ? ", lse_ref" : "", ")");
    Trace(what, " -> ", got.status().ToString());
    FUZZ_CHECK(got.status().code() == e.want, what, ": ", got.status().ToString(), ", model ",
               Name(e.want));
    if (!got.ok()) return false;
    FUZZ_CHECK(got->request_id == e.request_id, "request id ", got->request_id, " for ",
               e.request_id);
    const int64_t out_bytes = b * k::kQueryBytes;
    const int64_t lse_bytes = b * k::kNumQoHeads * 4;
    FUZZ_CHECK(static_cast<int64_t>(got->output.size()) == (e.output ? 0 : out_bytes) &&
                   static_cast<int64_t>(got->lse.size()) == (e.lse ? 0 : lse_bytes),
               what, ": response output ", got->output.size(), " B, lse ", got->lse.size(),
               " B for B ", b);
    // The results, from the response or the regions (unless something else wrote there).
    std::optional<std::string> output, lse;
    if (!e.output) output = got->output; else if (quiet) output = shm_.Read(*e.output);
    if (!e.lse) lse = got->lse; else if (quiet) lse = shm_.Read(*e.lse);
    for (int64_t i = 0; i < b; ++i) {
      if (e.visible[i] != 0) continue;
      if (output) {
        const char* out = output->data() + i * k::kQueryBytes;
        FUZZ_CHECK(std::all_of(out, out + k::kQueryBytes, [](char c) { return c == 0; }),
                   what, ": sequence ", e.ids[i], " has no tokens but a non-zero output");
      }
      for (int h = 0; lse && h < k::kNumQoHeads; ++h) {
        float x;
        std::memcpy(&x, lse->data() + (i * k::kNumQoHeads + h) * 4, 4);
        FUZZ_CHECK(std::isinf(x) && x < 0, what, ": sequence ", e.ids[i],
                   " has no tokens but lse ", x);
      }
    }
    if (e.rerunnable && quiet && last) {
      // The same tokens attended again, every tensor inline: the results must be the same.
      v1::DecodeRequest again;
      again.set_request_id(e.request_id);
      again.set_layer(e.layer);
      for (uint64_t id : e.ids) again.add_sequence_ids(id);
      again.set_q(e.q_ref ? shm_.Read(*e.q_ref) : e.q);
      again.set_sm_scale(e.sm_scale);
      absl::StatusOr<DecodeWork> work = ToDecodeWork(again, config_, nullptr);
      FUZZ_CHECK(work.ok(), "rerun: ", work.status().ToString());
      std::promise<absl::StatusOr<DecodeOutput>> done;
      std::future<absl::StatusOr<DecodeOutput>> future = done.get_future();
      engine_.Decode(*std::move(work), [&done](absl::StatusOr<DecodeOutput> result) {
        done.set_value(std::move(result));
      });
      const absl::StatusOr<DecodeOutput> inline_result = future.get();
      FUZZ_CHECK(inline_result.ok(), what, ": inline rerun ", inline_result.status().ToString());
      FUZZ_CHECK(*output == inline_result->output, what,
                 ": output differs from the same Decode rerun with inline tensors");
      FUZZ_CHECK(*lse == inline_result->lse, what,
                 ": lse differs from the same Decode rerun with inline tensors");
      Trace("  rerun inline: same output and lse");
    }
    return true;
  }

  // Checks the results of everything submitted, in order, then that the regions changed only
  // where successful Decodes wrote their output_ref / lse_ref.
  void Drain() {
    if (pending_.empty()) return;
    std::vector<Place> written;
    for (size_t i = 0; i < pending_.size(); ++i) {
      bool quiet = true;
      for (size_t j = 0; j < pending_.size() && quiet; ++j) {
        if (j == i) continue;
        for (const Place& w : pending_[j].writes) {
          for (const auto* mine : {&pending_[i].reads, &pending_[i].writes}) {
            for (const Place& p : *mine) quiet = quiet && !Intersect(w, p);
          }
        }
      }
      if (pending_[i].check(quiet, i + 1 == pending_.size())) {
        written.insert(written.end(), pending_[i].writes.begin(), pending_[i].writes.end());
      }
    }
    shm_.CheckUnchangedOutside(before_, written);
    pending_.clear();
  }

  // Applies the Decode to the model as the engine should, all or nothing. Returns the visible
  // token count of each sequence, or an empty vector with last_decode_error_ set.
  std::vector<int64_t> ExpectDecode(const v1::DecodeRequest& r) {
    const bool step = !r.k().empty() || r.has_k_ref();  // validated: k and v both given, or neither
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

  // An Append or Decode submitted. `check` checks its result and returns whether it succeeded;
  // `reads` and `writes` are where it reads and writes the regions.
  struct Pending {
    std::function<bool(bool quiet, bool last)> check;
    std::vector<Place> reads, writes;
  };

  Engine& engine_;
  SharedMemory& shm_;
  const ModelConfig config_;
  KvModel model_;
  // Appends and Decodes submitted, whose results are still to be checked (in order).
  std::vector<Pending> pending_;
  // The regions' contents before the first of them was submitted.
  std::vector<std::string> before_;
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
