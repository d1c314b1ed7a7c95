// The service's Prometheus metrics: one registry and every metric family, created once and
// injected into the components that record them. Label values are bounded sets (RPC method
// names, gRPC code names, rejection reasons); never a sequence or request id.
// Thread-safe: every method may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace pagedattn {

class Metrics {
 public:
  // Where a request's and a batch's time goes on the server, for
  // pagedattn_stage_duration_seconds{stage}. Per request: kToWork (the service turns the
  // parsed request into a work item). Per batch, on the engine's executor: kPrepare (state
  // changes and index tables), kLaunch (Backend::Launch: staging and enqueue), kWait
  // (Backend::Wait: until the outputs are in host memory), kCallbacks (every item's
  // completion callback, which hands the response to gRPC), kRelease (freeing the batch's
  // work items).
  // kPlan (the kernel's work plan on the host), kPack and kUnpack are parts of kLaunch and kWait; kDeviceIn and kDeviceOut are measured on
  // the device (CUDA events). The last four only with a backend that stages (the CUDA one).
  // kReceive: per Decode that got a host block (Backend::TakeHostBlock), the copy of its
  // tensors into the block on the caller's thread, before admission.
  // kRestore: per sequence brought back from the host tier before its work (on the executor).
  enum class Stage {
    kToWork,
    kPrepare,
    kLaunch,
    kWait,
    kCallbacks,
    kRelease,
    kPack,
    kUnpack,
    kDeviceIn,
    kDeviceOut,
    kReceive,
    kPlan,
    kRestore
  };
  static constexpr int kNumStages = 13;
  static std::string_view StageName(Stage stage);

  Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The registry to hand to a prometheus::Exposer (or to collect from in tests).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Exports pagedattn_requests_total{method,code,transport} at 0 for each of `codes`, and the method's
  // pagedattn_request_duration_seconds, so alert rules and dashboards have series before the
  // first request. The service declares its methods once, at start.
  // `transport`: "grpc" (an RPC or stream message) or "local" (a local channel descriptor).
  void DeclareMethod(std::string_view method, const std::vector<std::string_view>& codes,
                     std::string_view transport = "grpc");
  // pagedattn_requests_total{method,code,transport} and
  // pagedattn_request_duration_seconds{method} (all transports together).
  void RecordRequest(std::string_view method, std::string_view code, double seconds,
                     std::string_view transport = "grpc");
  // pagedattn_queue_duration_seconds: time a work item waited before its batch launched.
  void RecordQueueDuration(double seconds);
  // pagedattn_batch_size: sequences per launch.
  void RecordBatch(int64_t sequences);
  // pagedattn_kernel_duration_seconds: the attention of a timed batch (every batch on the CPU
  // backend, one in several on the CUDA backend).
  void RecordKernelDuration(double seconds);
  // pagedattn_batch_duration_seconds: one backend batch from the start of its Launch to the
  // return of its Wait (host staging, copies, kernels, copy back: the server's step time
  // without the RPC transport).
  void RecordBatchDuration(double seconds);
  // pagedattn_stage_duration_seconds{stage}.
  void RecordStage(Stage stage, double seconds);
  // pagedattn_decode_receive_total{into}: Decodes that passed validation, by where their tensors went:
  // host_block (the backend's pinned ring) or request (their own memory: the backend has no ring,
  // or it was full).
  void RecordDecodeReceive(bool into_host_block);
  // pagedattn_rejected_requests_total{reason}: one of kRejectReasons (each exported from the
  // start, at 0).
  static constexpr std::string_view kRejectReasons[] = {
      "queue_full", "shutting_down", "deadline_exceeded", "cancelled", "pool_exhausted",
      "unauthenticated"};
  void RecordRejected(std::string_view reason);
  // pagedattn_queue_depth: work items waiting for a batch.
  void SetQueueDepth(int64_t depth);
  // pagedattn_kv_pages_total, pagedattn_kv_pages_free, pagedattn_sequences, pagedattn_kv_tokens.
  void SetPool(int64_t pages_total, int64_t pages_free, int64_t sequences, int64_t tokens);
  // pagedattn_backend_healthy: 1 while the backend works, 0 after a device error.
  void SetBackendHealthy(bool healthy);
  // The host tier: pagedattn_kv_offloads_total / pagedattn_kv_restores_total (sequences moved),
  // pagedattn_kv_tier_bytes_total{direction="to_host"|"to_device"} (K and V bytes copied),
  // pagedattn_host_kv_pages_total, pagedattn_host_kv_pages_free, pagedattn_sequences_offloaded.
  void RecordOffload(int64_t bytes);
  void RecordRestore(int64_t bytes);
  void SetHostTier(int64_t pages_total, int64_t pages_free, int64_t sequences_offloaded);
  // pagedattn_local_channels: local channels open.
  void SetLocalChannels(int64_t open);

  // Bucket bounds, in seconds: 1 us to 10 s, three per decade.
  static prometheus::Histogram::BucketBoundaries LatencyBuckets();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Family<prometheus::Counter>& decode_receive_;
  prometheus::Counter& received_into_block_;
  prometheus::Counter& received_into_request_;
  prometheus::Histogram& queue_duration_;
  prometheus::Histogram& batch_size_;
  prometheus::Histogram& kernel_duration_;
  prometheus::Histogram& batch_duration_;
  std::array<prometheus::Histogram*, kNumStages> stage_duration_{};
  prometheus::Gauge& queue_depth_;
  prometheus::Gauge& pages_total_;
  prometheus::Gauge& pages_free_;
  prometheus::Gauge& sequences_;
  prometheus::Gauge& tokens_;
  prometheus::Gauge& backend_healthy_;
  prometheus::Counter* offloads_ = nullptr;
  prometheus::Counter* restores_ = nullptr;
  prometheus::Counter* bytes_to_host_ = nullptr;
  prometheus::Counter* bytes_to_device_ = nullptr;
  prometheus::Gauge* host_pages_total_ = nullptr;
  prometheus::Gauge* host_pages_free_ = nullptr;
  prometheus::Gauge* sequences_offloaded_ = nullptr;
  prometheus::Gauge& local_channels_;

  // The counter and duration histogram one request adds to.
  struct RequestSeries {
    prometheus::Counter* count = nullptr;
    prometheus::Histogram* duration = nullptr;
  };
  RequestSeries SeriesOf(std::string_view method, std::string_view code,
                         std::string_view transport);
  prometheus::Histogram* DurationOf(std::string_view method) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Family::Add builds its label map and looks it up under the family's lock on every call
  // (~0.35 µs a request); the series of the few methods, codes and transports are cached here.
  using RequestKey = std::array<std::string, 3>;  // method, code, transport
  struct RequestKeyLess {
    using is_transparent = void;
    template <typename K>
    static std::tuple<std::string_view, std::string_view, std::string_view> View(const K& k) {
      return {k[0], k[1], k[2]};
    }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return View(a) < View(b);
    }
  };
  absl::Mutex mu_;
  std::map<RequestKey, RequestSeries, RequestKeyLess> series_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, prometheus::Histogram*, std::less<>> duration_by_method_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
