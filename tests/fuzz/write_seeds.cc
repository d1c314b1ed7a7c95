// Writes the hand-made seed inputs of both fuzz targets (tests/fuzz/corpus/*/seed-*):
//   fuzz_write_seeds tests/fuzz/corpus
// Each seed walks one part of the contract; the fuzzer grows the rest of the corpus from them.
// The input formats are described at the top of request_fuzzer.cc and kv_ops_fuzzer.cc.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "pagedattn/v1/pagedattn.pb.h"

namespace {

namespace v1 = pagedattn::v1;

// request_fuzzer records.
enum Kind : uint8_t { kCreate = 0, kAppend = 1, kDecode = 2, kFork = 3, kRelease = 4, kStats = 5, kParseAll = 6 };
constexpr uint8_t kFit = 0x08;
constexpr uint8_t kQueue = 0x10;

class Records {
 public:
  Records& Add(uint8_t tag, const google::protobuf::MessageLite& m) {
    const std::string payload = m.SerializeAsString();
    bytes_.push_back(static_cast<char>(tag));
    bytes_.push_back(static_cast<char>(payload.size() & 0xff));
    bytes_.push_back(static_cast<char>(payload.size() >> 8));
    bytes_ += payload;
    return *this;
  }
  Records& Create(uint64_t id) {
    v1::CreateSequenceRequest r;
    r.set_sequence_id(id);
    return Add(kCreate, r);
  }
  Records& Release(uint64_t id) {
    v1::ReleaseSequenceRequest r;
    r.set_sequence_id(id);
    return Add(kRelease, r);
  }
  Records& Fork(uint64_t parent, uint64_t child) {
    v1::ForkSequenceRequest r;
    r.set_parent_id(parent);
    r.set_child_id(child);
    return Add(kFork, r);
  }
  // A fitted append: the fuzzer sizes k and v from num_tokens.
  Records& Append(uint64_t id, int32_t layer, int32_t tokens, uint8_t extra_tag = kFit) {
    v1::AppendKVRequest r;
    r.set_sequence_id(id);
    r.set_layer(layer);
    r.set_num_tokens(tokens);
    r.set_k(std::string("\x12\x3f\x34\xbf", 4));
    return Add(kAppend | extra_tag, r);
  }
  Records& Decode(std::initializer_list<uint64_t> ids, int32_t layer, bool step, float scale = 0.0f,
                  uint8_t extra_tag = kFit) {
    v1::DecodeRequest r;
    r.set_request_id(77);
    r.set_layer(layer);
    for (uint64_t id : ids) r.add_sequence_ids(id);
    r.set_q(std::string("\x80\x3f\x00\xc0\x40\x3e", 6));
    if (step) r.set_k(std::string("\x00\x3f\x80\xbe", 4));
    r.set_sm_scale(scale);
    return Add(kDecode | extra_tag, r);
  }
  Records& Raw(uint8_t tag, const std::string& payload) {
    bytes_.push_back(static_cast<char>(tag));
    bytes_.push_back(static_cast<char>(payload.size() & 0xff));
    bytes_.push_back(static_cast<char>(payload.size() >> 8));
    bytes_ += payload;
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
}

void RequestSeeds(const std::filesystem::path& dir) {
  // Both layers of appends and decode steps, attend-only decodes, fork and copy on write.
  Write(dir / "seed-lifecycle", Records()
                                    .Create(1)
                                    .Append(1, 0, 3).Append(1, 1, 3)
                                    .Decode({1}, 0, true).Decode({1}, 1, true)
                                    .Decode({1}, 0, false).Decode({1}, 1, false, 0.5f)
                                    .Fork(1, 2)
                                    .Append(2, 0, 1).Append(2, 1, 1)
                                    .Decode({1, 2}, 0, true).Decode({1, 2}, 1, true)
                                    .Add(kStats, v1::GetStatsRequest())
                                    .Release(1).Release(2).Release(2)
                                    .bytes());
  // Appends past the pool, all or nothing, and a sequence with no tokens (zeros, lse -inf).
  Write(dir / "seed-exhaustion", Records()
                                     .Create(5).Create(6)
                                     .Append(5, 0, 127).Append(5, 1, 127)
                                     .Append(5, 0, 127).Append(5, 1, 127)
                                     .Append(5, 0, 127).Append(5, 1, 127)
                                     .Append(6, 0, 1)
                                     .Append(5, 0, 4)
                                     .Decode({5, 6}, 0, true)
                                     .Decode({6}, 1, false)
                                     .Fork(5, 7).Append(7, 0, 1)
                                     .bytes());
  // Layer order: layer 1 first, a second layer 0, a different num_tokens, fork mid-step,
  // unknown ids, duplicate ids.
  Write(dir / "seed-order", Records()
                                .Create(3).Create(3)
                                .Append(3, 1, 2)
                                .Append(3, 0, 2).Append(3, 0, 2).Append(3, 1, 1)
                                .Fork(3, 4).Decode({3}, 1, true)
                                .Append(3, 1, 2)
                                .Fork(9, 10).Append(9, 0, 1).Decode({9}, 0, false)
                                .Decode({3, 3}, 0, false)
                                .bytes());
  // Invalid shapes, not fitted: validation and the engine's own checks must refuse them.
  Records invalid;
  invalid.Create(1);
  invalid.Append(1, 0, 1, 0);                   // k of 4 bytes
  invalid.Append(1, 0, 0, kFit);                // num_tokens 0
  invalid.Append(1, -1, 1, kFit);               // layer out of range
  invalid.Append(1, 2, 1, kFit);
  invalid.Decode({1}, 0, false, 0.0f, 0);       // q of 6 bytes
  invalid.Decode({1, 2, 3, 4, 5}, 0, false);    // B > max_batch_size
  invalid.Decode({}, 0, false);                 // B = 0
  invalid.Decode({1}, 0, false, -1.0f);
  invalid.Decode({1}, 0, false, std::numeric_limits<float>::quiet_NaN());
  invalid.Decode({1}, 0, false, std::numeric_limits<float>::infinity());
  {
    v1::DecodeRequest r;  // k without v
    r.add_sequence_ids(1);
    r.set_q(std::string(6144, '\x3f'));
    r.set_k(std::string(1024, '\x3f'));
    invalid.Add(kDecode, r);
  }
  invalid.Raw(kParseAll, std::string("\x10\x01\x18\x01\x22\x02\xab\xcd", 8));
  invalid.Raw(kParseAll, std::string("\xff\xff\xff\xff", 4));  // not a message
  invalid.Raw(kCreate, std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
  invalid.Release(1);
  Write(dir / "seed-invalid", invalid.bytes());
  Write(dir / "seed-empty", "");
  // Queued work: several appends and decodes in one batch, with layers of one sequence, copy
  // on write and two softmax scales among them.
  constexpr uint8_t q = kFit | kQueue;
  Write(dir / "seed-batched", Records()
                                  .Create(1).Create(2).Create(3)
                                  .Append(1, 0, 70, q).Append(1, 1, 70, q)
                                  .Append(2, 0, 5, q).Append(3, 0, 1, q).Append(2, 1, 5, q)
                                  .Append(3, 1, 1, q)
                                  .Fork(1, 4)
                                  .Decode({1, 4}, 0, true, 0.0f, q).Decode({2, 3}, 0, true, 0.25f, q)
                                  .Decode({1, 4}, 1, true, 0.0f, q).Decode({2, 3}, 1, true, 0.25f, q)
                                  .Decode({1, 2, 3, 4}, 0, false, 0.0f, q)
                                  .Decode({4}, 1, false, 0.0f, q).Append(4, 0, 127, q)
                                  .Append(4, 1, 127, q)
                                  .bytes());
}

void KvSeeds(const std::filesystem::path& dir) {
  auto bytes = [](std::initializer_list<int> b) {
    std::string s;
    for (int x : b) s.push_back(static_cast<char>(x));
    return s;
  };
  // Header: layers = 1 + b0 % 4, pages = 1 + b1 % 48. Ops: 0 Add id, 1 Fork p c, 2 Remove id,
  // 3/4 Step id how tokens.., 5 FullStep id tokens.., 6 CheckStep id how tokens.., 7 Allocate
  // how, 8 Unref i, 9 AddRef seq how page, 10 BadPage how.., 11 Lookup id.
  // Token choices: 0 -> 1, 3 x -> 1 + x % 130, 5 lo hi -> 1 + u16 % 4000, 6 i -> odd[i].
  Write(dir / "seed-fork-cow", bytes({1, 7,
                                      0, 1,             // Add 1
                                      5, 1, 0,          // one token through both layers
                                      5, 1, 3, 99,      // 100 more
                                      1, 1, 2,          // Fork 1 -> 2 (shares a partial page)
                                      5, 2, 0,          // copy on write
                                      3, 1, 0, 0,       // layer 0 of a step on 1
                                      1, 1, 3,          // fork mid-step: FAILED_PRECONDITION
                                      3, 1, 1,          // layer 1
                                      2, 1, 2, 2, 2, 2}));
  Write(dir / "seed-exhaust", bytes({0, 3,
                                     0, 1,
                                     7, 0,             // take every free page
                                     5, 1, 0,          // RESOURCE_EXHAUSTED
                                     8, 0,             // give one back
                                     5, 1, 3, 70,      // 71 tokens need 2 pages: exhausted
                                     5, 1, 0,
                                     7, 1, 7, 3,       // more than free; negative
                                     5, 1, 5, 0xff, 0xff}));
  Write(dir / "seed-external-ref", bytes({2, 20,
                                          0, 4,
                                          5, 4, 3, 9,  // 10 tokens
                                          9, 0, 1,     // an outside reference to the last page
                                          5, 4, 0,     // copy on write
                                          6, 4, 0, 0,  // CheckStep
                                          10, 0, 10, 1, 0, 10, 3,
                                          11, 0xf8, 11, 4}));
  Write(dir / "seed-odd-steps", bytes({3, 47,
                                       0, 0, 0, 0xff,
                                       3, 0, 6, 5,      // layer out of range
                                       3, 0, 7, 1, 0,   // layer INT32_MAX
                                       3, 0, 0, 6, 6,   // INT32_MAX tokens
                                       3, 0, 0, 6, 0,   // 0 tokens
                                       3, 0, 0, 3, 63,  // 64 tokens at layer 0
                                       3, 0, 4, 3, 1,   // wrong layer / tokens mid-step
                                       4, 0, 1, 4, 0, 1, 4, 0, 1,
                                       5, 0xff, 0, 2, 0xff}));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root(argv[1]);
  std::filesystem::create_directories(root / "request_validation");
  std::filesystem::create_directories(root / "kv_ops");
  RequestSeeds(root / "request_validation");
  KvSeeds(root / "kv_ops");
  return 0;
}
