#include "client/client.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpc/support/time.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace pagedattn::client {

using Stub = v1::PagedAttention::Stub;

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

v1::TensorRef MakeTensorRef(const std::string& region, uint64_t offset, uint64_t byte_size) {
  v1::TensorRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

absl::Status ResponseStatus(const v1::DecodeResponse& response) {
  if (response.error_code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(response.error_code()),
                      response.error_message());
}

DecodeStream::DecodeStream(
    std::unique_ptr<grpc::ClientContext> context,
    std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream)
    : context_(std::move(context)), stream_(std::move(stream)) {}

bool DecodeStream::Write(const v1::DecodeRequest& request) { return stream_->Write(request); }

bool DecodeStream::Read(v1::DecodeResponse* response) { return stream_->Read(response); }

bool DecodeStream::WritesDone() {
  if (writes_done_) return true;
  writes_done_ = true;
  return stream_->WritesDone();
}

absl::Status DecodeStream::Finish() {
  WritesDone();
  return FromGrpcStatus(stream_->Finish());
}

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream content;
  if (in) content << in.rdbuf();
  if (!in || in.bad()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  return content.str();
}

// An exported chunk as an import chunk of `sequence_id`, all but its k and v: the first also
// names the new sequence, its length, and the pages' type and fp8 scales.
v1::ImportSequenceChunk ImportHeader(const v1::ExportSequenceChunk& c, uint64_t sequence_id,
                                     bool first) {
  v1::ImportSequenceChunk out;
  if (first) {
    out.set_sequence_id(sequence_id);
    out.set_length(c.length());
    out.set_kv_cache_dtype(c.kv_cache_dtype());
    *out.mutable_k_scale() = c.k_scale();
    *out.mutable_v_scale() = c.v_scale();
  }
  out.set_layer(c.layer());
  out.set_first_token(c.first_token());
  out.set_num_tokens(c.num_tokens());
  if (c.has_k_ref()) *out.mutable_k_ref() = c.k_ref();
  if (c.has_v_ref()) *out.mutable_v_ref() = c.v_ref();
  return out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options) {
  const bool tls = options.tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
                   !options.tls_key_file.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs its key (and the other way round)");
  }
  grpc::SslCredentialsOptions ssl;
  for (auto [path, pem] : {std::pair{&options.tls_ca_file, &ssl.pem_root_certs},
                           std::pair{&options.tls_cert_file, &ssl.pem_cert_chain},
                           std::pair{&options.tls_key_file, &ssl.pem_private_key}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> content = ReadPem(*path);
    if (!content.ok()) return content.status();
    *pem = *std::move(content);
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  if (options.max_message_bytes < 1024 ||
      options.max_message_bytes > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1024, 2^31), got ",
                                                   options.max_message_bytes));
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFor(options);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  if (options.http2_window_bytes > 0) {
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.http2_window_bytes);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  if (options.http2_max_frame_bytes > 0) args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, options.http2_max_frame_bytes);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(options.target, *credentials, args);
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

Client::Client(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::PagedAttention::NewStub(channel_)) {}

absl::Status Client::WaitForConnected(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat("not connected to ", options_.target, " within ", absl::FormatDuration(timeout)));
}

void Client::Authorize(grpc::ClientContext* context) const {
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

std::unique_ptr<grpc::ClientContext> Client::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  Authorize(context.get());
  if (options_.timeout > absl::ZeroDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  }
  context->set_wait_for_ready(options_.wait_for_ready);
  return context;
}

namespace {

// The completion queue of this thread's busy-polled calls, reused from call to call. A thread
// has at most one such call in flight, so the next event on it is that call's.
class PollQueue {
 public:
  ~PollQueue() {
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
    }
  }
  grpc::CompletionQueue* get() { return &queue_; }

 private:
  grpc::CompletionQueue queue_;
};

grpc::CompletionQueue* ThreadPollQueue() {
  thread_local PollQueue queue;
  return queue.get();
}

}  // namespace

template <typename Request, typename Response>
grpc::Status Client::Unary(
    grpc::Status (Stub::*call)(grpc::ClientContext*, const Request&, Response*),
    std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> (Stub::*prepare)(
        grpc::ClientContext*, const Request&, grpc::CompletionQueue*),
    const Request& request, Response* response) {
  const std::unique_ptr<grpc::ClientContext> context = NewContext();
  if (!options_.busy_poll) return (stub_.get()->*call)(context.get(), request, response);
  grpc::CompletionQueue* const queue = ThreadPollQueue();
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader =
      (stub_.get()->*prepare)(context.get(), request, queue);
  reader->StartCall();
  grpc::Status status;
  reader->Finish(response, &status, reader.get());
  void* tag = nullptr;
  bool ok = false;
  // A zero deadline: each turn polls the call's connection without blocking.
  while (queue->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) !=
         grpc::CompletionQueue::GOT_EVENT) {
  }
  return status;
}

absl::StatusOr<v1::GetModelConfigResponse> Client::GetModelConfig() {
  v1::GetModelConfigResponse response;
  grpc::Status status = Unary(&Stub::GetModelConfig, &Stub::PrepareAsyncGetModelConfig,
      v1::GetModelConfigRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status Client::CreateSequence(uint64_t sequence_id) {
  v1::CreateSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::CreateSequenceResponse response;
  return FromGrpcStatus(Unary(&Stub::CreateSequence, &Stub::PrepareAsyncCreateSequence,
      request, &response));
}

absl::StatusOr<int64_t> Client::AppendKV(uint64_t sequence_id, int32_t layer, int32_t num_tokens,
                                         std::string k, std::string v) {
  v1::AppendKVRequest request;
  request.set_sequence_id(sequence_id);
  request.set_layer(layer);
  request.set_num_tokens(num_tokens);
  request.set_k(std::move(k));
  request.set_v(std::move(v));
  return AppendKV(request);
}

absl::StatusOr<int64_t> Client::AppendKV(const v1::AppendKVRequest& request) {
  v1::AppendKVResponse response;
  grpc::Status status = Unary(&Stub::AppendKV, &Stub::PrepareAsyncAppendKV, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.length();
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(const v1::DecodeRequest& request) {
  v1::DecodeResponse response;
  grpc::Status status = Unary(&Stub::Decode, &Stub::PrepareAsyncDecode, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status Client::ForkSequence(uint64_t parent_id, uint64_t child_id) {
  v1::ForkSequenceRequest request;
  request.set_parent_id(parent_id);
  request.set_child_id(child_id);
  v1::ForkSequenceResponse response;
  return FromGrpcStatus(Unary(&Stub::ForkSequence, &Stub::PrepareAsyncForkSequence,
      request, &response));
}

absl::Status Client::ReleaseSequence(uint64_t sequence_id) {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::ReleaseSequenceResponse response;
  return FromGrpcStatus(Unary(&Stub::ReleaseSequence, &Stub::PrepareAsyncReleaseSequence,
      request, &response));
}

absl::StatusOr<v1::GetStatsResponse> Client::GetStats() {
  v1::GetStatsResponse response;
  grpc::Status status = Unary(&Stub::GetStats, &Stub::PrepareAsyncGetStats,
      v1::GetStatsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<std::vector<v1::ExportSequenceChunk>> Client::ExportSequence(
    uint64_t sequence_id, const std::optional<v1::TensorRef>& destination) {
  auto context = NewContext();
  v1::ExportSequenceRequest request;
  request.set_sequence_id(sequence_id);
  if (destination.has_value()) *request.mutable_destination() = *destination;
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceChunk>> reader =
      stub_->ExportSequence(context.get(), request);
  std::vector<v1::ExportSequenceChunk> chunks;
  v1::ExportSequenceChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(std::move(chunk));
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return chunks;
}

absl::StatusOr<int64_t> Client::ImportSequence(uint64_t sequence_id,
                                               const std::vector<v1::ExportSequenceChunk>& chunks) {
  std::vector<v1::ImportSequenceChunk> converted;
  converted.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::ExportSequenceChunk& c = chunks[i];
    v1::ImportSequenceChunk& out = converted.emplace_back(ImportHeader(c, sequence_id, i == 0));
    out.set_k(c.k());
    out.set_v(c.v());
  }
  return ImportChunks(converted);
}

absl::StatusOr<int64_t> Client::ImportChunks(const std::vector<v1::ImportSequenceChunk>& chunks) {
  auto context = NewContext();
  v1::ImportSequenceResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSequenceChunk>> writer =
      stub_->ImportSequence(context.get(), &response);
  for (const v1::ImportSequenceChunk& c : chunks) {
    if (!writer->Write(c)) break;  // the server finished early: Finish says why
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return response.length();
}

absl::StatusOr<int64_t> Client::CopySequenceTo(uint64_t sequence_id, Client& destination,
                                               int64_t* bytes,
                                               const std::optional<v1::TensorRef>& via) {
  auto from_context = NewContext();
  auto to_context = destination.NewContext();
  v1::ExportSequenceRequest request;
  request.set_sequence_id(sequence_id);
  if (via.has_value()) *request.mutable_destination() = *via;
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceChunk>> reader =
      stub_->ExportSequence(from_context.get(), request);
  v1::ImportSequenceResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSequenceChunk>> writer =
      destination.stub()->ImportSequence(to_context.get(), &response);
  int64_t moved = 0;
  bool first = true;
  bool refused = false;  // the destination finished its import early
  v1::ExportSequenceChunk chunk;
  while (reader->Read(&chunk)) {
    v1::ImportSequenceChunk out = ImportHeader(chunk, sequence_id, first);
    first = false;
    moved += static_cast<int64_t>(chunk.k().size() + chunk.v().size() +
                                  chunk.k_ref().byte_size() + chunk.v_ref().byte_size());
    out.set_allocated_k(chunk.release_k());
    out.set_allocated_v(chunk.release_v());
    if (!writer->Write(out)) {
      refused = true;
      from_context->TryCancel();
      while (reader->Read(&chunk)) {}
      break;
    }
  }
  const grpc::Status exported = reader->Finish();
  if (!refused && !exported.ok()) {
    to_context->TryCancel();
    (void)writer->Finish();
    return FromGrpcStatus(exported);
  }
  writer->WritesDone();
  grpc::Status imported = writer->Finish();
  if (!imported.ok()) return FromGrpcStatus(imported);
  if (bytes != nullptr) *bytes = moved;
  return response.length();
}

absl::Status Client::OffloadSequence(uint64_t sequence_id) {
  v1::OffloadSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::OffloadSequenceResponse response;
  return FromGrpcStatus(Unary(&Stub::OffloadSequence, &Stub::PrepareAsyncOffloadSequence,
      request, &response));
}

absl::Status Client::RegisterSystemMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  v1::RegisterSystemMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSystemMemoryResponse response;
  return FromGrpcStatus(Unary(&Stub::RegisterSystemMemory, &Stub::PrepareAsyncRegisterSystemMemory,
      request, &response));
}

absl::Status Client::RegisterCudaMemory(const std::string& name, const std::string& raw_handle,
                                        int32_t device_id, uint64_t byte_size) {
  v1::RegisterCudaMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle);
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  v1::RegisterCudaMemoryResponse response;
  return FromGrpcStatus(Unary(&Stub::RegisterCudaMemory, &Stub::PrepareAsyncRegisterCudaMemory,
      request, &response));
}

absl::Status Client::UnregisterMemory(const std::string& name) {
  v1::UnregisterMemoryRequest request;
  request.set_name(name);
  v1::UnregisterMemoryResponse response;
  return FromGrpcStatus(Unary(&Stub::UnregisterMemory, &Stub::PrepareAsyncUnregisterMemory,
      request, &response));
}

absl::StatusOr<std::vector<v1::MemoryRegion>> Client::ListMemory() {
  v1::ListMemoryResponse response;
  grpc::Status status = Unary(&Stub::ListMemory, &Stub::PrepareAsyncListMemory,
      v1::ListMemoryRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<v1::MemoryRegion>(response.regions().begin(), response.regions().end());
}

std::unique_ptr<DecodeStream> Client::OpenDecodeStream() {
  auto context = std::make_unique<grpc::ClientContext>();
  Authorize(context.get());
  context->set_wait_for_ready(options_.wait_for_ready);
  auto stream = stub_->DecodeStream(context.get());
  return std::make_unique<DecodeStream>(std::move(context), std::move(stream));
}

absl::StatusOr<std::vector<v1::DecodeResponse>> Client::DecodeAll(
    const std::vector<v1::DecodeRequest>& requests) {
  std::unique_ptr<DecodeStream> stream = OpenDecodeStream();
  std::thread writer([&] {
    for (const v1::DecodeRequest& r : requests) {
      if (!stream->Write(r)) break;
    }
    stream->WritesDone();
  });
  std::vector<v1::DecodeResponse> responses;
  v1::DecodeResponse response;
  while (stream->Read(&response)) responses.push_back(std::move(response));
  writer.join();
  if (absl::Status s = stream->Finish(); !s.ok()) return s;
  return responses;
}

}  // namespace pagedattn::client
