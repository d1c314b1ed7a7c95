#include "tests/integration/kv_mirror.h"

#include <cmath>
#include <cstring>

#include "client/bf16.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn::testing {

namespace {

std::vector<uint16_t> ToU16(const std::string& bytes, size_t offset, size_t elems) {
  std::vector<uint16_t> out(elems);
  std::memcpy(out.data(), bytes.data() + offset, elems * 2);  // little-endian host
  return out;
}

}  // namespace

std::string RandomBf16(int64_t elems, std::mt19937_64& rng) {
  return client::RandomNormalBf16(elems, rng);
}

v1::DecodeRequest RandomDecode(uint64_t request_id, int32_t layer, const std::vector<uint64_t>& ids,
                               bool with_kv, std::mt19937_64& rng) {
  v1::DecodeRequest r;
  r.set_request_id(request_id);
  r.set_layer(layer);
  for (uint64_t id : ids) r.add_sequence_ids(id);
  const int64_t b = static_cast<int64_t>(ids.size());
  r.set_q(RandomBf16(b * kQElems, rng));
  if (with_kv) {
    r.set_k(RandomBf16(b * kKvRowElems, rng));
    r.set_v(RandomBf16(b * kKvRowElems, rng));
  }
  return r;
}

void KvMirror::Create(uint64_t id) {
  Sequence s;
  s.k.resize(num_layers_);
  s.v.resize(num_layers_);
  sequences_[id] = std::move(s);
}

void KvMirror::Fork(uint64_t parent, uint64_t child) { sequences_[child] = sequences_.at(parent); }

void KvMirror::Release(uint64_t id) { sequences_.erase(id); }

void KvMirror::Append(uint64_t id, int32_t layer, const std::string& k, const std::string& v) {
  Sequence& s = sequences_.at(id);
  const size_t elems = k.size() / 2;
  std::vector<uint16_t> kk = ToU16(k, 0, elems), vv = ToU16(v, 0, elems);
  s.k[layer].insert(s.k[layer].end(), kk.begin(), kk.end());
  s.v[layer].insert(s.v[layer].end(), vv.begin(), vv.end());
  if (layer == num_layers_ - 1) s.committed += static_cast<int64_t>(elems / kKvRowElems);
}

void KvMirror::Apply(const v1::DecodeRequest& request) {
  if (request.k().empty()) return;
  const size_t row_bytes = kKvRowElems * 2;
  for (int b = 0; b < request.sequence_ids_size(); ++b) {
    Append(request.sequence_ids(b), request.layer(), request.k().substr(b * row_bytes, row_bytes),
           request.v().substr(b * row_bytes, row_bytes));
  }
}

::testing::AssertionResult KvMirror::ApplyAndCheck(const v1::DecodeRequest& request,
                                                   const v1::DecodeResponse& response) {
  Apply(request);
  return Check(request, response);
}

::testing::AssertionResult KvMirror::Check(const v1::DecodeRequest& request,
                                           const v1::DecodeResponse& response) const {
  const int batch = request.sequence_ids_size();
  if (response.request_id() != request.request_id()) {
    return ::testing::AssertionFailure() << "request_id " << response.request_id() << " != "
                                         << request.request_id();
  }
  if (response.output().size() != static_cast<size_t>(batch * kQElems * 2) ||
      response.lse().size() != static_cast<size_t>(batch * 24 * 4)) {
    return ::testing::AssertionFailure() << "output/lse sizes " << response.output().size() << "/"
                                         << response.lse().size() << " for B=" << batch;
  }
  const std::vector<float> out = client::DecodeBf16(response.output());
  const std::vector<float> lse = client::DecodeFloat32(response.lse());
  const float scale = request.sm_scale() == 0.0f ? static_cast<float>(1.0 / std::sqrt(128.0))
                                                 : request.sm_scale();
  const bool with_kv = !request.k().empty();
  for (int b = 0; b < batch; ++b) {
    const uint64_t id = request.sequence_ids(b);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return ::testing::AssertionFailure() << "sequence " << id << " not mirrored";
    const Sequence& s = it->second;
    const std::vector<uint16_t>& layer_k = s.k[request.layer()];
    const std::vector<uint16_t>& layer_v = s.v[request.layer()];
    // A step reads every token of its layer (the new one included); attend-only, the committed.
    const int64_t tokens =
        with_kv ? static_cast<int64_t>(layer_k.size()) / kKvRowElems : s.committed;
    const int64_t pages = (tokens + 63) / 64;
    std::vector<uint16_t> k_cache(std::max<int64_t>(pages, 1) * 64 * kKvRowElems, 0);
    std::vector<uint16_t> v_cache(k_cache.size(), 0);
    if (tokens > 0) std::memcpy(k_cache.data(), layer_k.data(), tokens * kKvRowElems * 2);
    if (tokens > 0) std::memcpy(v_cache.data(), layer_v.data(), tokens * kKvRowElems * 2);
    std::vector<int32_t> indices(pages);
    for (int64_t p = 0; p < pages; ++p) indices[p] = static_cast<int32_t>(p);
    const int32_t indptr[2] = {0, static_cast<int32_t>(pages)};
    const int32_t last = tokens == 0 ? 1 : static_cast<int32_t>(tokens - 64 * (pages - 1));
    const std::vector<uint16_t> q = ToU16(request.q(), b * kQElems * 2, kQElems);

    kernels::DecodeArgs args;
    args.q = q.data();
    args.k_cache = k_cache.data();
    args.v_cache = v_cache.data();
    args.kv_indptr = indptr;
    args.kv_indices = indices.data();
    args.kv_last_page_len = &last;
    args.batch_size = 1;
    args.num_pages = std::max<int64_t>(pages, 1);
    args.sm_scale = scale;
    std::vector<double> ref_out(kQElems), ref_lse(24);
    kernels::DecodeReferenceF64(args, ref_out.data(), ref_lse.data());

    double err = 0.0, norm = 0.0;
    for (int64_t i = 0; i < kQElems; ++i) {
      const double d = out[b * kQElems + i] - ref_out[i];
      err += d * d;
      norm += ref_out[i] * ref_out[i];
    }
    if (tokens == 0) {
      if (err != 0.0) return ::testing::AssertionFailure() << "sequence " << id << ": empty, output not 0";
    } else if (!(std::sqrt(err) < 1e-2 * std::sqrt(norm))) {
      return ::testing::AssertionFailure() << "sequence " << id << " layer " << request.layer()
                                           << " (" << tokens << " tokens): output rel L2 "
                                           << std::sqrt(err / norm);
    }
    for (int h = 0; h < 24; ++h) {
      const double got = lse[b * 24 + h];
      const bool ok = tokens == 0 ? (std::isinf(got) && got < 0) : std::abs(got - ref_lse[h]) < 1e-3;
      if (!ok) {
        return ::testing::AssertionFailure() << "sequence " << id << " layer " << request.layer()
                                             << " head " << h << ": lse " << got << " vs "
                                             << ref_lse[h];
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace pagedattn::testing
