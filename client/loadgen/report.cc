#include "client/loadgen/report.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::loadgen {
namespace {

// The server's pagedattn_stage_duration_seconds stages, in the order of a request's path:
// receive per request into a pinned host block (when it got one); launch_plan and launch_pack
// are parts of launch, wait_unpack of wait; all but the six per-batch ones (prepare, launch,
// wait, callbacks, release) and to_work only on a staging backend, the CUDA one.
constexpr const char* kStages[] = {"to_work", "receive", "prepare", "launch", "launch_plan",
                                   "launch_pack", "device_in", "wait", "wait_unpack", "device_out",
                                   "callbacks", "release"};


// The served shape, so that results of different shapes are not confused.
Json ShapeToJson(const kernels::Shape& s, const KvScales& scales) {
  Json j = Json::Object();
  j.Set("description", kernels::DescribeShape(s));
  j.Set("num_qo_heads", s.num_qo_heads);
  j.Set("num_kv_heads", s.num_kv_heads);
  j.Set("head_dim", s.head_dim);
  j.Set("page_size", s.page_size);
  j.Set("dtype", kernels::DTypeName(s.dtype));
  j.Set("kv_cache_dtype", kernels::DTypeName(s.kv_dtype));
  // K and V of one token at one layer as the pages hold them: what a decode reads per token.
  j.Set("kv_bytes_per_token", 2 * s.kv_token_bytes());
  if (!scales.k_scales.empty()) {
    Json k = Json::Array(), v = Json::Array();
    for (const float x : scales.k_scales) k.Push(static_cast<double>(x));
    for (const float x : scales.v_scales) v.Push(static_cast<double>(x));
    j.Set("k_scales", std::move(k));
    j.Set("v_scales", std::move(v));
  }
  return j;
}

Json StatsToJson(const v1::GetStatsResponse& s) {
  Json j = Json::Object();
  j.Set("pages_total", s.pages_total());
  j.Set("pages_free", s.pages_free());
  j.Set("sequences", s.sequences());
  j.Set("tokens", s.tokens());
  j.Set("batches", s.batches());
  j.Set("decoded_sequences", s.decoded_sequences());
  j.Set("healthy", s.healthy());
  return j;
}

double Get(const Json& j, std::initializer_list<absl::string_view> path) {
  const Json* at = &j;
  for (absl::string_view key : path) {
    at = at->Find(key);
    if (at == nullptr) return NAN;
  }
  return at->type() == Json::Type::kNumber ? at->number() : NAN;
}

// The server's breakdown over the timed phase, from two scrapes.
Json ServerBreakdown(const Scrape& before, const Scrape& after) {
  Json j = Json::Object();
  j.Set("queue_duration", HistogramToJson(Subtract(GetHistogram(after, "pagedattn_queue_duration_seconds"),
                                                   GetHistogram(before, "pagedattn_queue_duration_seconds")),
                                          1e6, "_us"));
  j.Set("kernel_duration", HistogramToJson(Subtract(GetHistogram(after, "pagedattn_kernel_duration_seconds"),
                                                    GetHistogram(before, "pagedattn_kernel_duration_seconds")),
                                           1e6, "_us"));
  j.Set("batch_size", HistogramToJson(Subtract(GetHistogram(after, "pagedattn_batch_size"),
                                               GetHistogram(before, "pagedattn_batch_size"))));
  j.Set("batch_duration", HistogramToJson(Subtract(GetHistogram(after, "pagedattn_batch_duration_seconds"),
                                                   GetHistogram(before, "pagedattn_batch_duration_seconds")),
                                          1e6, "_us"));
  Json stages = Json::Object();
  for (const char* stage : kStages) {
    const Histogram d = Subtract(GetHistogram(after, "pagedattn_stage_duration_seconds", {{"stage", stage}}),
                                 GetHistogram(before, "pagedattn_stage_duration_seconds", {{"stage", stage}}));
    if (d.count > 0) stages.Set(stage, HistogramToJson(d, 1e6, "_us"));
  }
  j.Set("stage_duration", std::move(stages));
  Json by_method = Json::Object();
  for (const char* method : {"Decode", "DecodeStream", "AppendKV"}) {
    const Histogram d = Subtract(GetHistogram(after, "pagedattn_request_duration_seconds", {{"method", method}}),
                                 GetHistogram(before, "pagedattn_request_duration_seconds", {{"method", method}}));
    if (d.count > 0) by_method.Set(method, HistogramToJson(d, 1e6, "_us"));
  }
  j.Set("request_duration", std::move(by_method));
  j.Set("requests_total", CounterDeltas(after, before, "pagedattn_requests_total"));
  j.Set("rejected_requests_total", CounterDeltas(after, before, "pagedattn_rejected_requests_total"));
  j.Set("decode_receive_total", CounterDeltas(after, before, "pagedattn_decode_receive_total"));
  return j;
}

}  // namespace

Json BuildResult(const RunFacts& f, RunState& state) {
  const LoadGenOptions& o = *f.options;
  const v1::GetModelConfigResponse* config = &f.config;
  const int64_t n = f.num_sequences;
  const int64_t prefill_tokens = f.prefill_tokens, min_len = f.prefill_min, max_len = f.prefill_max;
  const int32_t chunk = f.prefill_chunk_tokens;
  const double fill_seconds = f.fill_seconds, elapsed = f.elapsed;
  const int64_t fill_bytes = f.fill_bytes;
  Json open_stats = f.open_loop;
  const v1::GetStatsResponse& stats_before = f.stats_before;
  const v1::GetStatsResponse& stats_after = f.stats_after;
  const bool want_metrics = f.metrics_wanted;
  const std::string& metrics_error = f.metrics_error;
  const Scrape& before = f.metrics_before;
  const Scrape& after = f.metrics_after;

  Json result = Json::Object();
  result.Set("schema", "pagedattn-loadgen/1");
  result.Set("shape", kernels::DescribeShape(state.shape));
  Json cfg = Json::Object();
  cfg.Set("mode", o.mode);
  cfg.Set("api", o.api);
  cfg.Set("transport", o.transport);
  if (o.transport == "local") cfg.Set("local_spin_us", absl::ToInt64Microseconds(o.local_spin));
  cfg.Set("concurrency", o.concurrency);
  // Distinct client connections of the closed-loop callers (1: all on one HTTP/2 connection).
  {
    std::vector<client::Client*> distinct(state.callers.begin(), state.callers.end());
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    cfg.Set("caller_connections", static_cast<int64_t>(std::max<size_t>(1, distinct.size())));
  }
  cfg.Set("batch_size", o.batch_size);
  cfg.Set("num_sequences", n);
  cfg.Set("num_layers", state.num_layers);
  cfg.Set("decode_kv", o.decode_kv);
  Json len = Json::Object();
  len.Set("distribution", o.lengths.distribution);
  if (o.lengths.distribution == "fixed") len.Set("context_len", o.lengths.fixed_len);
  if (o.lengths.distribution == "uniform") {
    len.Set("min", o.lengths.min_len);
    len.Set("max", o.lengths.max_len);
  }
  if (o.lengths.distribution == "workload") {
    len.Set("file", o.lengths.workload_file.empty() ? DefaultWorkloadFile() : o.lengths.workload_file);
    Json names = Json::Array();
    for (const std::string& name : o.lengths.shape_names) names.Push(name);
    len.Set("shapes", std::move(names));
    len.Set("order", o.lengths.workload_order);
  }
  cfg.Set("lengths", std::move(len));
  cfg.Set("duration_s", o.steps > 0 ? Json() : Json(absl::ToDoubleSeconds(o.duration)));
  cfg.Set("steps_per_batch", o.steps);
  cfg.Set("warmup_steps_per_batch", o.warmup_steps);
  if (o.mode == "open") {
    cfg.Set("rate_per_s", o.rate);
    cfg.Set("arrival", o.arrival);
  }
  if (o.api == "stream") cfg.Set("stream_in_flight", o.stream_in_flight);
  cfg.Set("prefill_chunk_tokens", chunk);
  cfg.Set("seed", o.seed);
  Json server_cfg = Json::Object();
  server_cfg.Set("backend", config->backend());
  server_cfg.Set("num_layers", config->num_layers());
  server_cfg.Set("num_pages", config->num_pages());
  server_cfg.Set("max_batch_size", config->max_batch_size());
  server_cfg.Set("max_message_bytes", config->max_message_bytes());
  server_cfg.Set("shape", ShapeToJson(state.shape, f.kv_scales));
  cfg.Set("server", std::move(server_cfg));
  result.Set("config", std::move(cfg));

  Json ctx = Json::Object();
  ctx.Set("sequences", n);
  ctx.Set("prefill_tokens_total", prefill_tokens);
  ctx.Set("prefill_tokens_min", min_len);
  ctx.Set("prefill_tokens_mean", static_cast<double>(prefill_tokens) / static_cast<double>(n));
  ctx.Set("prefill_tokens_max", max_len);
  result.Set("context", std::move(ctx));

  Json fill = Json::Object();
  fill.Set("seconds", fill_seconds);
  fill.Set("kv_bytes", fill_bytes);
  fill.Set("kv_gb_per_s", fill_seconds > 0 ? static_cast<double>(fill_bytes) / fill_seconds / 1e9 : 0.0);
  result.Set("fill", std::move(fill));

  const int64_t requests = state.requests_ok.load();
  const int64_t seq_decodes = state.sequence_decodes.load();
  const int64_t steps = state.steps_done.load();
  const int64_t attended = state.attended_tokens.load();
  const double kv_bytes = static_cast<double>(attended) * static_cast<double>(2 * state.shape.kv_token_bytes());
  Json run = Json::Object();
  run.Set("elapsed_s", elapsed);
  run.Set("steps", steps);
  run.Set("decode_requests", requests);
  run.Set("sequence_decodes", seq_decodes);
  run.Set("mean_context_tokens", seq_decodes > 0 ? static_cast<double>(attended) / static_cast<double>(seq_decodes) : 0.0);
  run.Set("kv_bytes_read", kv_bytes);
  {
    absl::MutexLock lock(&state.mu);
    Json errors = Json::Object();
    for (const auto& [code, count] : state.errors) errors.Set(code, count);
    run.Set("errors", std::move(errors));
    Json retired = Json::Array();
    for (const std::string& why : state.retired) retired.Push(why);
    run.Set("retired_batches", std::move(retired));
  }
  if (o.mode == "open") run.Set("open_loop", std::move(open_stats));
  result.Set("run", std::move(run));

  Json tp = Json::Object();
  tp.Set("sequence_decodes_per_s", elapsed > 0 ? seq_decodes / elapsed : 0.0);
  tp.Set("tokens_per_s", elapsed > 0 ? static_cast<double>(steps) * o.batch_size / elapsed : 0.0);
  tp.Set("requests_per_s", elapsed > 0 ? requests / elapsed : 0.0);
  tp.Set("steps_per_s", elapsed > 0 ? steps / elapsed : 0.0);
  tp.Set("kv_gb_per_s", elapsed > 0 ? kv_bytes / elapsed / 1e9 : 0.0);
  result.Set("throughput", std::move(tp));

  {
    absl::MutexLock lock(&state.mu);
    result.Set("latency", state.samples.ToJson());
  }

  Json server = Json::Object();
  Json stats_delta = Json::Object();
  const int64_t batches = stats_after.batches() - stats_before.batches();
  const int64_t decoded = stats_after.decoded_sequences() - stats_before.decoded_sequences();
  stats_delta.Set("batches", batches);
  stats_delta.Set("decoded_sequences", decoded);
  stats_delta.Set("mean_batch_size", batches > 0 ? static_cast<double>(decoded) / static_cast<double>(batches) : 0.0);
  server.Set("stats_delta", std::move(stats_delta));
  server.Set("stats_after", StatsToJson(stats_after));
  if (!want_metrics) {
    server.Set("metrics", Json());
  } else if (!metrics_error.empty()) {
    Json m = Json::Object();
    m.Set("error", metrics_error);
    server.Set("metrics", std::move(m));
  } else {
    Json m = ServerBreakdown(before, after);
    m.Set("address", o.metrics_address);
    server.Set("metrics", std::move(m));
  }
  result.Set("server", std::move(server));

  // The reference figures, derived.
  Json derived = Json::Object();
  const Json* srv = result.Find("server");
  const double kernel_mean_us = Get(*srv, {"metrics", "kernel_duration", "mean_us"});
  // The CUDA backend times one batch in several: the kernel's total over the phase is its
  // sampled mean times every batch with sequences (pagedattn_batch_size counts them all).
  const double kernel_total_us =
      kernel_mean_us * Get(*srv, {"metrics", "batch_size", "count"});
  const char* rpc = o.api == "stream" ? "DecodeStream" : "Decode";
  const double p50_us = Get(result, {"latency", rpc, "p50_us"});
  const double mean_us = Get(result, {"latency", rpc, "mean_us"});
  const double server_mean_us = Get(*srv, {"metrics", "request_duration", rpc, "mean_us"});
  const double kernel_alone =
      kernel_total_us > 0 ? static_cast<double>(decoded) / (kernel_total_us * 1e-6) : NAN;
  const double measured = elapsed > 0 ? seq_decodes / elapsed : 0.0;
  const double kernel_p50_us = Get(*srv, {"metrics", "kernel_duration", "p50_us"});
  derived.Set("kernel_mean_us", kernel_mean_us);
  derived.Set("request_p50_minus_kernel_mean_us", p50_us - kernel_mean_us);
  // The kernel's p50 comes from its histogram buckets (three per decade): coarse.
  derived.Set("request_p50_minus_kernel_p50_us", p50_us - kernel_p50_us);
  derived.Set("server_request_mean_minus_kernel_mean_us", server_mean_us - kernel_mean_us);
  // What is left of the request's p50 once the kernel and this client's RPC floor are taken off.
  const double floor_p50_us = Get(result, {"latency", "rpc_floor", "p50_us"});
  derived.Set("rpc_floor_p50_us", floor_p50_us);
  derived.Set("request_p50_minus_kernel_mean_minus_rpc_floor_us", p50_us - kernel_mean_us - floor_p50_us);
  derived.Set("request_mean_over_kernel_mean", mean_us / kernel_mean_us);
  derived.Set("server_request_mean_over_kernel_mean", server_mean_us / kernel_mean_us);
  // The server's step time without the RPC transport: one batch from launch to outputs in host memory.
  const double batch_mean_us = Get(*srv, {"metrics", "batch_duration", "mean_us"});
  derived.Set("batch_duration_mean_us", batch_mean_us);
  derived.Set("batch_duration_mean_over_kernel_mean", batch_mean_us / kernel_mean_us);
  derived.Set("kernel_alone_sequence_decodes_per_s", kernel_alone);
  derived.Set("throughput_over_kernel_alone", measured / kernel_alone);
  derived.Set("kernel_kv_gb_per_s", kernel_total_us > 0 ? kv_bytes / (kernel_total_us * 1e-6) / 1e9 : NAN);
  result.Set("derived", std::move(derived));

  if (f.check_enabled) {
    result.Set("check", f.check_result.ToJson(f.check_options));
  } else {
    Json off = Json::Object();
    off.Set("enabled", false);
    result.Set("check", std::move(off));
  }
  return result;
}

std::string FormatSummary(const Json& r) {
  const Json* cfg = r.Find("config");
  const std::string api = cfg != nullptr && cfg->Find("api") != nullptr ? cfg->Find("api")->string() : "unary";
  const char* rpc = api == "stream" ? "DecodeStream" : "Decode";
  const Json* shape = r.Find("shape");
  std::string out = shape != nullptr && shape->type() == Json::Type::kString
                        ? absl::StrCat("shape ", shape->string(), "\n")
                        : std::string();
  out += absl::StrFormat(
      "batch %.0f x %.0f callers, context %.0f tokens (mean during decode), %.0f layer(s): %.0f steps in %.2f s\n"
      "  throughput: %.1f sequence-decodes/s, %.1f tokens/s, %.2f GB/s of KV read\n"
      "  %s latency: p50 %.1f us, p90 %.1f us, p99 %.1f us; step p50 %.1f us\n",
      Get(r, {"config", "batch_size"}), Get(r, {"config", "concurrency"}), Get(r, {"run", "mean_context_tokens"}),
      Get(r, {"config", "num_layers"}), Get(r, {"run", "steps"}), Get(r, {"run", "elapsed_s"}),
      Get(r, {"throughput", "sequence_decodes_per_s"}), Get(r, {"throughput", "tokens_per_s"}),
      Get(r, {"throughput", "kv_gb_per_s"}), rpc, Get(r, {"latency", rpc, "p50_us"}),
      Get(r, {"latency", rpc, "p90_us"}), Get(r, {"latency", rpc, "p99_us"}), Get(r, {"latency", "step", "p50_us"}));
  const double kernel = Get(r, {"derived", "kernel_mean_us"});
  // A GPU-synchronised local caller's latency on its own stream (--local_gpu_sync).
  if (const double device = Get(r, {"latency", "device", "p50_us"}); std::isfinite(device)) {
    out += absl::StrFormat("  device latency (caller's stream, q ready -> output usable): p50 %.1f us, p90 %.1f us, "
                           "p99 %.1f us; p50 - kernel mean = %.1f us, p50/kernel mean = %.2fx\n",
                           device, Get(r, {"latency", "device", "p90_us"}), Get(r, {"latency", "device", "p99_us"}),
                           device - kernel, device / kernel);
  }
  if (std::isfinite(kernel)) {
    out += absl::StrFormat(
        "  server: kernel mean %.1f us, queue mean %.1f us, batch size mean %.1f; request p50 - kernel = %.1f us, "
        "request/kernel = %.2fx, throughput/kernel-alone = %.2f\n",
        kernel, Get(r, {"server", "metrics", "queue_duration", "mean_us"}),
        Get(r, {"server", "metrics", "batch_size", "mean"}), Get(r, {"derived", "request_p50_minus_kernel_mean_us"}),
        Get(r, {"derived", "request_mean_over_kernel_mean"}), Get(r, {"derived", "throughput_over_kernel_alone"}));
    const double server_request = Get(r, {"server", "metrics", "request_duration", rpc, "mean_us"});
    const double batch = Get(r, {"derived", "batch_duration_mean_us"});
    if (std::isfinite(server_request) || std::isfinite(batch)) {
      out += absl::StrFormat("  server: request mean %.1f us (%.2fx kernel), batch launch->done mean %.1f us (%.2fx kernel)\n",
                             server_request, server_request / kernel, batch, batch / kernel);
    }
    const Json* stages = nullptr;
    if (const Json* srv = r.Find("server"); srv != nullptr) {
      if (const Json* m = srv->Find("metrics"); m != nullptr) stages = m->Find("stage_duration");
    }
    if (stages != nullptr && stages->type() == Json::Type::kObject) {
      std::string line;
      for (const char* stage : kStages) {
        const double mean = Get(*stages, {stage, "mean_us"});
        if (std::isfinite(mean)) absl::StrAppendFormat(&line, " %s %.1f", stage, mean);
      }
      if (!line.empty()) out += absl::StrCat("  server stage means (us):", line, "\n");
    }
  } else {
    out += absl::StrFormat("  server: %.0f batches, mean batch size %.1f (no metrics endpoint read)\n",
                           Get(r, {"server", "stats_delta", "batches"}),
                           Get(r, {"server", "stats_delta", "mean_batch_size"}));
  }
  const Json* check = r.Find("check");
  const Json* enabled = check != nullptr ? check->Find("enabled") : nullptr;
  if (enabled != nullptr && enabled->boolean()) {
    out += absl::StrFormat("  check: %s, %.0f decodes of %.0f sequences, max output rel L2 %.3g, max lse error %.3g\n",
                           check->Find("passed") != nullptr && check->Find("passed")->boolean() ? "PASS" : "FAIL",
                           Get(r, {"check", "decodes_checked"}), Get(r, {"check", "sequences"}),
                           Get(r, {"check", "max_output_rel_l2"}), Get(r, {"check", "max_lse_abs_err"}));
  }
  return out;
}

}  // namespace pagedattn::loadgen
