// pagedattn-loadgen: drives a pagedattn server like an LLM scheduler and reports throughput,
// latency and the server's breakdown as JSON. See client/loadgen/README.md.
//   pagedattn-loadgen --target=127.0.0.1:50051 --batch_size=64 --context_len=4096 --steps=200 --out=r.json
//   pagedattn-loadgen --sweep_batch_sizes=1,8,32,64 --sweep_context_lens=512,4096 --out=sweep.json
// Exit status: 0 on success; 1 when a run fails, the reference check fails or no decode
// succeeded; 2 for bad flags.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/loadgen/json.h"
#include "client/loadgen/loadgen.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "The server's gRPC address (any gRPC target)");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "The server's Prometheus host:port, read before and after the timed phase; empty: not read");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "Deadline of each call");
ABSL_FLAG(absl::Duration, wait_for_server, absl::Seconds(10), "How long to wait for the channel to connect");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "Client send/receive limit (keep >= the server's)");
ABSL_FLAG(bool, connection_per_caller, true,
          "Closed loop: each caller on a TCP/HTTP/2 connection of its own (false: all share one)");
ABSL_FLAG(int32_t, http2_window_bytes, 8 << 20,
          "HTTP/2 stream window this client grants, fixed (no BDP probing); 0: gRPC's default");
ABSL_FLAG(bool, busy_poll, false,
          "Unary calls (and the rpc_floor) wait by spinning on the calling thread instead of "
          "sleeping (ClientOptions::busy_poll): one busy core per caller");
ABSL_FLAG(int32_t, http2_max_frame_bytes, 0, "Largest HTTP/2 frame this client accepts; 0: gRPC's 16 KiB");

ABSL_FLAG(std::string, mode, "closed", "closed (concurrency callers) | open (steps arrive at --rate)");
ABSL_FLAG(std::string, api, "unary", "closed loop: unary Decode calls | stream (one DecodeStream per caller)");
ABSL_FLAG(int32_t, concurrency, 1, "Closed loop: concurrent callers; open loop: warmup threads");
ABSL_FLAG(int32_t, batch_size, 1, "Sequences per Decode request");
ABSL_FLAG(int64_t, num_sequences, 0, "Sequences in all (a multiple of batch_size); 0: concurrency x batch_size");
ABSL_FLAG(bool, decode_kv, true,
          "Each step appends a new token per sequence (a real decode step, contexts grow); false: attend only");

ABSL_FLAG(std::string, lengths, "fixed", "Context lengths: fixed | uniform | workload");
ABSL_FLAG(int64_t, context_len, 4096, "fixed: tokens per sequence");
ABSL_FLAG(int64_t, min_context_len, 512, "uniform: smallest length");
ABSL_FLAG(int64_t, max_context_len, 8192, "uniform: largest length");
ABSL_FLAG(std::string, workload_file, "",
          "workload: a JSONL of workload shapes; empty: "
          "kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl (from the repository root)");
ABSL_FLAG(std::string, workload_shapes, "", "workload: comma-separated shape names (empty: every shape)");
ABSL_FLAG(std::string, workload_order, "cycle", "workload: cycle through the sequences in order | random");
ABSL_FLAG(int64_t, max_workload_len, 0, "workload: clamp each length to this many tokens (0: no clamp)");
ABSL_FLAG(int32_t, workload_page_size, 0,
          "workload: tokens per page of the file's kv_indptr/kv_last_page_len; 0: the _ps<N> of its name, "
          "else the server's page size");

ABSL_FLAG(int32_t, prefill_chunk_tokens, 2048, "Tokens per AppendKV (capped by the message limit)");
ABSL_FLAG(int32_t, fill_concurrency, 4, "Threads creating, filling and releasing sequences");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(5), "Timed phase length (when --steps=0)");
ABSL_FLAG(int64_t, steps, 0, "> 0: steps per batch in the timed phase instead of --duration");
ABSL_FLAG(int64_t, warmup_steps, 2, "Untimed steps per batch before the timed phase");
ABSL_FLAG(double, rate, 0, "Open loop: steps per second");
ABSL_FLAG(std::string, arrival, "poisson", "Open loop: poisson | fixed");
ABSL_FLAG(int32_t, stream_in_flight, 1, "Stream: requests in flight per stream (layers/steps pipelined)");
ABSL_FLAG(std::string, tensors, "inline",
          "Where Decode tensors travel: inline (in the messages), system (a registered shared-memory "
          "region, written and read in place) or cuda (registered device memory, CUDA builds); "
          "closed loop only");
ABSL_FLAG(std::string, transport, "grpc",
          "How Decodes travel: grpc (an RPC each) | local (a local channel per caller: shared-memory "
          "rings; needs --tensors=system|cuda, the closed loop and --api=unary)");
ABSL_FLAG(int64_t, local_spin_us, 2000,
          "--transport=local: how long a caller busy-waits for its completion before it sleeps");
ABSL_FLAG(bool, local_gpu_sync, false,
          "--transport=local --tensors=cuda: order each caller's steps on its GPU through the channel's "
          "sync words (no host round trip per layer), with --stream_in_flight submissions outstanding");
ABSL_FLAG(bool, device_latency, false,
          "--local_gpu_sync: also time each step on the caller's stream with CUDA events (the device "
          "latency); off by default: the one run with it saw the server's kernels slow down");
ABSL_FLAG(int32_t, cuda_device, 0, "--tensors=cuda: the CUDA device of the registered memory");
ABSL_FLAG(int32_t, max_retries, 10, "Retries of a Decode answered UNAVAILABLE");

ABSL_FLAG(int32_t, rpc_floor_samples, 200,
          "GetModelConfig round trips timed before the run: this client's RPC floor (latency \"rpc_floor\")");
ABSL_FLAG(int32_t, check_sequences, 0, "Sequences whose decodes are checked against the CPU reference; 0: off");
ABSL_FLAG(int64_t, check_decodes, 32, "Sequence-decodes checked at most (spread over the run)");
ABSL_FLAG(float, sm_scale, 0.0f, "Softmax scale sent with each Decode; 0: the server's 1/sqrt(head_dim)");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the lengths and the random data");
ABSL_FLAG(uint64_t, sequence_id_base, 0, "Sequence ids are base + i; 0: a random base");
ABSL_FLAG(bool, release, true, "Release the sequences at the end");

ABSL_FLAG(std::string, sweep_batch_sizes, "", "Sweep: comma-separated batch sizes (default: --batch_size)");
ABSL_FLAG(std::string, sweep_context_lens, "", "Sweep: comma-separated fixed context lengths (default: --context_len)");
ABSL_FLAG(std::string, out, "", "Write the JSON result (or the sweep's) here");

namespace {

using pagedattn::loadgen::Json;

bool ParseList(const std::string& text, std::vector<int64_t>* out) {
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) return false;
    out->push_back(v);
  }
  return true;
}

pagedattn::loadgen::LoadGenOptions OptionsFromFlags() {
  pagedattn::loadgen::LoadGenOptions o;
  o.mode = absl::GetFlag(FLAGS_mode);
  o.api = absl::GetFlag(FLAGS_api);
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.num_sequences = absl::GetFlag(FLAGS_num_sequences);
  o.decode_kv = absl::GetFlag(FLAGS_decode_kv);
  o.lengths.distribution = absl::GetFlag(FLAGS_lengths);
  o.lengths.fixed_len = absl::GetFlag(FLAGS_context_len);
  o.lengths.min_len = absl::GetFlag(FLAGS_min_context_len);
  o.lengths.max_len = absl::GetFlag(FLAGS_max_context_len);
  o.lengths.workload_file = absl::GetFlag(FLAGS_workload_file);
  o.lengths.shape_names = absl::StrSplit(absl::GetFlag(FLAGS_workload_shapes), ',', absl::SkipWhitespace());
  o.lengths.workload_order = absl::GetFlag(FLAGS_workload_order);
  o.lengths.max_workload_len = absl::GetFlag(FLAGS_max_workload_len);
  o.lengths.workload_page_size = absl::GetFlag(FLAGS_workload_page_size);
  o.lengths.seed = absl::GetFlag(FLAGS_seed);
  o.prefill_chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens);
  o.fill_concurrency = absl::GetFlag(FLAGS_fill_concurrency);
  o.duration = absl::GetFlag(FLAGS_duration);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  o.rate = absl::GetFlag(FLAGS_rate);
  o.arrival = absl::GetFlag(FLAGS_arrival);
  o.stream_in_flight = absl::GetFlag(FLAGS_stream_in_flight);
  o.tensors = absl::GetFlag(FLAGS_tensors);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.local_spin = absl::Microseconds(absl::GetFlag(FLAGS_local_spin_us));
  o.local_gpu_sync = absl::GetFlag(FLAGS_local_gpu_sync);
  o.device_latency = absl::GetFlag(FLAGS_device_latency);
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  o.max_retries = absl::GetFlag(FLAGS_max_retries);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  o.rpc_floor_samples = absl::GetFlag(FLAGS_rpc_floor_samples);
  o.check_sequences = absl::GetFlag(FLAGS_check_sequences);
  o.check_decodes = absl::GetFlag(FLAGS_check_decodes);
  o.sm_scale = absl::GetFlag(FLAGS_sm_scale);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.sequence_id_base = absl::GetFlag(FLAGS_sequence_id_base);
  o.release = absl::GetFlag(FLAGS_release);
  return o;
}

bool WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!(out << text)) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// Whether a result counts as a success: decodes happened and the check (if on) passed.
bool Succeeded(const Json& result) {
  const Json* run = result.Find("run");
  const Json* decodes = run != nullptr ? run->Find("sequence_decodes") : nullptr;
  if (decodes == nullptr || decodes->number() <= 0) return false;
  const Json* check = result.Find("check");
  const Json* enabled = check != nullptr ? check->Find("enabled") : nullptr;
  if (enabled != nullptr && enabled->boolean()) {
    const Json* passed = check->Find("passed");
    return passed != nullptr && passed->boolean();
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pagedattn-loadgen [flags]: create and fill sequences on a pagedattn server, decode them in a closed or "
      "open loop, and report throughput, latency and the server's breakdown as JSON");
  absl::ParseCommandLine(argc, argv);

  pagedattn::loadgen::LoadGenOptions base = OptionsFromFlags();
  std::vector<int64_t> sweep_b, sweep_ctx;
  if (!ParseList(absl::GetFlag(FLAGS_sweep_batch_sizes), &sweep_b) ||
      !ParseList(absl::GetFlag(FLAGS_sweep_context_lens), &sweep_ctx)) {
    std::cerr << "pagedattn-loadgen: --sweep_* take comma-separated positive integers\n";
    return 2;
  }
  const bool sweep = !sweep_b.empty() || !sweep_ctx.empty();
  if (sweep_b.empty()) sweep_b.push_back(base.batch_size);
  if (sweep_ctx.empty()) sweep_ctx.push_back(base.lengths.fixed_len);

  pagedattn::client::ClientOptions client_options;
  client_options.target = absl::GetFlag(FLAGS_target);
  client_options.timeout = absl::GetFlag(FLAGS_timeout);
  client_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  client_options.http2_window_bytes = absl::GetFlag(FLAGS_http2_window_bytes);
  client_options.http2_max_frame_bytes = absl::GetFlag(FLAGS_http2_max_frame_bytes);
  client_options.busy_poll = absl::GetFlag(FLAGS_busy_poll);
  auto client = pagedattn::client::Client::Connect(client_options);
  if (!client.ok()) {
    std::cerr << "pagedattn-loadgen: " << client.status() << "\n";
    return 2;
  }
  if (absl::Status s = (*client)->WaitForConnected(absl::GetFlag(FLAGS_wait_for_server)); !s.ok()) {
    std::cerr << "pagedattn-loadgen: " << s << "\n";
    return 1;
  }

  // One client (and connection) per closed-loop caller beyond the first, which uses `client`.
  std::vector<std::unique_ptr<pagedattn::client::Client>> extra;
  std::vector<pagedattn::client::Client*> callers;
  if (absl::GetFlag(FLAGS_connection_per_caller) && base.mode == "closed" && base.concurrency > 1) {
    callers.push_back(client->get());
    pagedattn::client::ClientOptions own = client_options;
    own.own_connection = true;
    for (int32_t c = 1; c < base.concurrency; ++c) {
      auto more = pagedattn::client::Client::Connect(own);
      if (!more.ok()) {
        std::cerr << "pagedattn-loadgen: " << more.status() << "\n";
        return 2;
      }
      if (absl::Status s = (*more)->WaitForConnected(absl::GetFlag(FLAGS_wait_for_server)); !s.ok()) {
        std::cerr << "pagedattn-loadgen: " << s << "\n";
        return 1;
      }
      callers.push_back(more->get());
      extra.push_back(*std::move(more));
    }
  }

  Json points = Json::Array();
  Json single;
  std::string sweep_shape;
  bool all_ok = true;
  for (const int64_t ctx : sweep_ctx) {
    for (const int64_t b : sweep_b) {
      pagedattn::loadgen::LoadGenOptions o = base;
      if (sweep) {
        o.batch_size = static_cast<int32_t>(b);
        o.lengths.distribution = "fixed";
        o.lengths.fixed_len = ctx;
        o.num_sequences = 0;
      }
      absl::StatusOr<Json> result = pagedattn::loadgen::RunLoad(o, client->get(), callers, &std::cerr);
      if (!result.ok()) {
        std::cerr << "pagedattn-loadgen: " << result.status() << "\n";
        if (!sweep) return result.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
        all_ok = false;
        Json failed = Json::Object();
        failed.Set("batch_size", b);
        failed.Set("context_len", ctx);
        failed.Set("error", result.status().ToString());
        points.Push(std::move(failed));
        continue;
      }
      if (Json* cfg = result->Find("config"); cfg != nullptr) {
        cfg->Set("target", client_options.target);
        cfg->Set("busy_poll", client_options.busy_poll);
      }
      std::cout << pagedattn::loadgen::FormatSummary(*result) << std::flush;
      if (const Json* shape = result->Find("shape"); shape != nullptr) sweep_shape = shape->string();
      all_ok = all_ok && Succeeded(*result);
      if (sweep) {
        points.Push(*std::move(result));
      } else {
        single = *std::move(result);
      }
    }
  }

  Json out = std::move(single);
  if (sweep) {
    out = Json::Object();
    out.Set("schema", "pagedattn-loadgen-sweep/1");
    out.Set("target", client_options.target);
    // The server's shape (each point names it too; one server serves one shape).
    if (!sweep_shape.empty()) out.Set("shape", sweep_shape);
    Json bs = Json::Array();
    for (const int64_t b : sweep_b) bs.Push(b);
    Json cs = Json::Array();
    for (const int64_t c : sweep_ctx) cs.Push(c);
    out.Set("batch_sizes", std::move(bs));
    out.Set("context_lens", std::move(cs));
    out.Set("points", std::move(points));
  }
  const std::string path = absl::GetFlag(FLAGS_out);
  if (!path.empty()) {
    if (!WriteFile(path, out.Dump())) {
      std::cerr << "pagedattn-loadgen: cannot write " << path << "\n";
      return 1;
    }
  }
  return all_ok ? 0 : 1;
}
