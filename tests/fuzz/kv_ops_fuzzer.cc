// fuzz_kv_ops: random sequences of BlockAllocator and SequenceTable operations (create, steps
// at layers in and out of order, full steps, fork, release, direct allocations that exhaust the
// pool, outside references that force copy on write, invalid page ids), each checked against
// KvModel: status codes, step results, copy-on-write pairs, every sequence's length, step state
// and pages, every page's reference count and the free count. Aborts on the first mismatch.
//
// Input: byte 0 picks the number of layers (1..4), byte 1 the pool size (1..48 pages); then
// one operation per byte with its arguments from the bytes after it (see Run()).
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "pagedattn/kernels/decode.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/kv_model.h"

namespace pagedattn::fuzz {
namespace {

using Code = absl::StatusCode;

constexpr int kMaxOps = 512;

class KvOpsRun {
 public:
  KvOpsRun(int32_t num_layers, int64_t num_pages)
      : model_(num_layers, num_pages, kernels::kPageSize) {
    auto allocator = BlockAllocator::Create({.num_pages = num_pages});
    FUZZ_CHECK(allocator.ok(), allocator.status().ToString());
    allocator_ = std::move(*allocator);
    auto table = SequenceTable::Create({.num_layers = num_layers}, allocator_.get());
    FUZZ_CHECK(table.ok(), table.status().ToString());
    table_ = std::move(*table);
  }

  void Run(FuzzInput& in) {
    for (int op = 0; op < kMaxOps && !in.empty(); ++op) {
      switch (in.Byte() % 12) {
        case 0: Add(PickId(in)); break;
        case 1: {
          const uint64_t parent = PickId(in);
          Fork(parent, PickId(in));
          break;
        }
        case 2: Remove(PickId(in)); break;
        case 3:
        case 4: Step(in); break;
        case 5: FullStep(in); break;
        case 6: Check(in); break;
        case 7: AllocateExternal(in); break;
        case 8: UnrefExternal(in); break;
        case 9: AddRefExternal(in); break;
        case 10: BadPage(in); break;
        case 11: Lookup(PickId(in)); break;
      }
      Verify();
    }
    ReleaseEverything();
  }

 private:
  // Mostly ids 0..7 so that operations meet; sometimes extreme ones.
  uint64_t PickId(FuzzInput& in) {
    const uint8_t b = in.Byte();
    if (b < 0xf8) return b % 8;
    static constexpr uint64_t kOdd[] = {std::numeric_limits<uint64_t>::max(), uint64_t{1} << 63,
                                        uint64_t{1} << 32, 0xffffffff, 64, 1000, 12345678901234567ull,
                                        std::numeric_limits<uint64_t>::max() - 1};
    return kOdd[b - 0xf8];
  }

  int32_t PickTokens(FuzzInput& in) {
    switch (in.Byte() % 8) {
      case 0: case 1: case 2: return 1;
      case 3: case 4: return 1 + in.Byte() % 130;
      case 5: return 1 + in.U16() % 4000;
      default: {
        static constexpr int32_t kOdd[] = {0, -1, 63, 64, 65, 128, std::numeric_limits<int32_t>::max(),
                                           std::numeric_limits<int32_t>::min()};
        return kOdd[in.Byte() % 8];
      }
    }
  }

  // The layer and token count a step on `id` would normally use next, or odd ones.
  void PickStep(FuzzInput& in, uint64_t id, int32_t* layer, int32_t* tokens) {
    const KvModel::Seq* seq = model_.Find(id);
    const uint8_t how = in.Byte();
    if (seq != nullptr && seq->step_tokens != 0 && how % 4 != 0) {
      *layer = seq->next_layer;
      *tokens = seq->step_tokens;
      return;
    }
    switch (how % 8) {
      case 6: *layer = static_cast<int32_t>(in.Byte() % (model_.num_layers() + 2)) - 1; break;
      case 7: *layer = in.Byte() % 2 ? std::numeric_limits<int32_t>::max()
                                     : std::numeric_limits<int32_t>::min(); break;
      default: *layer = seq != nullptr ? seq->next_layer : 0; break;
    }
    *tokens = PickTokens(in);
  }

  void Add(uint64_t id) {
    const Code want = model_.Add(id);
    const absl::Status got = table_->Add(id);
    Trace("Add(", id, ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "Add(", id, "): ", got.ToString(), ", model ", absl::StatusCodeToString(want));
  }

  void Fork(uint64_t parent, uint64_t child) {
    const Code want = model_.Fork(parent, child);
    const absl::Status got = table_->Fork(parent, child);
    Trace("Fork(", parent, ", ", child, ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "Fork(", parent, ", ", child, "): ", got.ToString(), ", model ",
               absl::StatusCodeToString(want));
  }

  void Remove(uint64_t id) {
    const Code want = model_.Remove(id);
    const absl::Status got = table_->Remove(id);
    Trace("Remove(", id, ") -> ", got.ToString());
    FUZZ_CHECK(got.code() == want, "Remove(", id, "): ", got.ToString(), ", model ", absl::StatusCodeToString(want));
  }

  void Lookup(uint64_t id) {
    const bool live = model_.Find(id) != nullptr;
    FUZZ_CHECK(table_->Contains(id) == live, "Contains(", id, ")");
    const auto view = table_->Get(id);
    FUZZ_CHECK(view.ok() == live, "Get(", id, "): ", view.status().ToString());
    if (!live) FUZZ_CHECK(absl::IsNotFound(view.status()), view.status().ToString());
  }

  void Check(FuzzInput& in) {
    const uint64_t id = PickId(in);
    int32_t layer, tokens;
    PickStep(in, id, &layer, &tokens);
    const KvModel::StepCheck want = model_.CheckStep(id, layer, tokens);
    const absl::StatusOr<int64_t> got = table_->CheckStep(id, layer, tokens);
    FUZZ_CHECK(got.status().code() == want.code, "CheckStep(", id, ", ", layer, ", ", tokens,
               "): ", got.status().ToString(), ", model ", absl::StatusCodeToString(want.code));
    if (got.ok()) {
      FUZZ_CHECK(*got == want.needed, "CheckStep(", id, ", ", layer, ", ", tokens, ") needs ",
                 *got, " pages, model ", want.needed);
    }
  }

  void Step(FuzzInput& in) {
    const uint64_t id = PickId(in);
    int32_t layer, tokens;
    PickStep(in, id, &layer, &tokens);
    ApplyStep(id, layer, tokens);
  }

  // Layers 0..L-1 of one step, stopping at the first error.
  void FullStep(FuzzInput& in) {
    const uint64_t id = PickId(in);
    const int32_t tokens = PickTokens(in);
    for (int32_t layer = 0; layer < model_.num_layers(); ++layer) {
      if (!ApplyStep(id, layer, tokens)) break;
      Verify();
    }
  }

  bool ApplyStep(uint64_t id, int32_t layer, int32_t tokens) {
    const std::vector<int64_t> before = Pages(id);
    KvModel::StepResult want;
    const Code want_code = model_.ApplyStep(id, layer, tokens, &want);
    std::vector<PageCopy> copies = {PageCopy{-7, -7}};  // the table appends after what is there
    const absl::StatusOr<SequenceTable::StepResult> got =
        table_->ApplyStep(id, layer, tokens, &copies);
    Trace("ApplyStep(", id, ", layer ", layer, ", ", tokens, " tokens) -> ", got.status().ToString(),
          " copies ", copies.size() - 1);
    FUZZ_CHECK(got.status().code() == want_code, "ApplyStep(", id, ", ", layer, ", ", tokens,
               "): ", got.status().ToString(), ", model ", absl::StatusCodeToString(want_code));
    FUZZ_CHECK(copies.front().src == -7 && copies.front().dst == -7, "copies overwritten");
    if (!got.ok()) {
      FUZZ_CHECK(copies.size() == 1, "a failed step reported a copy");
      return false;
    }
    FUZZ_CHECK(got->first_position == want.first_position && got->visible_tokens == want.visible_tokens &&
                   got->length == want.length,
               "ApplyStep(", id, ", ", layer, ", ", tokens, ") -> {", got->first_position, ", ",
               got->visible_tokens, ", ", got->length, "}, model {", want.first_position, ", ",
               want.visible_tokens, ", ", want.length, "}");
    FUZZ_CHECK(copies.size() == (want.copy ? 2u : 1u), "ApplyStep(", id, ", ", layer, ", ", tokens,
               ") reported ", copies.size() - 1, " copies, model ", want.copy ? 1 : 0);
    Unbind(model_.TakeFreed());
    BindSequence(id);
    if (want.copy) {
      // The shared page is still held by someone else, so it is still bound.
      FUZZ_CHECK(copies[1].src == real_.at(want.copy->first) && copies[1].dst == real_.at(want.copy->second),
                 "copy on write {", copies[1].src, " -> ", copies[1].dst, "}, model {",
                 real_.at(want.copy->first), " -> ", real_.at(want.copy->second), "}");
    }
    return true;
  }

  void AllocateExternal(FuzzInput& in) {
    int64_t count;
    switch (in.Byte() % 4) {
      case 0: count = model_.num_free(); break;  // exhaust the pool
      case 1: count = model_.num_free() + 1; break;
      case 2: count = in.Byte() % 4; break;
      default: count = in.Byte() % 2 ? -1 : std::numeric_limits<int64_t>::min(); break;
    }
    std::vector<int32_t> pages = {-7};
    const absl::Status got = allocator_->Allocate(count, &pages);
    Trace("Allocate(", count, ") -> ", got.ToString());
    const Code want = count < 0                     ? Code::kInvalidArgument
                      : count > model_.num_free()   ? Code::kResourceExhausted
                                                    : Code::kOk;
    FUZZ_CHECK(got.code() == want, "Allocate(", count, "): ", got.ToString(), ", model ", absl::StatusCodeToString(want));
    FUZZ_CHECK(pages.front() == -7, "Allocate overwrote the caller's vector");
    if (!got.ok()) {
      FUZZ_CHECK(pages.size() == 1, "a failed Allocate returned pages");
      return;
    }
    FUZZ_CHECK(static_cast<int64_t>(pages.size()) == count + 1, "Allocate(", count, ") gave ",
               pages.size() - 1);
    const std::vector<int64_t> fresh = model_.AllocateExternal(count);
    for (size_t i = 0; i < fresh.size(); ++i) {
      Bind(fresh[i], pages[i + 1]);
      external_.push_back(fresh[i]);
    }
  }

  void UnrefExternal(FuzzInput& in) {
    if (external_.empty()) return;
    const size_t i = in.Byte() % external_.size();
    const int64_t page = external_[i];
    external_.erase(external_.begin() + i);
    const int32_t real = real_.at(page);
    const bool want = model_.UnrefExternal(page);
    const absl::StatusOr<bool> got = allocator_->Unref(real);
    Trace("Unref(", real, ") -> ", got.status().ToString());
    FUZZ_CHECK(got.ok() && *got == want, "Unref(", real, "): ", got.status().ToString(), " freed ",
               got.ok() && *got, ", model ", want);
    Unbind(model_.TakeFreed());
  }

  // One outside reference to a page a sequence holds: its next step must copy on write.
  void AddRefExternal(FuzzInput& in) {
    const auto& seqs = model_.sequences();
    if (seqs.empty()) return;
    auto it = seqs.begin();
    std::advance(it, in.Byte() % seqs.size());
    const std::vector<int64_t>& pages = it->second.pages;
    if (pages.empty()) return;
    const int64_t page = in.Byte() % 2 ? pages.back() : pages[in.Byte() % pages.size()];
    const absl::Status got = allocator_->AddRef(real_.at(page));
    Trace("AddRef(", real_.at(page), ") -> ", got.ToString());
    FUZZ_CHECK(got.ok(), "AddRef(", real_.at(page), "): ", got.ToString());
    model_.AddRefExternal(page);
    external_.push_back(page);
  }

  // AddRef / Unref / ref_count of an id out of range or of a free page: an error, nothing changes.
  void BadPage(FuzzInput& in) {
    int32_t page;
    Code want;
    const uint8_t how = in.Byte() % 4;
    if (how == 3) {
      page = -1;
      for (int32_t p = 0; p < model_.num_pages(); ++p) {
        if (!abstract_.contains(p)) {
          page = p;
          break;
        }
      }
      if (page < 0) return;  // nothing free
      want = Code::kFailedPrecondition;
    } else {
      static constexpr int32_t kOut[] = {-1, std::numeric_limits<int32_t>::min(),
                                         std::numeric_limits<int32_t>::max()};
      page = how == 0 ? static_cast<int32_t>(model_.num_pages()) : kOut[in.Byte() % 3];
      want = Code::kInvalidArgument;
    }
    FUZZ_CHECK(allocator_->ref_count(page) == 0, "ref_count(", page, ")");
    const absl::Status add = allocator_->AddRef(page);
    FUZZ_CHECK(add.code() == want, "AddRef(", page, "): ", add.ToString(), ", model ", absl::StatusCodeToString(want));
    const absl::StatusOr<bool> unref = allocator_->Unref(page);
    FUZZ_CHECK(unref.status().code() == want, "Unref(", page, "): ", unref.status().ToString(),
               ", model ", absl::StatusCodeToString(want));
  }

  std::vector<int64_t> Pages(uint64_t id) const {
    const KvModel::Seq* seq = model_.Find(id);
    return seq == nullptr ? std::vector<int64_t>{} : seq->pages;
  }

  void Bind(int64_t page, int32_t real) {
    auto known = real_.find(page);
    if (known != real_.end()) {
      FUZZ_CHECK(known->second == real, "model page ", page, " is real page ", known->second,
                 ", now seen as ", real);
      return;
    }
    FUZZ_CHECK(real >= 0 && real < model_.num_pages(), "page id ", real, " out of range");
    auto other = abstract_.find(real);
    FUZZ_CHECK(other == abstract_.end(), "real page ", real, " holds model pages ", other->second,
               " and ", page, " at once");
    real_[page] = real;
    abstract_[real] = page;
  }

  void Unbind(const std::vector<int64_t>& freed) {
    for (int64_t page : freed) {
      auto it = real_.find(page);
      if (it == real_.end()) continue;
      abstract_.erase(it->second);
      real_.erase(it);
    }
  }

  void BindSequence(uint64_t id) {
    const KvModel::Seq* seq = model_.Find(id);
    const absl::StatusOr<SequenceTable::View> view = table_->Get(id);
    FUZZ_CHECK(view.ok() == (seq != nullptr), "Get(", id, "): ", view.status().ToString());
    if (seq == nullptr) return;
    FUZZ_CHECK(view->length == seq->length && view->step_tokens == seq->step_tokens &&
                   view->next_layer == seq->next_layer,
               "sequence ", id, ": length ", view->length, " step ", view->step_tokens, " next ",
               view->next_layer, "; model ", seq->length, " ", seq->step_tokens, " ",
               seq->next_layer);
    FUZZ_CHECK(view->pages.size() == seq->pages.size(), "sequence ", id, " holds ",
               view->pages.size(), " pages, model ", seq->pages.size());
    for (size_t i = 0; i < seq->pages.size(); ++i) Bind(seq->pages[i], view->pages[i]);
  }

  void Verify() {
    Unbind(model_.TakeFreed());
    FUZZ_CHECK(table_->num_sequences() == static_cast<int64_t>(model_.sequences().size()),
               "sequences ", table_->num_sequences(), ", model ", model_.sequences().size());
    FUZZ_CHECK(table_->total_tokens() == model_.total_tokens(), "tokens ", table_->total_tokens(),
               ", model ", model_.total_tokens());
    FUZZ_CHECK(allocator_->num_free() == model_.num_free(), "free pages ", allocator_->num_free(),
               ", model ", model_.num_free());
    for (const auto& [id, seq] : model_.sequences()) BindSequence(id);
    for (const auto& [page, refs] : model_.held()) {
      auto real = real_.find(page);
      FUZZ_CHECK(real != real_.end(), "model page ", page, " held but never seen");
      FUZZ_CHECK(allocator_->ref_count(real->second) == refs, "page ", real->second, " count ",
                 allocator_->ref_count(real->second), ", model ", refs);
    }
    int64_t held = 0;
    for (int32_t p = 0; p < model_.num_pages(); ++p) held += allocator_->ref_count(p) > 0;
    FUZZ_CHECK(held == static_cast<int64_t>(model_.held().size()), held, " pages held, model ",
               model_.held().size());
  }

  void ReleaseEverything() {
    std::vector<uint64_t> ids;
    for (const auto& [id, seq] : model_.sequences()) ids.push_back(id);
    for (uint64_t id : ids) Remove(id);
    while (!external_.empty()) {
      const int64_t page = external_.back();
      external_.pop_back();
      model_.UnrefExternal(page);
      const absl::StatusOr<bool> got = allocator_->Unref(real_.at(page));
      FUZZ_CHECK(got.ok(), got.status().ToString());
    }
    Verify();
    FUZZ_CHECK(allocator_->num_free() == allocator_->num_pages(), "leak: ", allocator_->num_free(),
               " of ", allocator_->num_pages(), " pages free after releasing everything");
  }

  KvModel model_;
  std::unique_ptr<BlockAllocator> allocator_;
  std::unique_ptr<SequenceTable> table_;
  std::map<int64_t, int32_t> real_;      // live model page -> real page id
  std::map<int32_t, int64_t> abstract_;  // real page id -> live model page
  std::vector<int64_t> external_;        // outside references, one entry each
};

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedattn::fuzz::FuzzInput in(data, size);
  const int32_t num_layers = 1 + in.Byte() % 4;
  const int64_t num_pages = 1 + in.Byte() % 48;
  pagedattn::fuzz::KvOpsRun run(num_layers, num_pages);
  run.Run(in);
  return 0;
}
