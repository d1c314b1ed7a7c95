// Fuzz target: the server's end of a local channel (ChannelRings, ToDecodeRequest and the
// Decode validation) against a hostile caller that writes any bytes into submission slots and
// any values into the counters it owns (submit_tail, complete_head), between the server's
// takes and completions.
//
// Checked: nothing is read or written outside the segment (ASan); a taken descriptor becomes a
// request with at most kMaxSequences ids and names of at most kRegionNameBytes bytes, or an
// error; the server never has more completions owed than the completion ring can hold; while
// the caller's counters stay possible, every accepted submission's completion is written (none
// lost); an impossible counter breaks the channel for good (it never reopens).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>

#include "server/local/channel_rings.h"
#include "server/local/descriptor.h"
#include "server/local/ring_layout.h"
#include "server/service/validation.h"
#include "tests/fuzz/fuzz_input.h"

namespace pagedattn::fuzz {
namespace {

using local::ChannelRings;

struct Segment {
  explicit Segment(uint64_t bytes) : bytes(bytes) {
    base = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(base, 0, bytes);
  }
  ~Segment() { std::free(base); }
  char* base;
  uint64_t bytes;
};

ModelConfig Config() {
  ModelConfig c;
  c.num_qo_heads = 24;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.page_size = 16;
  c.num_layers = 2;
  c.num_pages = 64;
  c.max_batch_size = 64;
  c.backend = "cpu";
  return c;
}

uint64_t U64(FuzzInput& in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{in.Byte()} << (8 * i);
  return v;
}

void Run(FuzzInput& in) {
  const uint8_t shape = in.Byte();
  const uint32_t sc = 1u << (shape & 3);
  const uint32_t cc = 1u << ((shape >> 2) & 3);
  const bool gpu_sync = (shape & 16) != 0;
  const uint64_t segment_bytes = local::SegmentBytes(sc, cc, gpu_sync);
  Segment segment(segment_bytes);
  ChannelRings rings(segment.base, sc, cc, gpu_sync);
  local::SegmentHeader* h = rings.header();
  auto* slots = reinterpret_cast<local::SubmitSlot*>(segment.base + h->submit_offset);
  const ModelConfig config = Config();

  std::deque<uint64_t> owed;       // accepted, completion not yet written
  uint64_t written = 0;            // completions published while the caller stayed honest
  uint64_t consumed = 0;           // the caller's completion head, while honest
  bool honest = true;              // the caller never wrote an impossible counter
  bool broken = false;
  v1::DecodeRequest request;

  while (!in.empty()) {
    switch (in.Byte() % 7) {
      case 0: {  // raw bytes into a slot
        local::SubmitSlot& slot = slots[in.Byte() % sc];
        const size_t at = in.U16() % sizeof(slot);
        const std::string_view bytes = in.Bytes(in.Byte());
        std::memcpy(reinterpret_cast<char*>(&slot) + at, bytes.data(),
                    std::min(bytes.size(), sizeof(slot) - at));
        break;
      }
      case 1: {  // a plausible descriptor into the next slot, then publish it
        const uint64_t tail = h->submit_tail;
        local::SubmitSlot& slot = slots[tail % sc];
        slot.request_id = tail;
        slot.layer = static_cast<int8_t>(in.Byte());
        slot.flags = in.Byte() < 16 ? 1 : 0;
        slot.num_sequences = in.Byte() < 8 ? U64(in) : in.Byte() % 70;
        const uint8_t name = in.Byte();
        for (local::RefSlot* ref : {&slot.q, &slot.k, &slot.v, &slot.output, &slot.lse}) {
          std::memset(ref->region, (name & 1) ? 'r' : 0, (name >> 1) % 2 ? local::kRegionNameBytes : 4);
          ref->offset = in.U16() * 16u;
          ref->byte_size = in.U16();
        }
        if (honest && tail - h->submit_head < sc) h->submit_tail = tail + 1;
        break;
      }
      case 2: {  // the submission tail: a small step, or anything
        const uint8_t how = in.Byte();
        if (how < 200) {
          h->submit_tail += how % 3;
        } else {
          h->submit_tail = U64(in);
        }
        if (h->submit_tail - h->submit_head > sc) honest = false;
        break;
      }
      case 3: {  // the completion head: consume what was written, or write anything
        const uint8_t how = in.Byte();
        if (how < 200) {
          if (honest && consumed < h->complete_tail) h->complete_head = ++consumed;
        } else {
          h->complete_head = U64(in);
          honest = false;
        }
        break;
      }
      case 4:
      case 5: {  // the server takes
        const int64_t reserved_before = rings.reserved();
        const auto result = rings.Take(1 + in.Byte() % 4, [&](const local::SubmitSlot& slot) {
          const absl::Status s = local::ToDecodeRequest(slot, gpu_sync, &request);
          if (gpu_sync) {  // the submission's sync words lie in the segment's sync area
            const uint64_t n = rings.taken() - 1;
            for (const uint32_t* w : {rings.ready_word(n), rings.done_word(n)}) {
              const char* p = reinterpret_cast<const char*>(w);
              FUZZ_CHECK(p >= segment.base + local::SyncOffset(sc, cc) &&
                             p + sizeof(uint32_t) <= segment.base + segment_bytes,
                         "sync word");
            }
          } else {
            FUZZ_CHECK(rings.ready_word(0) == nullptr, "sync words without gpu_sync");
            FUZZ_CHECK(slot.flags == 0 || !s.ok(), "sync flags accepted without gpu_sync");
          }
          if (s.ok()) {
            FUZZ_CHECK(request.sequence_ids_size() <= static_cast<int>(local::kMaxSequences), "ids");
            for (const v1::TensorRef* ref : {&request.q_ref(), &request.output_ref()}) {
              FUZZ_CHECK(ref->region().size() <= local::kRegionNameBytes, "name");
            }
            (void)ToDecodeWork(request, config, nullptr);  // no regions: NOT_FOUND at most
          }
          owed.push_back(slot.request_id);
        });
        if (result == ChannelRings::TakeResult::kBroken) broken = true;
        if (broken) {
          FUZZ_CHECK(rings.state() == local::kBroken, "state");
        }
        FUZZ_CHECK(rings.reserved() == static_cast<int64_t>(owed.size()),
                   absl::StrCat(rings.reserved(), " reserved, ", owed.size(), " owed, before ",
                                reserved_before));
        FUZZ_CHECK(static_cast<int64_t>(owed.size()) <= static_cast<int64_t>(cc), "owed");
        break;
      }
      case 6: {  // a completion
        if (owed.empty()) break;
        const uint64_t id = owed.front();
        owed.pop_front();
        const uint64_t tail_before = h->complete_tail;
        rings.Complete(id, static_cast<int32_t>(in.Byte() % 17), in.Bytes(in.Byte()));
        if (rings.state() == local::kBroken) broken = true;
        if (honest && !broken) {
          FUZZ_CHECK(h->complete_tail == tail_before + 1, "a completion was lost");
          ++written;
        }
        break;
      }
    }
    if (broken) FUZZ_CHECK(rings.state() == local::kBroken && h->state == local::kBroken, "broken");
    if (honest) FUZZ_CHECK(!broken, "an honest caller's channel broke");
  }
  rings.Close(true);
  FUZZ_CHECK(rings.state() != local::kOpen, "closed");
  (void)written;
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedattn::fuzz::FuzzInput in(data, size);
  pagedattn::fuzz::Run(in);
  return 0;
}
