// Local channels with cuda regions on the real server (CUDA backend): a step through a local
// channel checked against the float64 reference, and attend-only Decodes through a local
// channel bitwise equal to the same Decodes as gRPC calls (by reference and inline). Needs a
// GPU of compute capability 9.0; skips without one (label gpu).
#include <string>
#include <vector>

#include "client/cuda_region.h"
#include "client/local_channel.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

constexpr int64_t kRegionBytes = 16 << 20;

class LocalChannelGpuTest : public IntegrationTest {
 protected:
  void SetUp() override {
    absl::StatusOr<CudaRegion> region = CudaRegion::Create(0, kRegionBytes);
    if (!region.ok()) GTEST_SKIP() << "no CUDA device: " << region.status();
    region_ = std::make_unique<CudaRegion>(*std::move(region));
  }
  void TearDown() override {
    if (client_ != nullptr && region_ != nullptr) (void)client_->UnregisterMemory("gpu");
    server_.reset();  // the server closes the handle before the memory is freed
    region_.reset();
  }

  // `bytes` placed at the next free offset of the region; its TensorRef.
  v1::TensorRef Put(const std::string& bytes) {
    v1::TensorRef ref = Reserve(bytes.size());
    EXPECT_TRUE(region_->CopyFromHost(static_cast<int64_t>(ref.offset()), bytes.data(),
                                      static_cast<int64_t>(bytes.size())).ok());
    return ref;
  }
  v1::TensorRef Reserve(size_t n) {
    v1::TensorRef ref = client::MakeTensorRef("gpu", next_, n);
    next_ = (next_ + n + 255) / 256 * 256;
    return ref;
  }
  std::string Read(const v1::TensorRef& ref) {
    std::string out(ref.byte_size(), '\0');
    EXPECT_TRUE(region_->CopyToHost(static_cast<int64_t>(ref.offset()), out.data(),
                                    static_cast<int64_t>(out.size())).ok());
    return out;
  }
  v1::DecodeRequest ByRef(const v1::DecodeRequest& inline_request) {
    v1::DecodeRequest r = inline_request;
    const size_t b = static_cast<size_t>(r.sequence_ids_size());
    *r.mutable_q_ref() = Put(std::exchange(*r.mutable_q(), ""));
    if (!r.k().empty()) *r.mutable_k_ref() = Put(std::exchange(*r.mutable_k(), ""));
    if (!r.v().empty()) *r.mutable_v_ref() = Put(std::exchange(*r.mutable_v(), ""));
    *r.mutable_output_ref() = Reserve(b * 24 * 128 * 2);
    *r.mutable_lse_ref() = Reserve(b * 24 * 4);
    return r;
  }

  std::unique_ptr<CudaRegion> region_;
  uint64_t next_ = 0;
};

TEST_F(LocalChannelGpuTest, CudaRegionsThroughALocalChannelMatchGrpcBitwise) {
  StartServer({"--backend=cuda", "--num_pages=512", "--num_layers=2"}, 2);
  for (uint64_t id = 1; id <= 4; ++id) Prefill(id, 100 + 211 * static_cast<int>(id));
  ASSERT_TRUE(client_->RegisterCudaMemory("gpu", region_->ipc_handle(), 0, kRegionBytes).ok());
  auto channel = client::LocalChannel::Open(client_.get(), {});
  ASSERT_TRUE(channel.ok()) << channel.status();

  // A step of both layers through the channel, against the reference.
  for (int32_t layer = 0; layer < 2; ++layer) {
    const v1::DecodeRequest step = RandomDecode(next_request_id_++, layer, {1, 2, 3, 4}, true, rng_);
    const v1::DecodeRequest by_ref = ByRef(step);
    auto response = (*channel)->Decode(by_ref);
    ASSERT_TRUE(response.ok()) << response.status();
    v1::DecodeResponse inlined = *response;
    inlined.set_output(Read(by_ref.output_ref()));
    inlined.set_lse(Read(by_ref.lse_ref()));
    EXPECT_TRUE(mirror_->ApplyAndCheck(step, inlined)) << "layer " << layer;
  }
  // The same attend-only Decode three ways: local channel, gRPC by reference, gRPC inline.
  for (int32_t layer = 0; layer < 2; ++layer) {
    const v1::DecodeRequest attend = RandomDecode(next_request_id_++, layer, {4, 2, 1}, false, rng_);
    const v1::DecodeRequest local_request = ByRef(attend);
    const v1::DecodeRequest grpc_request = ByRef(attend);
    auto via_local = (*channel)->Decode(local_request);
    auto via_grpc = client_->Decode(grpc_request);
    auto via_inline = client_->Decode(attend);
    ASSERT_TRUE(via_local.ok()) << via_local.status();
    ASSERT_TRUE(via_grpc.ok()) << via_grpc.status();
    ASSERT_TRUE(via_inline.ok()) << via_inline.status();
    const std::string output = Read(local_request.output_ref());
    const std::string lse = Read(local_request.lse_ref());
    EXPECT_EQ(output, Read(grpc_request.output_ref())) << "layer " << layer;
    EXPECT_EQ(lse, Read(grpc_request.lse_ref())) << "layer " << layer;
    EXPECT_EQ(output, via_inline->output()) << "layer " << layer;
    EXPECT_EQ(lse, via_inline->lse()) << "layer " << layer;
  }
  EXPECT_TRUE((*channel)->Close().ok());
}

}  // namespace
}  // namespace pagedattn::testing
