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

// Tensors by reference (request_fuzzer.cc registers "fz-a" = object A [0, 256 KiB), "fz-a-mid"
// = object A [64 KiB, 200 KiB) and "fz-b" = object B [0, 48 KiB)). Sizes: q and output 6144 B
// per sequence, Decode k / v 1024 B per sequence, lse 96 B per sequence, AppendKV k / v 1024 B
// per token.
constexpr uint64_t kQ = 6144, kKv = 1024, kLse = 96;

void SetRef(v1::TensorRef* ref, const std::string& region, uint64_t offset, uint64_t size) {
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(size);
}

v1::AppendKVRequest RefAppend(uint64_t id, int32_t layer, int32_t tokens) {
  v1::AppendKVRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  r.set_num_tokens(tokens);
  return r;
}

v1::DecodeRequest RefDecode(std::initializer_list<uint64_t> ids, int32_t layer) {
  v1::DecodeRequest r;
  r.set_request_id(91);
  r.set_layer(layer);
  for (uint64_t id : ids) r.add_sequence_ids(id);
  return r;
}

void RefSeeds(const std::filesystem::path& dir) {
  // Valid references: appends with k / v from regions, decode steps and attend-only decodes
  // reading q / k / v from regions and writing output / lse into them, an empty sequence's
  // zeros and -inf in a region, queued decodes whose outputs share a region.
  Records valid;
  valid.Create(1).Create(2);
  {
    v1::AppendKVRequest r = RefAppend(1, 0, 3);
    SetRef(r.mutable_k_ref(), "fz-a", 0, 3 * kKv);
    SetRef(r.mutable_v_ref(), "fz-b", 4096, 3 * kKv);
    valid.Add(kAppend, r);
    r = RefAppend(1, 1, 3);
    r.set_k(std::string("\x3e\x3f\xbe\x3f", 4));  // fitted: stretched to 3 tokens
    SetRef(r.mutable_v_ref(), "fz-a-mid", 128, 3 * kKv);
    valid.Add(kAppend | kFit, r);
  }
  {
    v1::DecodeRequest r = RefDecode({1}, 0);  // a step at layer 0, everything by reference
    SetRef(r.mutable_q_ref(), "fz-a", 0, kQ);
    SetRef(r.mutable_k_ref(), "fz-b", 0, kKv);
    SetRef(r.mutable_v_ref(), "fz-b", 0, kKv);  // inputs may overlap
    SetRef(r.mutable_output_ref(), "fz-b", 8192, kQ);
    SetRef(r.mutable_lse_ref(), "fz-a", 16384, kLse);
    valid.Add(kDecode, r);
    r = RefDecode({1}, 1);  // the step's last layer: the results are checked against a rerun
    SetRef(r.mutable_q_ref(), "fz-a-mid", 0, kQ);
    r.set_k(std::string("\x3d\x3f\x10\xbf", 4));  // fitted
    SetRef(r.mutable_v_ref(), "fz-a", 4096, kKv);
    SetRef(r.mutable_output_ref(), "fz-a", 65536 + 8192, kQ);  // fz-a-mid 8192: after q
    SetRef(r.mutable_lse_ref(), "fz-b", 0, kLse);
    valid.Add(kDecode | kFit, r);
    r = RefDecode({1, 2}, 0);  // attend only; sequence 2 has no tokens
    r.set_q(std::string("\x3f\x3f\x80\xbe", 4));  // fitted
    SetRef(r.mutable_output_ref(), "fz-a-mid", 16384, 2 * kQ);
    SetRef(r.mutable_lse_ref(), "fz-a-mid", 40960, 2 * kLse);
    valid.Add(kDecode | kFit, r);
    r = RefDecode({2, 1}, 1);  // output by reference only, lse in the response
    SetRef(r.mutable_q_ref(), "fz-b", 0, 2 * kQ);
    SetRef(r.mutable_output_ref(), "fz-a", 0, 2 * kQ);
    valid.Add(kDecode | kFit, r);
    r = RefDecode({1}, 0);  // lse by reference only
    SetRef(r.mutable_q_ref(), "fz-a", 100000, kQ);  // fitted to 99,984
    SetRef(r.mutable_lse_ref(), "fz-b", 1000000, 7);  // fitted into the region
    valid.Add(kDecode | kFit, r);
  }
  {
    // Queued: two decodes writing the same output range (allowed across requests), an append
    // reading where one of them writes.
    constexpr uint8_t q = kFit | kQueue;
    v1::DecodeRequest r = RefDecode({1}, 0);
    SetRef(r.mutable_q_ref(), "fz-a", 0, kQ);
    SetRef(r.mutable_output_ref(), "fz-b", 0, kQ);
    valid.Add(kDecode | q, r);
    r = RefDecode({2}, 0);
    SetRef(r.mutable_output_ref(), "fz-b", 0, kQ);
    SetRef(r.mutable_lse_ref(), "fz-b", 6144, kLse);
    valid.Add(kDecode | q, r);
    v1::AppendKVRequest a = RefAppend(2, 0, 4);
    SetRef(a.mutable_k_ref(), "fz-b", 0, 0);
    SetRef(a.mutable_v_ref(), "fz-a-mid", 0, 0);
    valid.Add(kAppend | q, a);
    a = RefAppend(2, 1, 4);
    SetRef(a.mutable_k_ref(), "fz-a", 1 << 20, 0);
    SetRef(a.mutable_v_ref(), "fz-a", 0, 0);
    valid.Add(kAppend | q, a);
    r = RefDecode({1, 2}, 1);
    SetRef(r.mutable_output_ref(), "fz-a-mid", 0, 0);
    SetRef(r.mutable_lse_ref(), "fz-b", 0, 0);
    valid.Add(kDecode | q, r);
  }
  valid.Release(1).Release(2);
  Write(dir / "seed-refs", valid.bytes());

  // Invalid references, not fitted: each must be refused with nothing changed.
  Records invalid;
  invalid.Create(1).Append(1, 0, 2).Append(1, 1, 2);
  auto decode = [&](auto&& edit) {
    v1::DecodeRequest r = RefDecode({1}, 0);
    SetRef(r.mutable_q_ref(), "fz-a", 0, kQ);
    edit(r);
    invalid.Add(kDecode, r);
  };
  decode([](v1::DecodeRequest& r) { r.mutable_q_ref()->set_region("fz-c"); });         // NOT_FOUND
  decode([](v1::DecodeRequest& r) { r.mutable_q_ref()->set_byte_size(kQ - 2); });
  decode([](v1::DecodeRequest& r) { r.mutable_q_ref()->set_offset(8); });
  decode([](v1::DecodeRequest& r) { r.mutable_q_ref()->set_offset((256 << 10) - 4096); });
  decode([](v1::DecodeRequest& r) { r.mutable_q_ref()->set_offset(~uint64_t{15}); });
  decode([](v1::DecodeRequest& r) { r.set_q(std::string(kQ, '\x3f')); });              // both ways
  decode([](v1::DecodeRequest& r) { SetRef(r.mutable_k_ref(), "fz-b", 0, kKv); });     // k, no v
  decode([](v1::DecodeRequest& r) {  // output over q, through the other name of the object
    SetRef(r.mutable_output_ref(), "fz-a-mid", 0, kQ);
    r.mutable_q_ref()->set_offset(65536 + 4096);
  });
  decode([](v1::DecodeRequest& r) {  // lse inside output
    SetRef(r.mutable_output_ref(), "fz-b", 0, kQ);
    SetRef(r.mutable_lse_ref(), "fz-b", 4096, kLse);
  });
  decode([](v1::DecodeRequest& r) {  // output over v
    SetRef(r.mutable_k_ref(), "fz-a", 8192, kKv);
    SetRef(r.mutable_v_ref(), "fz-b", 1024, kKv);
    SetRef(r.mutable_output_ref(), "fz-b", 0, kQ);
  });
  decode([](v1::DecodeRequest& r) {  // NOT_FOUND and INVALID_ARGUMENT both
    SetRef(r.mutable_output_ref(), "", 0, 0);
    r.set_sm_scale(-1.0f);
  });
  decode([](v1::DecodeRequest& r) { SetRef(r.mutable_lse_ref(), "fz-a-mid", 136 << 10, kLse); });
  {
    v1::AppendKVRequest a = RefAppend(1, 0, 1);
    SetRef(a.mutable_k_ref(), "fz-b", 0, kKv);
    invalid.Add(kAppend, a);  // v missing
    SetRef(a.mutable_v_ref(), "fz-a", 0, kKv);
    a.set_k(std::string(kKv, '\x3f'));
    invalid.Add(kAppend, a);  // k both ways
    a.clear_k();
    a.mutable_k_ref()->set_region("FZ-B");
    invalid.Add(kAppend, a);  // NOT_FOUND
    a.mutable_k_ref()->set_region("fz-b");
    a.mutable_k_ref()->set_offset((48 << 10) - 1008);
    invalid.Add(kAppend, a);  // past the end
    invalid.Raw(kParseAll, a.SerializeAsString());
  }
  invalid.Decode({1}, 1, false).Release(1);
  Write(dir / "seed-refs-invalid", invalid.bytes());
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
  RefSeeds(root / "request_validation");
  KvSeeds(root / "kv_ops");
  return 0;
}
