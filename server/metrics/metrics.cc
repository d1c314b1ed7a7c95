#include "server/metrics/metrics.h"

#include <cmath>

namespace pagedattn {

prometheus::Histogram::BucketBoundaries Metrics::LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries bounds;
  for (double decade = 1e-6; decade < 10.0; decade *= 10.0) {
    bounds.push_back(decade);
    bounds.push_back(2.5 * decade);
    bounds.push_back(5.0 * decade);
  }
  bounds.push_back(10.0);
  return bounds;
}

namespace {

prometheus::Histogram::BucketBoundaries BatchSizeBuckets() {
  prometheus::Histogram::BucketBoundaries bounds;
  for (double b = 1; b <= 1024; b *= 2) bounds.push_back(b);
  return bounds;
}

}  // namespace

std::string_view Metrics::StageName(Stage stage) {
  switch (stage) {
    case Stage::kToWork:
      return "to_work";
    case Stage::kPrepare:
      return "prepare";
    case Stage::kLaunch:
      return "launch";
    case Stage::kWait:
      return "wait";
    case Stage::kCallbacks:
      return "callbacks";
    case Stage::kRelease:
      return "release";
    case Stage::kPack:
      return "launch_pack";
    case Stage::kUnpack:
      return "wait_unpack";
    case Stage::kDeviceIn:
      return "device_in";
    case Stage::kDeviceOut:
      return "device_out";
    case Stage::kReceive:
      return "receive";
    case Stage::kPlan:
      return "launch_plan";
    case Stage::kRestore:
      return "restore";
  }
  return "unknown";
}

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("pagedattn_requests_total")
                    .Help("RPCs finished (and local channel descriptors), by method, gRPC status code and transport")
                    .Register(*registry_)),
      request_duration_(prometheus::BuildHistogram()
                            .Name("pagedattn_request_duration_seconds")
                            .Help("Time from an RPC's arrival to its response (per message on streams)")
                            .Register(*registry_)),
      rejected_(prometheus::BuildCounter()
                    .Name("pagedattn_rejected_requests_total")
                    .Help("Work refused or dropped before compute, by reason")
                    .Register(*registry_)),
      decode_receive_(prometheus::BuildCounter()
                          .Name("pagedattn_decode_receive_total")
                          .Help("Decodes that passed validation, by where their tensors went: "
                                "host_block (the backend's pinned ring) or request (their own memory)")
                          .Register(*registry_)),
      received_into_block_(decode_receive_.Add({{"into", "host_block"}})),
      received_into_request_(decode_receive_.Add({{"into", "request"}})),
      queue_duration_(prometheus::BuildHistogram()
                          .Name("pagedattn_queue_duration_seconds")
                          .Help("Time a work item waited in the queue before its batch launched")
                          .Register(*registry_)
                          .Add({}, LatencyBuckets())),
      batch_size_(prometheus::BuildHistogram()
                      .Name("pagedattn_batch_size")
                      .Help("Sequences per backend launch")
                      .Register(*registry_)
                      .Add({}, BatchSizeBuckets())),
      kernel_duration_(prometheus::BuildHistogram()
                           .Name("pagedattn_kernel_duration_seconds")
                           .Help("Backend compute time of one batch (CUDA: device events, one batch in 8)")
                           .Register(*registry_)
                           .Add({}, LatencyBuckets())),
      batch_duration_(prometheus::BuildHistogram()
                          .Name("pagedattn_batch_duration_seconds")
                          .Help("One backend batch from the start of its launch to its outputs "
                                "in host memory (staging, copies, kernels, copy back)")
                          .Register(*registry_)
                          .Add({}, LatencyBuckets())),
      queue_depth_(prometheus::BuildGauge()
                       .Name("pagedattn_queue_depth")
                       .Help("Work items waiting for a batch")
                       .Register(*registry_)
                       .Add({})),
      pages_total_(prometheus::BuildGauge()
                       .Name("pagedattn_kv_pages_total")
                       .Help("KV pages in the pool")
                       .Register(*registry_)
                       .Add({})),
      pages_free_(prometheus::BuildGauge()
                      .Name("pagedattn_kv_pages_free")
                      .Help("KV pages on the free list")
                      .Register(*registry_)
                      .Add({})),
      sequences_(prometheus::BuildGauge()
                     .Name("pagedattn_sequences")
                     .Help("Live sequences")
                     .Register(*registry_)
                     .Add({})),
      tokens_(prometheus::BuildGauge()
                  .Name("pagedattn_kv_tokens")
                  .Help("Committed tokens over all live sequences")
                  .Register(*registry_)
                  .Add({})),
      backend_healthy_(prometheus::BuildGauge()
                           .Name("pagedattn_backend_healthy")
                           .Help("1 while the compute backend works, 0 after a device error")
                           .Register(*registry_)
                           .Add({})),
      local_channels_(prometheus::BuildGauge()
                          .Name("pagedattn_local_channels")
                          .Help("Local channels (shared-memory rings, OpenLocalChannel) open")
                          .Register(*registry_)
                          .Add({})) {
  backend_healthy_.Set(1);
  auto& stages = prometheus::BuildHistogram()
                     .Name("pagedattn_stage_duration_seconds")
                     .Help("Server time by stage: to_work per request; prepare, launch, wait, "
                           "callbacks, release per batch on the engine's executor; launch_plan "
                           "(the kernel's work plan), launch_pack and wait_unpack (host copies through the staging buffers, parts of "
                           "launch and wait), device_in (on the device: a batch's input copy "
                           "to its attention) and device_out (its attention's end to the "
                           "outputs in host memory) per batch of a staging backend; receive "
                           "(a Decode's tensors copied into a pinned host block, per request); restore "
                           "(a sequence brought back from the host tier, per sequence)")
                     .Register(*registry_);
  for (int i = 0; i < kNumStages; ++i) {
    stage_duration_[i] =
        &stages.Add({{"stage", std::string(StageName(static_cast<Stage>(i)))}}, LatencyBuckets());
  }
  for (std::string_view reason : kRejectReasons) rejected_.Add({{"reason", std::string(reason)}});
  offloads_ = &prometheus::BuildCounter()
                   .Name("pagedattn_kv_offloads_total")
                   .Help("Sequences moved from the KV pool to the host tier")
                   .Register(*registry_)
                   .Add({});
  restores_ = &prometheus::BuildCounter()
                   .Name("pagedattn_kv_restores_total")
                   .Help("Sequences moved back from the host tier to the KV pool")
                   .Register(*registry_)
                   .Add({});
  auto& tier_bytes = prometheus::BuildCounter()
                         .Name("pagedattn_kv_tier_bytes_total")
                         .Help("K and V bytes copied between the KV pool and the host tier, by "
                               "direction (to_host: offloads, to_device: restores)")
                         .Register(*registry_);
  bytes_to_host_ = &tier_bytes.Add({{"direction", "to_host"}});
  bytes_to_device_ = &tier_bytes.Add({{"direction", "to_device"}});
  host_pages_total_ = &prometheus::BuildGauge()
                           .Name("pagedattn_host_kv_pages_total")
                           .Help("Pages of the host tier (each one page id's K and V of every layer)")
                           .Register(*registry_)
                           .Add({});
  host_pages_free_ = &prometheus::BuildGauge()
                          .Name("pagedattn_host_kv_pages_free")
                          .Help("Free pages of the host tier")
                          .Register(*registry_)
                          .Add({});
  sequences_offloaded_ = &prometheus::BuildGauge()
                              .Name("pagedattn_sequences_offloaded")
                              .Help("Live sequences whose pages are in the host tier")
                              .Register(*registry_)
                              .Add({});
}

prometheus::Histogram* Metrics::DurationOf(std::string_view method) {
  auto it = duration_by_method_.find(method);
  if (it == duration_by_method_.end()) {
    it = duration_by_method_
             .emplace(std::string(method),
                      &request_duration_.Add({{"method", std::string(method)}}, LatencyBuckets()))
             .first;
  }
  return it->second;
}

Metrics::RequestSeries Metrics::SeriesOf(std::string_view method, std::string_view code,
                                          std::string_view transport) {
  const std::array<std::string_view, 3> key = {method, code, transport};
  absl::MutexLock lock(&mu_);
  if (auto it = series_.find(key); it != series_.end()) return it->second;
  const RequestSeries series{&requests_.Add({{"method", std::string(method)},
                                             {"code", std::string(code)},
                                             {"transport", std::string(transport)}}),
                             DurationOf(method)};
  series_.emplace(RequestKey{std::string(method), std::string(code), std::string(transport)},
                  series);
  return series;
}

void Metrics::DeclareMethod(std::string_view method, const std::vector<std::string_view>& codes,
                            std::string_view transport) {
  for (std::string_view code : codes) SeriesOf(method, code, transport);
  absl::MutexLock lock(&mu_);
  DurationOf(method);
}

void Metrics::RecordRequest(std::string_view method, std::string_view code, double seconds,
                            std::string_view transport) {
  const RequestSeries series = SeriesOf(method, code, transport);
  series.count->Increment();
  series.duration->Observe(seconds);
}

void Metrics::RecordQueueDuration(double seconds) { queue_duration_.Observe(seconds); }

void Metrics::RecordBatch(int64_t sequences) { batch_size_.Observe(static_cast<double>(sequences)); }

void Metrics::RecordKernelDuration(double seconds) { kernel_duration_.Observe(seconds); }

void Metrics::RecordBatchDuration(double seconds) { batch_duration_.Observe(seconds); }

void Metrics::RecordStage(Stage stage, double seconds) {
  stage_duration_[static_cast<int>(stage)]->Observe(seconds);
}

void Metrics::RecordDecodeReceive(bool into_host_block) {
  (into_host_block ? received_into_block_ : received_into_request_).Increment();
}

void Metrics::RecordRejected(std::string_view reason) {
  rejected_.Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::SetQueueDepth(int64_t depth) { queue_depth_.Set(static_cast<double>(depth)); }

void Metrics::SetPool(int64_t pages_total, int64_t pages_free, int64_t sequences, int64_t tokens) {
  pages_total_.Set(static_cast<double>(pages_total));
  pages_free_.Set(static_cast<double>(pages_free));
  sequences_.Set(static_cast<double>(sequences));
  tokens_.Set(static_cast<double>(tokens));
}

void Metrics::SetBackendHealthy(bool healthy) { backend_healthy_.Set(healthy ? 1 : 0); }

void Metrics::RecordOffload(int64_t bytes) {
  offloads_->Increment();
  bytes_to_host_->Increment(static_cast<double>(bytes));
}

void Metrics::RecordRestore(int64_t bytes) {
  restores_->Increment();
  bytes_to_device_->Increment(static_cast<double>(bytes));
}

void Metrics::SetHostTier(int64_t pages_total, int64_t pages_free, int64_t sequences_offloaded) {
  host_pages_total_->Set(static_cast<double>(pages_total));
  host_pages_free_->Set(static_cast<double>(pages_free));
  sequences_offloaded_->Set(static_cast<double>(sequences_offloaded));
}
void Metrics::SetLocalChannels(int64_t open) { local_channels_.Set(static_cast<double>(open)); }

}  // namespace pagedattn
