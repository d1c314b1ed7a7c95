// The transport's own price of a Decode's bytes: unary gRPC calls between two processes over
// loopback TCP (or a Unix socket) that carry opaque payloads of a Decode's request and
// response sizes, with no protobuf, no validation and no engine on either side. The server
// answers from one static buffer (no copy, no allocation per call) and the client sends one;
// both use the service's HTTP/2 settings (8 MiB stream windows, no BDP probing, 64 MiB
// messages). What a real inline Decode costs beyond the kernel and a bare round trip, set
// against the "payload" column here, is what this project's code adds (copies, protobuf,
// validation, the engine's hand-offs); the rest is gRPC's HTTP/2 and the kernel's TCP.
//
// usage: pagedattn_grpc_floor_bench [calls=2000] [unix] [stream]
// Prints, for a bare call and for the request/response sizes of an inline Decode of 1, 8 and
// 64 sequences of the default shape (with the step's new k and v), the p50 and p90 in µs and
// the p50 less the bare call's. With "stream": instead, the price of moving a migrated
// sequence's bytes: 64 MiB in messages of 2 MiB (an export's chunk size) down a stream from the
// server and up a stream to it, each the median of calls/200 (at least 5) transfers. A
// migration by bytes takes both hops (export to the caller, the caller to the importer).
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {
namespace {

namespace k = kernels;

constexpr int kWindowBytes = 8 << 20;
constexpr int kMaxMessageBytes = 64 << 20;
// Calls are named "/floor/<response bytes>", or "/stream/down/<bytes>" (the server writes that
// many bytes in kStreamMessageBytes messages) and "/stream/up" (the server reads until the
// client is done, then answers with the byte count).
constexpr char kMethodPrefix[] = "/floor/";
constexpr char kDownPrefix[] = "/stream/down/";
constexpr char kUpMethod[] = "/stream/up";
constexpr size_t kStreamMessageBytes = size_t{2} << 20;
constexpr size_t kStreamBytes = size_t{64} << 20;

// Enough for the largest response asked for; never written after start.
const std::string& Payload() {
  static const std::string* payload = new std::string(size_t{8} << 20, '\x5a');
  return *payload;
}

// `bytes` of the static payload as a message (no copy).
grpc::ByteBuffer PayloadMessage(size_t bytes) {
  grpc::Slice slice(Payload().data(), bytes, grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(&slice, 1);
}

// One call: reads the request, answers with the bytes the method name asks for.
class Echo final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Echo(grpc::GenericCallbackServerContext* context) {
    const std::string& method = context->method();
    size_t bytes = 0;
    if (method.rfind(kMethodPrefix, 0) != 0 ||
        !absl::SimpleAtoi(method.substr(sizeof(kMethodPrefix) - 1), &bytes) ||
        bytes > Payload().size()) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad method"));
      return;
    }
    response_ = PayloadMessage(bytes);
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "no request"));
      return;
    }
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_, response_;
};

// "/stream/down/<bytes>": writes the bytes in messages of kStreamMessageBytes, one at a time.
class Down final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Down(size_t bytes) : left_(bytes) { Next(); }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    if (left_ == 0) {
      Finish(grpc::Status::OK);
      return;
    }
    const size_t n = std::min(left_, kStreamMessageBytes);
    left_ -= n;
    message_ = PayloadMessage(n);
    StartWrite(&message_);
  }
  size_t left_;
  grpc::ByteBuffer message_;
};

// "/stream/up": reads messages until the client's writes are done; answers with how many bytes
// came (as the length of the one response message).
class Up final : public grpc::ServerGenericBidiReactor {
 public:
  Up() { StartRead(&message_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      // The MiB received, as the response's length.
      response_ = PayloadMessage(std::min(bytes_ >> 20, Payload().size()));
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    bytes_ += message_.Length();
    message_.Clear();
    StartRead(&message_);
  }
  void OnDone() override { delete this; }

 private:
  size_t bytes_ = 0;
  grpc::ByteBuffer message_, response_;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    const std::string& method = context->method();
    size_t bytes = 0;
    if (method == kUpMethod) return new Up();
    if (method.rfind(kDownPrefix, 0) == 0 &&
        absl::SimpleAtoi(method.substr(sizeof(kDownPrefix) - 1), &bytes)) {
      return new Down(bytes);
    }
    return new Echo(context);
  }
};

// The child: serves until killed; writes its address to `fd` once listening.
[[noreturn]] void Serve(const std::string& address, int fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kWindowBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "cannot listen on %s\n", address.c_str());
    std::_Exit(1);
  }
  const std::string bound =
      address.rfind("unix:", 0) == 0 ? address : absl::StrCat("127.0.0.1:", port);
  if (write(fd, bound.data(), bound.size()) != static_cast<ssize_t>(bound.size())) std::_Exit(1);
  close(fd);
  server->Wait();
  std::_Exit(0);
}

struct Sizes {
  std::string what;
  size_t request = 0, response = 0;
};

// An inline Decode of `b` sequences: the ids (varints of about 2 bytes), q, the step's k and v;
// its response: output and lse.
Sizes DecodeSizes(int64_t b) {
  const int64_t row = k::kTokenBytes;                 // one token's K (or V) of every KV head
  const int64_t q = k::kQueryElems * 2;                // one sequence's q, bf16
  return {absl::StrCat("Decode B=", b, " (+ k, v)"),
          static_cast<size_t>(b * (2 + q + 2 * row)),
          static_cast<size_t>(b * (q + int64_t{k::kNumQoHeads} * 4))};
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

// Unary calls of a Decode's sizes beside a bare one; returns the number of failed calls.
int DecodeFloor(grpc::GenericStub* stub, int calls, const char* via, const std::string& target) {
  std::printf("%d calls each, one at a time, over %s (%s)\n", calls, via, target.c_str());
  std::printf("%-24s %10s %10s %8s %8s %10s\n", "payload", "request B", "response B", "p50 us",
              "p90 us", "p50 - bare");
  double bare = 0;
  int failures = 0;
  for (const Sizes& s : {Sizes{"bare", 0, 0}, DecodeSizes(1), DecodeSizes(8), DecodeSizes(64)}) {
    const grpc::ByteBuffer request = PayloadMessage(s.request);
    const std::string method = absl::StrCat(kMethodPrefix, s.response);
    std::vector<double> us;
    for (int i = 0; i < calls + calls / 10; ++i) {  // the first tenth warms up
      grpc::ClientContext context;
      grpc::ByteBuffer response;
      std::promise<grpc::Status> done;
      const auto t0 = std::chrono::steady_clock::now();
      stub->UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&done](grpc::Status status) { done.set_value(std::move(status)); });
      const grpc::Status status = done.get_future().get();
      const auto t1 = std::chrono::steady_clock::now();
      if (!status.ok() || response.Length() != s.response) {
        ++failures;
        continue;
      }
      if (i >= calls / 10) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    if (us.empty()) break;
    const double p50 = Percentile(us, 0.5);
    if (s.request == 0) bare = p50;
    std::printf("%-24s %10zu %10zu %8.1f %8.1f %10.1f\n", s.what.c_str(), s.request, s.response,
                p50, Percentile(us, 0.9), p50 - bare);
  }
  return failures;
}

// One streaming transfer as the client sees it: reads every message of a down stream, or writes
// `bytes` in messages of kStreamMessageBytes up and waits for the server's answer. Returns the
// bytes that arrived on the far side (0 on failure).
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(grpc::GenericStub* stub, bool up, size_t bytes) : up_(bytes), upward_(up) {
    stub->PrepareBidiStreamingCall(&context_, up ? kUpMethod : absl::StrCat(kDownPrefix, bytes),
                                   grpc::StubOptions(), this);
    StartRead(&message_);
    if (upward_) {
      NextWrite();
    } else {
      StartWritesDone();
    }
    StartCall();
  }
  size_t Wait() {
    const grpc::Status status = done_.get_future().get();
    return status.ok() ? received_ : 0;
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    // Down: payload bytes; up: the server's count, in MiB, as the message's length.
    received_ += upward_ ? message_.Length() << 20 : message_.Length();
    message_.Clear();
    StartRead(&message_);
  }
  void OnWriteDone(bool ok) override {
    if (ok) NextWrite();
  }
  void OnDone(const grpc::Status& status) override { done_.set_value(status); }

 private:
  void NextWrite() {
    if (up_ == 0) {
      StartWritesDone();
      return;
    }
    const size_t n = std::min(up_, kStreamMessageBytes);
    up_ -= n;
    out_ = PayloadMessage(n);
    StartWrite(&out_);
  }
  grpc::ClientContext context_;
  size_t up_;
  const bool upward_;
  size_t received_ = 0;
  grpc::ByteBuffer message_, out_;
  std::promise<grpc::Status> done_;
};

// The two hops of a migration by bytes; returns the number of failed transfers.
int StreamFloor(grpc::GenericStub* stub, int transfers, const char* via,
                const std::string& target) {
  std::printf("%d transfers each way, one at a time, over %s (%s)\n", transfers, via,
              target.c_str());
  std::printf("%-24s %10s %10s %8s %8s\n", "64 MiB stream", "messages", "MiB", "p50 ms",
              "GB/s");
  int failures = 0;
  for (const bool up : {false, true}) {
    std::vector<double> ms;
    for (int i = 0; i < transfers + 1; ++i) {  // the first warms up
      const auto t0 = std::chrono::steady_clock::now();
      StreamCall call(stub, up, kStreamBytes);
      const size_t received = call.Wait();
      const auto t1 = std::chrono::steady_clock::now();
      if (received != kStreamBytes) {
        ++failures;
        continue;
      }
      if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    if (ms.empty()) continue;
    const double p50 = Percentile(ms, 0.5);
    std::printf("%-24s %10zu %10zu %8.2f %8.2f\n", up ? "up (client to server)" : "down (server to client)",
                kStreamBytes / kStreamMessageBytes, kStreamBytes >> 20, p50,
                kStreamBytes / (p50 * 1e6));
  }
  return failures;
}

int Main(int argc, char** argv) {
  const int calls = std::max(10, argc > 1 ? std::atoi(argv[1]) : 2000);
  bool unix_socket = false, stream = false;
  for (int i = 2; i < argc; ++i) {
    unix_socket |= std::string(argv[i]) == "unix";
    stream |= std::string(argv[i]) == "stream";
  }
  const std::string address =
      unix_socket ? absl::StrCat("unix:/tmp/pagedattn-floor-", getpid(), ".sock") : "127.0.0.1:0";

  // The server is forked before this process touches gRPC (gRPC does not survive a fork).
  int fds[2];
  if (pipe(fds) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(fds[0]);
    Serve(address, fds[1]);
  }
  close(fds[1]);
  char buffer[256];
  const ssize_t n = read(fds[0], buffer, sizeof(buffer));
  close(fds[0]);
  if (n <= 0) {
    std::fprintf(stderr, "the echo server did not start\n");
    return 1;
  }
  const std::string target(buffer, static_cast<size_t>(n));

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kWindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);

  const char* via = unix_socket ? "a Unix socket" : "loopback TCP";
  const int failures = stream ? StreamFloor(&stub, std::max(5, calls / 200), via, target)
                              : DecodeFloor(&stub, calls, via, target);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  if (unix_socket) unlink(address.substr(5).c_str());
  if (failures > 0) {
    std::fprintf(stderr, "%d calls failed or came back with the wrong size\n", failures);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) { return pagedattn::Main(argc, argv); }
