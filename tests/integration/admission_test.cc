// Admission against the real server: work whose deadline passed or whose caller went away
// (a cancelled unary call, a cancelled stream) is dropped before compute, counted in
// pagedattn_rejected_requests_total{reason}, and gives its queue slot back; nothing else
// changes. The server waits long to fill a batch (--max_queue_delay_us), so queued work stays
// queued while the test acts on it.
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/loadgen/server_metrics.h"
#include "grpcpp/client_context.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

constexpr char kWindow[] = "--max_queue_delay_us=2000000";  // 2 s to fill a batch

class AdmissionTest : public IntegrationTest {
 protected:
  void StartWithSequences(const std::vector<std::string>& flags) {
    StartServer(flags);
    Prefill(1, 100);
    Prefill(2, 10);
    before_ = Snapshot();
  }

  // One series of the server's /metrics (0 when absent).
  double Metric(const std::string& series) {
    auto scrape = loadgen::ScrapeMetrics(absl::StrCat("127.0.0.1:", server_->metrics_port()));
    EXPECT_TRUE(scrape.ok()) << scrape.status();
    if (!scrape.ok()) return -1;
    auto it = scrape->find(series);
    return it == scrape->end() ? 0 : it->second;
  }
  double Rejected(const std::string& reason) {
    return Metric(loadgen::SeriesKey("pagedattn_rejected_requests_total", {{"reason", reason}}));
  }
  double QueueDepth() { return Metric("pagedattn_queue_depth"); }

  // Polls `read` until it returns `want` (every 5 ms, up to 20 s).
  template <typename Read>
  ::testing::AssertionResult Eventually(Read read, double want, const char* what) {
    double got = read();
    for (int i = 0; i < 4000 && got != want; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
      got = read();
    }
    if (got == want) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << " is " << got << ", want " << want;
  }
};

TEST_F(AdmissionTest, WorkPastItsDeadlineIsDroppedBeforeComputeAndCounted) {
  StartWithSequences({kWindow});
  ASSERT_EQ(Rejected("deadline_exceeded"), 0);
  // A decode step with a 100 ms deadline waits in the 2 s batch window: the client sees
  // DEADLINE_EXCEEDED, and the server drops the step when the batch forms.
  client::ClientOptions options;
  options.target = server_->grpc_target();
  options.timeout = absl::Milliseconds(100);
  auto hasty = client::Client::Connect(options);
  ASSERT_TRUE(hasty.ok()) << hasty.status();
  ASSERT_TRUE((*hasty)->WaitForConnected(absl::Seconds(10)).ok());
  const v1::DecodeRequest step = RandomDecode(7, 0, {2}, true, rng_);
  EXPECT_EQ((*hasty)->Decode(step).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Eventually([&] { return Rejected("deadline_exceeded"); }, 1, "deadline_exceeded"));
  EXPECT_EQ(Rejected("cancelled"), 0);  // gRPC also cancels it; it is counted once, by its cause
  EXPECT_TRUE(Eventually([&] { return QueueDepth(); }, 0, "queue depth"));
  EXPECT_EQ(Snapshot(), before_);  // the step's token was never written
  // The same step with time to spare runs.
  DecodeAndCheck(step);
  EXPECT_EQ(Snapshot().tokens, before_.tokens + 1);
}

TEST_F(AdmissionTest, CancelledCallsGiveTheirQueueSlotsBack) {
  constexpr int kDepth = 4;
  StartWithSequences({kWindow, absl::StrCat("--max_queue_depth=", kDepth)});
  // Fill the queue with decode steps from asynchronous calls.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<v1::DecodeRequest> requests(kDepth);
  std::vector<v1::DecodeResponse> responses(kDepth);
  std::vector<grpc::Status> statuses(kDepth);
  std::vector<absl::Notification> done(kDepth);
  for (int i = 0; i < kDepth; ++i) {
    requests[i] = RandomDecode(10 + i, 0, {i % 2 == 0 ? 1u : 2u}, true, rng_);
    contexts.push_back(client_->NewContext());
    client_->stub()->async()->Decode(contexts[i].get(), &requests[i], &responses[i],
                                     [&, i](grpc::Status s) {
                                       statuses[i] = std::move(s);
                                       done[i].Notify();
                                     });
  }
  ASSERT_TRUE(Eventually([&] { return QueueDepth(); }, kDepth, "queue depth"));
  // Full: the next call is refused at once.
  EXPECT_EQ(client_->Decode(RandomDecode(20, 0, {2}, true, rng_)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Rejected("queue_full"), 1);
  for (auto& context : contexts) context->TryCancel();
  for (int i = 0; i < kDepth; ++i) {
    done[i].WaitForNotification();
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::CANCELLED) << i;
  }
  // The server drops them when the batch window ends, without computing, and the slots are free.
  EXPECT_TRUE(Eventually([&] { return Rejected("cancelled"); }, kDepth, "cancelled"));
  EXPECT_TRUE(Eventually([&] { return QueueDepth(); }, 0, "queue depth"));
  EXPECT_EQ(Snapshot(), before_);
  // A full queue's worth of new work is admitted and runs.
  std::vector<std::thread> threads;
  std::vector<absl::StatusCode> codes(kDepth);
  for (int i = 0; i < kDepth; ++i) {
    threads.emplace_back([&, i] {
      codes[i] = client_->Decode(requests[i]).status().code();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kDepth; ++i) {
    EXPECT_EQ(codes[i], absl::StatusCode::kOk) << i;
  }
  EXPECT_EQ(Snapshot().tokens, before_.tokens + kDepth);
}

TEST_F(AdmissionTest, ACancelledStreamGivesItsQueueSlotsBack) {
  StartWithSequences({kWindow});
  std::unique_ptr<client::DecodeStream> stream = client_->OpenDecodeStream();
  constexpr int kMessages = 3;
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(stream->Write(RandomDecode(30 + i, 0, {i % 2 == 0 ? 2u : 1u}, true, rng_)));
  }
  ASSERT_TRUE(Eventually([&] { return QueueDepth(); }, kMessages, "queue depth"));
  stream->Cancel();
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(Eventually([&] { return Rejected("cancelled"); }, kMessages, "cancelled"));
  EXPECT_TRUE(Eventually([&] { return QueueDepth(); }, 0, "queue depth"));
  EXPECT_EQ(Snapshot(), before_);
  // The server goes on: a new stream's step runs and matches the reference.
  std::unique_ptr<client::DecodeStream> next = client_->OpenDecodeStream();
  const v1::DecodeRequest step = RandomDecode(40, 0, {2}, true, rng_);
  ASSERT_TRUE(next->Write(step));
  v1::DecodeResponse response;
  ASSERT_TRUE(next->Read(&response));
  EXPECT_EQ(response.error_code(), 0) << response.error_message();
  EXPECT_TRUE(mirror_->ApplyAndCheck(step, response));
  ASSERT_TRUE(next->WritesDone());
  EXPECT_TRUE(next->Finish().ok());
}

}  // namespace
}  // namespace pagedattn::testing
