#include "client/loadgen/loadgen.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/loadgen/report.h"
#include "client/loadgen/run_state.h"
#include "client/loadgen/server_metrics.h"
#include "client/loadgen/server_shape.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::loadgen {
namespace {

absl::Status Validate(const LoadGenOptions& o, const v1::GetModelConfigResponse& config) {
  if (o.mode != "closed" && o.mode != "open") return absl::InvalidArgumentError("mode must be closed or open");
  if (o.api != "unary" && o.api != "stream") return absl::InvalidArgumentError("api must be unary or stream");
  if (o.mode == "open" && o.api != "unary") return absl::InvalidArgumentError("the open loop uses unary calls only");
  if (o.mode == "open" && !(o.rate > 0)) return absl::InvalidArgumentError("the open loop needs a rate > 0");
  if (o.arrival != "poisson" && o.arrival != "fixed") return absl::InvalidArgumentError("arrival must be poisson or fixed");
  if (o.tensors != "inline" && o.tensors != "system" && o.tensors != "cuda") {
    return absl::InvalidArgumentError("tensors must be inline, system or cuda");
  }
  if (o.tensors != "inline" && o.mode != "closed") {
    return absl::InvalidArgumentError("tensors by reference (system, cuda) need the closed loop");
  }
  if (o.transport != "grpc" && o.transport != "local") {
    return absl::InvalidArgumentError("transport must be grpc or local");
  }
  if (o.transport == "local" && (o.tensors == "inline" || o.mode != "closed" || o.api != "unary")) {
    return absl::InvalidArgumentError(
        "--transport=local needs --tensors=system or cuda, --mode=closed and --api=unary");
  }
  if (o.local_gpu_sync && (o.transport != "local" || o.tensors != "cuda")) {
    return absl::InvalidArgumentError("--local_gpu_sync needs --transport=local and --tensors=cuda");
  }
  if (o.device_latency && !o.local_gpu_sync) {
    return absl::InvalidArgumentError("--device_latency times --local_gpu_sync callers only");
  }
#ifndef PAGEDATTN_LOADGEN_CUDA
  if (o.local_gpu_sync) return absl::FailedPreconditionError("--local_gpu_sync needs a build with CUDA");
#endif
  if (o.concurrency < 1) return absl::InvalidArgumentError("concurrency must be >= 1");
  if (o.batch_size < 1 || o.batch_size > config.max_batch_size()) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be in 1..", config.max_batch_size(),
                                                   " (the server's max_batch_size), got ", o.batch_size));
  }
  const int64_t n = o.num_sequences > 0 ? o.num_sequences : int64_t{o.concurrency} * o.batch_size;
  if (n % o.batch_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_sequences (", n, ") must be a multiple of batch_size (",
                                                   o.batch_size, ")"));
  }
  if (o.mode == "closed" && n / o.batch_size < o.concurrency) {
    return absl::InvalidArgumentError(absl::StrCat("the closed loop needs at least concurrency x batch_size = ",
                                                   int64_t{o.concurrency} * o.batch_size, " sequences, got ", n));
  }
  if (o.steps < 0 || o.warmup_steps < 0) return absl::InvalidArgumentError("steps must be >= 0");
  if (o.steps == 0 && o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("give a duration > 0 or steps > 0");
  }
  if (o.prefill_chunk_tokens < 1) return absl::InvalidArgumentError("prefill_chunk_tokens must be >= 1");
  if (o.fill_concurrency < 1) return absl::InvalidArgumentError("fill_concurrency must be >= 1");
  if (o.stream_in_flight < 1) return absl::InvalidArgumentError("stream_in_flight must be >= 1");
  if (o.sm_scale < 0 || !std::isfinite(o.sm_scale)) return absl::InvalidArgumentError("sm_scale must be finite and >= 0");
  if (config.num_layers() < 1) {
    return absl::FailedPreconditionError(absl::StrCat("the server reports ", config.num_layers(), " layers"));
  }
  return absl::OkStatus();
}

// Runs fn(i) for i in [0, n) on `threads` threads; the first error wins and stops the others.
absl::Status ParallelFor(int64_t n, int32_t threads, const std::function<absl::Status(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first;
  std::vector<std::thread> workers;
  const int32_t count = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  for (int32_t t = 0; t < count; ++t) {
    workers.emplace_back([&] {
      for (int64_t i; !failed.load() && (i = next.fetch_add(1)) < n;) {
        absl::Status s = fn(i);
        if (!s.ok()) {
          absl::MutexLock lock(&mu);
          if (first.ok()) first = s;
          failed.store(true);
        }
      }
    });
  }
  for (std::thread& w : workers) w.join();
  return first;
}

absl::Status Fill(RunState& state, int32_t chunk_tokens, int64_t* bytes_sent) {
  std::atomic<int64_t> bytes{0};
  absl::Status s = ParallelFor(
      static_cast<int64_t>(state.sequences.size()), state.options.fill_concurrency, [&](int64_t i) -> absl::Status {
        Sequence& seq = state.sequences[static_cast<size_t>(i)];
        Samples samples;
        SteadyClock::time_point t0 = SteadyClock::now();
        absl::Status created = state.client->CreateSequence(seq.id);
        samples.Add("CreateSequence", SecondsBetween(t0, SteadyClock::now()));
        if (!created.ok()) {
          state.CountError(created);
          return absl::Status(created.code(), absl::StrCat("CreateSequence ", seq.id, ": ", created.message()));
        }
        seq.created = true;
        for (int64_t done = 0; done < seq.prefill;) {
          const int32_t n = static_cast<int32_t>(std::min<int64_t>(chunk_tokens, seq.prefill - done));
          for (int32_t layer = 0; layer < state.num_layers; ++layer) {
            std::string k = state.pool->Slice(n * state.shape.token_bytes());
            std::string v = state.pool->Slice(n * state.shape.token_bytes());
            if (state.check != nullptr) state.check->OnAppend(seq.id, layer, k, v);
            t0 = SteadyClock::now();
            absl::StatusOr<int64_t> length = state.client->AppendKV(seq.id, layer, n, std::move(k), std::move(v));
            samples.Add("AppendKV", SecondsBetween(t0, SteadyClock::now()));
            if (!length.ok()) {
              state.CountError(length.status());
              return absl::Status(length.status().code(),
                                  absl::StrCat("AppendKV of ", n, " tokens to sequence ", seq.id, " layer ", layer,
                                               ": ", length.status().message()));
            }
            const int64_t want = layer == state.num_layers - 1 ? done + n : done;
            if (*length != want) {
              return absl::InternalError(absl::StrCat("AppendKV: sequence ", seq.id, " has ", *length,
                                                      " committed tokens, expected ", want));
            }
            bytes.fetch_add(2 * n * state.shape.token_bytes());
          }
          done += n;
        }
        seq.length = seq.prefill;
        state.AddSamples(std::move(samples));
        return absl::OkStatus();
      });
  *bytes_sent = bytes.load();
  return s;
}

void ReleaseAll(RunState& state) {
  // Failures are counted, not returned: a release is best effort.
  ParallelFor(static_cast<int64_t>(state.sequences.size()), state.options.fill_concurrency, [&](int64_t i) {
    Sequence& seq = state.sequences[static_cast<size_t>(i)];
    if (!seq.created) return absl::OkStatus();
    const SteadyClock::time_point t0 = SteadyClock::now();
    absl::Status s = state.client->ReleaseSequence(seq.id);
    state.AddSample("ReleaseSequence", SecondsBetween(t0, SteadyClock::now()));
    if (s.ok()) {
      seq.created = false;
    } else {
      state.CountError(s);
    }
    return absl::OkStatus();
  }).IgnoreError();
}

}  // namespace

absl::StatusOr<Json> RunLoad(const LoadGenOptions& o, client::Client* client, std::ostream* log) {
  return RunLoad(o, client, {}, log);
}

absl::StatusOr<Json> RunLoad(const LoadGenOptions& o, client::Client* client,
                             const std::vector<client::Client*>& caller_clients, std::ostream* log) {
  auto say = [log](const std::string& line) {
    if (log != nullptr) *log << "pagedattn-loadgen: " << line << std::endl;
  };
  RunState state(o, client);
  state.callers = caller_clients;
  SteadyClock::time_point t0 = SteadyClock::now();
  absl::StatusOr<v1::GetModelConfigResponse> config = client->GetModelConfig();
  state.AddSample("GetModelConfig", SecondsBetween(t0, SteadyClock::now()));
  if (!config.ok()) return config.status();
  if (absl::Status s = Validate(o, *config); !s.ok()) return s;
  absl::StatusOr<kernels::Shape> shape = ShapeFromConfig(*config);
  if (!shape.ok()) return shape.status();
  state.shape = *shape;
  state.num_layers = config->num_layers();

  const int64_t n = o.num_sequences > 0 ? o.num_sequences : int64_t{o.concurrency} * o.batch_size;
  absl::StatusOr<std::vector<int64_t>> lengths = DrawLengths(o.lengths, n, state.shape.page_size);
  if (!lengths.ok()) return lengths.status();

  uint64_t base = o.sequence_id_base;
  if (base == 0) {
    // A random base with room for 2^24 sequences, so that concurrent runs do not collide.
    std::random_device device;
    const uint64_t hi = device(), lo = device();
    base = ((hi << 32) | lo) & ~uint64_t{0xffffff};
    if (base == 0) base = uint64_t{1} << 24;
  }
  state.sequences.resize(static_cast<size_t>(n));
  int64_t prefill_tokens = 0, max_len = 0, min_len = INT64_MAX;
  for (int64_t i = 0; i < n; ++i) {
    Sequence& s = state.sequences[static_cast<size_t>(i)];
    s.id = base + static_cast<uint64_t>(i);
    s.prefill = (*lengths)[static_cast<size_t>(i)];
    prefill_tokens += s.prefill;
    max_len = std::max(max_len, s.prefill);
    min_len = std::min(min_len, s.prefill);
  }
  for (int64_t b = 0; b < n / o.batch_size; ++b) {
    std::vector<int32_t> members;
    for (int64_t i = 0; i < o.batch_size; ++i) members.push_back(static_cast<int32_t>(b * o.batch_size + i));
    state.batches.push_back(std::move(members));
  }

  // Capacity: the prefill plus the tokens that the steps append (when their count is known).
  const int64_t growth = o.decode_kv ? o.warmup_steps + (o.steps > 0 ? o.steps : 1) : 0;
  int64_t pages_needed = 0;
  for (const Sequence& s : state.sequences) pages_needed += state.shape.pages_for(s.prefill + growth);
  t0 = SteadyClock::now();
  absl::StatusOr<v1::GetStatsResponse> stats0 = client->GetStats();
  state.AddSample("GetStats", SecondsBetween(t0, SteadyClock::now()));
  if (!stats0.ok()) return stats0.status();
  if (pages_needed > stats0->pages_free()) {
    return absl::FailedPreconditionError(absl::StrCat(
        n, " sequences of ", min_len, "..", max_len, " tokens (+", growth, " decoded) need ", pages_needed,
        " pages per layer; the server has ", stats0->pages_free(), " free of ", stats0->pages_total(),
        " (start it with a larger --num_pages, or ask for fewer/shorter sequences)"));
  }

  const int64_t limit = std::min<int64_t>(config->max_message_bytes() > 0 ? config->max_message_bytes() : (4 << 20),
                                          64 << 20);
  const int64_t row_bytes = state.shape.token_bytes();
  const int32_t chunk = static_cast<int32_t>(
      std::max<int64_t>(1, std::min<int64_t>(o.prefill_chunk_tokens, (limit - (64 << 10)) / (2 * row_bytes))));
  const int64_t largest_slice =
      std::max<int64_t>(int64_t{chunk} * row_bytes, int64_t{o.batch_size} * state.shape.query_bytes());
  state.pool = std::make_unique<RandomPool>(std::max<int64_t>(16 << 20, 4 * largest_slice), o.seed,
                                            kernels::DTypeName(state.shape.dtype));
  if (o.tensors != "inline") {
    state.slots_per_caller =
        o.api == "stream" || o.local_gpu_sync ? std::max(1, o.stream_in_flight) : 1;
    absl::StatusOr<std::unique_ptr<TensorSlots>> slots =
        TensorSlots::Create(o.tensors, client, state.shape, o.concurrency * state.slots_per_caller,
                            o.batch_size, o.cuda_device, *state.pool);
    if (!slots.ok()) return slots.status();
    state.slots = *std::move(slots);
  }

  ReferenceCheck::Options check_options;
  KvScales scales;
  if (o.check_sequences > 0) {
    // fp8 pages: the check quantizes what it sent with the server's scales (one past the run's
    // sequence ids is free for the probe; the base leaves room for 2^24).
    absl::StatusOr<KvScales> read =
        ReadKvScales(client, state.shape, state.num_layers, base + static_cast<uint64_t>(n));
    if (!read.ok()) return read.status();
    scales = *std::move(read);
    check_options.shape = state.shape;
    check_options.k_scales = scales.k_scales;
    check_options.v_scales = scales.v_scales;
    check_options.num_layers = state.num_layers;
    check_options.max_decodes = o.check_decodes;
    check_options.sm_scale = o.sm_scale;
    state.check = std::make_unique<ReferenceCheck>(check_options);
    // Spread the sampled sequences over the batches.
    const int64_t want = std::min<int64_t>(o.check_sequences, n);
    for (int64_t k = 0; k < want; ++k) state.check->Sample(state.sequences[static_cast<size_t>(k * n / want)].id);
  }

  say(absl::StrCat("server ", config->backend(), ", ", kernels::DescribeShape(state.shape), ", ",
                   config->num_layers(), " layer(s), ", config->num_pages(),
                   " pages; filling ", n, " sequences (", prefill_tokens, " tokens, ", min_len, "..", max_len,
                   ") in chunks of ", chunk));
  int64_t fill_bytes = 0;
  t0 = SteadyClock::now();
  absl::Status filled = Fill(state, chunk, &fill_bytes);
  const double fill_seconds = SecondsBetween(t0, SteadyClock::now());
  if (!filled.ok()) {
    if (o.release) ReleaseAll(state);
    return filled;
  }

  {
    Samples floor;
    for (int32_t i = 0; i < o.rpc_floor_samples; ++i) {
      t0 = SteadyClock::now();
      if (!client->GetModelConfig().ok()) break;
      floor.Add("rpc_floor", SecondsBetween(t0, SteadyClock::now()));
    }
    state.AddSamples(std::move(floor));
  }

  const bool want_metrics = !o.metrics_address.empty();
  Scrape before, after;
  std::string metrics_error;
  v1::GetStatsResponse stats_before, stats_after;
  auto scrape = [&](Scrape* into) {
    if (!want_metrics || !metrics_error.empty()) return;
    absl::StatusOr<Scrape> parsed = ScrapeMetrics(o.metrics_address);
    if (parsed.ok()) {
      *into = *std::move(parsed);
    } else {
      metrics_error = parsed.status().ToString();
    }
  };
  auto start_timed = [&] {
    scrape(&before);
    if (absl::StatusOr<v1::GetStatsResponse> s = client->GetStats(); s.ok()) stats_before = *s;
  };
  say(absl::StrCat("filled in ", absl::StrFormat("%.2f", fill_seconds), " s; ", o.mode, " loop, ",
                   o.mode == "closed" ? absl::StrCat(o.concurrency, " ", o.api, " caller(s), ")
                                      : absl::StrCat(o.rate, " steps/s ", o.arrival, ", "),
                   "batch ", o.batch_size, ", ",
                   o.steps > 0 ? absl::StrCat(o.steps, " steps per batch") : absl::FormatDuration(o.duration)));
  double elapsed = 0;
  Json open_stats;
  absl::Status ran = o.mode == "closed" ? RunClosedLoop(state, start_timed, &elapsed)
                                        : RunOpenLoop(state, start_timed, &elapsed, &open_stats);
  scrape(&after);
  if (absl::StatusOr<v1::GetStatsResponse> s = client->GetStats(); s.ok()) stats_after = *s;
  ReferenceCheck::Result check_result;
  if (state.check != nullptr) {
    say("verifying sampled decodes against the CPU reference");
    check_result = state.check->Verify();
  }
  if (o.release) ReleaseAll(state);
  if (!ran.ok()) return ran;

  RunFacts facts;
  facts.options = &o;
  facts.config = *config;
  facts.kv_scales = scales;
  facts.num_sequences = n;
  facts.prefill_tokens = prefill_tokens;
  facts.prefill_min = min_len;
  facts.prefill_max = max_len;
  facts.prefill_chunk_tokens = chunk;
  facts.fill_seconds = fill_seconds;
  facts.fill_bytes = fill_bytes;
  facts.elapsed = elapsed;
  facts.open_loop = std::move(open_stats);
  facts.stats_before = stats_before;
  facts.stats_after = stats_after;
  facts.metrics_wanted = want_metrics;
  facts.metrics_error = metrics_error;
  facts.metrics_before = std::move(before);
  facts.metrics_after = std::move(after);
  facts.check_enabled = state.check != nullptr;
  facts.check_options = check_options;
  facts.check_result = check_result;
  return BuildResult(facts, state);
}

}  // namespace pagedattn::loadgen
