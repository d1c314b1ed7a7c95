// Local channels with cuda regions on the real server (CUDA backend): a step through a local
// channel checked against the float64 reference, attend-only Decodes through a local channel
// bitwise equal to the same Decodes as gRPC calls (by reference and inline), and layers queued
// on the caller's GPU through the sync words (gpu_sync). Needs a GPU of compute capability
// 9.0; skips without one (label gpu).
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "client/cuda_region.h"
#include "client/gpu_sync.h"
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

// Layers queued on the caller's GPU: every layer's q goes through one shared buffer that the
// caller's stream fills only after the previous layer's output is written, and every output
// through one shared buffer that the stream copies away once its done word says so. If the
// server read q before the ready word, or signalled done before the output, a layer would see
// another layer's q or leave another's output: each is checked against the reference.
TEST_F(LocalChannelGpuTest, GpuSyncedLayersQueueOnTheDeviceInOrder) {
  constexpr int32_t kLayers = 6;
  StartServer({"--backend=cuda", "--num_pages=512", absl::StrCat("--num_layers=", kLayers)}, kLayers);
  const std::vector<uint64_t> ids = {1, 2, 3};
  for (uint64_t id : ids) Prefill(id, 300 + 77 * static_cast<int>(id));
  ASSERT_TRUE(client_->RegisterCudaMemory("gpu", region_->ipc_handle(), 0, kRegionBytes).ok());
  auto channel = client::LocalChannel::Open(client_.get(), {.gpu_sync = true});
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto sync = client::GpuSync::Map(channel->get(), 0);
  ASSERT_TRUE(sync.ok()) << sync.status();
  auto stream = static_cast<cudaStream_t>((*sync)->stream());

  const size_t q_bytes = ids.size() * 24 * 128 * 2;
  const size_t out_bytes = q_bytes;
  const v1::TensorRef shared_q = Reserve(q_bytes);
  const v1::TensorRef shared_out = Reserve(out_bytes);
  std::vector<v1::DecodeRequest> steps, sent;
  std::vector<v1::TensorRef> staged_q, saved_out, saved_lse;
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    steps.push_back(RandomDecode(next_request_id_++, layer, ids, true, rng_));
    v1::DecodeRequest r = ByRef(steps.back());
    staged_q.push_back(r.q_ref());  // this layer's q, put there now; copied in on the device
    *r.mutable_q_ref() = shared_q;
    *r.mutable_output_ref() = shared_out;
    saved_out.push_back(Reserve(out_bytes));
    saved_lse.push_back(r.lse_ref());
    sent.push_back(std::move(r));
  }
  char* const base = region_->data();
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    const uint64_t n = (*channel)->next_submission();
    ASSERT_EQ(cudaMemcpyAsync(base + shared_q.offset(), base + staged_q[layer].offset(), q_bytes,
                              cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    ASSERT_TRUE((*sync)->MarkReady(nullptr, n).ok());
    ASSERT_TRUE((*channel)->Submit(sent[layer], local::kSubmitWaitReady | local::kSubmitSignalDone).ok());
    ASSERT_TRUE((*sync)->WaitDone(nullptr, n).ok());
    ASSERT_EQ(cudaMemcpyAsync(base + saved_out[layer].offset(), base + shared_out.offset(), out_bytes,
                              cudaMemcpyDeviceToDevice, stream), cudaSuccess);
  }
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    auto done = (*channel)->Next(absl::Seconds(30));
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->request_id, sent[layer].request_id());
    EXPECT_TRUE(done->status.ok()) << done->status;
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    v1::DecodeResponse response;
    response.set_request_id(sent[layer].request_id());
    response.set_output(Read(saved_out[layer]));
    response.set_lse(Read(saved_lse[layer]));
    EXPECT_TRUE(mirror_->ApplyAndCheck(steps[layer], response)) << "layer " << layer;
  }
  sync->reset();
  EXPECT_TRUE((*channel)->Close().ok());
}

// A caller that asks the server to wait for its ready word and never writes it: after
// --local_gpu_sync_timeout_ms the server writes the word itself and breaks the channel; the
// step completes, and the server goes on serving others.
TEST_F(LocalChannelGpuTest, ACallerThatNeverSignalsIsCutOffAfterTheTimeout) {
  StartServer({"--backend=cuda", "--num_pages=512", "--local_gpu_sync_timeout_ms=300"}, 1);
  Prefill(1, 200);
  Prefill(2, 90);
  ASSERT_TRUE(client_->RegisterCudaMemory("gpu", region_->ipc_handle(), 0, kRegionBytes).ok());
  auto channel = client::LocalChannel::Open(client_.get(), {.gpu_sync = true});
  ASSERT_TRUE(channel.ok()) << channel.status();
  const v1::DecodeRequest attend = ByRef(RandomDecode(next_request_id_++, 0, {1}, false, rng_));
  const absl::Time start = absl::Now();
  ASSERT_TRUE((*channel)->Submit(attend, local::kSubmitWaitReady | local::kSubmitSignalDone).ok());
  auto done = (*channel)->Next(absl::Seconds(30));
  ASSERT_TRUE(done.ok() || absl::IsUnavailable(done.status()) || absl::IsDataLoss(done.status()))
      << done.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  // The server is healthy and serves a gRPC caller.
  const v1::DecodeRequest other = RandomDecode(next_request_id_++, 0, {2}, false, rng_);
  auto response = client_->Decode(other);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(other, *response));
  EXPECT_EQ(std::atomic_ref<uint32_t>((*channel)->segment()->state).load(), local::kBroken);
}

}  // namespace
}  // namespace pagedattn::testing
