// pagedattn-server: flags -> Options, wiring (metrics, backend, engine, gRPC server, Prometheus
// exposer) and signals. SIGTERM/SIGINT: health NOT_SERVING, stop accepting calls, let calls in
// progress and queued work finish within --drain_timeout, shut down, exit 0.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "prometheus/exposer.h"
#include "server/backend/backend.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/engine/model_options.h"
#include "server/metrics/metrics.h"
#include "server/service/auth.h"
#include "server/service/grpc_server.h"
#if PAGEDATTN_HAVE_CUDA
// The CUDA backend: CudaDeviceCount(), CudaBackend::Create() and CudaBackend::PagesThatFit().
#include "server/backend/cuda_backend.h"
#endif

ABSL_FLAG(std::string, grpc_address, "127.0.0.1:50051",
          "host:port for gRPC (plaintext unless --tls_cert/--tls_key); port 0 picks a free port; "
          "unix:/path listens on a Unix domain socket instead (for callers on this host)");
ABSL_FLAG(std::string, unix_socket_mode, "0600",
          "Permissions (octal) of the --grpc_address=unix:/path socket file: who may connect");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the gRPC server; with --tls_key turns on TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: when set, clients must present a certificate signed by it (mutual TLS)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token every pagedattn.v1 call must carry (authorization: Bearer "
          "<token>); read once at start; health and reflection are exempt; empty: no check");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "host:port for Prometheus /metrics (always plaintext, no auth: bind it to a private "
          "address); port 0 picks a free port; empty disables it");
ABSL_FLAG(std::string, backend, "auto",
          "auto|cpu|cuda: auto takes cuda when this build has the CUDA backend and a device is "
          "present, else cpu");
ABSL_FLAG(int64_t, num_pages, 0,
          "KV pages per layer (64 tokens, 128 KiB of K+V each); 0: 4096 on the CPU backend, and "
          "on CUDA the pages that fit in --gpu_memory_fraction of the free device memory");
ABSL_FLAG(double, gpu_memory_fraction, 0.9,
          "CUDA backend with --num_pages=0: share (0, 1] of the free device memory that the pool "
          "and its staging buffers may take");
ABSL_FLAG(int32_t, cuda_max_in_flight, 2,
          "CUDA backend: batches on the GPU at once (1..4); the host forms the next while one runs");
ABSL_FLAG(int64_t, cuda_spin_wait_us, 2000,
          "CUDA backend: microseconds the executor spins on a batch's completion before it "
          "sleeps between polls");
ABSL_FLAG(int32_t, cuda_copy_threads, 4,
          "CUDA backend: host threads (1..64, the executor included) that copy a batch's q and "
          "k/v rows into pinned memory and its outputs out of it, when it has 128 KiB or more");
ABSL_FLAG(int64_t, cuda_host_ring_mib, 128,
          "CUDA backend: MiB of pinned host memory that Decode requests are received into (their "
          "q and k/v copied once on the RPC thread) and answered from, so that a batch of one or "
          "two requests is copied to and from the GPU without host packing; 0: none");
ABSL_FLAG(int64_t, idle_spin_us, -1,
          "Microseconds the engine's executor and completion threads spin for new work before "
          "they sleep (a core each while they spin; saves a thread wake-up per request); -1: "
          "2000 on the CUDA backend, 0 on the CPU backend");
ABSL_FLAG(std::string, completion_thread, "auto",
          "auto|on|off: run response callbacks on a thread of their own so the executor goes back "
          "to launching at once; auto: on for the CUDA backend, off for the CPU backend");
ABSL_FLAG(int32_t, http2_window_bytes, 8 << 20,
          "HTTP/2 stream flow-control window granted to clients, fixed (no BDP probing); 0: "
          "gRPC's default 64 KiB grown by probing");
ABSL_FLAG(int32_t, http2_max_frame_bytes, 0,
          "Largest HTTP/2 frame accepted (16384..16777215); 0: gRPC's default 16 KiB");
ABSL_FLAG(int32_t, num_layers, 1, "Layers in the KV pool");
ABSL_FLAG(int32_t, num_qo_heads, pagedattn::kernels::Shape{}.num_qo_heads,
          "Query heads of the model (of this shard under tensor parallelism)");
ABSL_FLAG(int32_t, num_kv_heads, pagedattn::kernels::Shape{}.num_kv_heads,
          "KV heads; num_qo_heads must be 1 to 8 times as many");
ABSL_FLAG(int32_t, head_dim, pagedattn::kernels::Shape{}.head_dim, "Head size: 64, 128 or 256");
ABSL_FLAG(int32_t, page_size, pagedattn::kernels::Shape{}.page_size,
          "Tokens per KV page: 16, 32 or 64");
ABSL_FLAG(std::string, dtype, "bf16",
          "Element type of q, k, v and output as callers send and receive them: bf16 or fp16");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "Element type of the pages: auto (= --dtype) or fp8_e4m3 (k and v quantized on write)");
ABSL_FLAG(std::string, kv_cache_scales_file, "",
          "fp8 pages: JSON {\"k_scale\": [one per layer], \"v_scale\": [...]}; empty: 1.0");
ABSL_FLAG(int32_t, max_batch_size, 64, "Most sequences per backend launch (and per Decode)");
ABSL_FLAG(int64_t, max_queue_delay_us, 200, "Longest wait, in microseconds, to fill a batch");
ABSL_FLAG(int32_t, max_queue_depth, 4096, "Work items waiting for a batch; more get UNAVAILABLE");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend threads; 0 = one per hardware thread");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "gRPC send/receive limit per message; larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, stream_max_in_flight, 32, "DecodeStream requests in flight per stream");
ABSL_FLAG(int64_t, export_piece_mib, 8,
          "ExportSequence into a host-memory region: MiB of K and V per piece, each sent as soon "
          "as it is written; 0: one chunk per layer");
ABSL_FLAG(int32_t, max_memory_regions, 256,
          "Memory regions (tensors by reference) clients may register at once; more get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, local_channels, "on",
          "on|off: OpenLocalChannel (Decode steps through shared-memory rings) for callers on a "
          "Unix socket or loopback; others get PERMISSION_DENIED");
ABSL_FLAG(int32_t, max_local_channels, 64, "Local channels open at once (1..126)");
ABSL_FLAG(int64_t, local_gpu_sync_timeout_ms, 2000,
          "gpu_sync local channels: how long the server's streams wait for a caller's ready word "
          "before the server writes it itself and breaks the channel (ms, > 0)");
ABSL_FLAG(int64_t, local_spin_us, 50,
          "How long the local channel poller spins after its last work before it sleeps");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long calls in progress and queued work may take to finish");
ABSL_FLAG(int64_t, host_kv_bytes, 0,
          "Bytes of host memory (pinned on CUDA) for the host tier of offloaded KV pages, in "
          "pages of 128 KiB x num_layers; 0 = no host tier");
ABSL_FLAG(std::string, kv_offload_policy, "none",
          "none: a step without free pages is RESOURCE_EXHAUSTED; lru: it first offloads the "
          "least recently used idle sequences to the host tier");

namespace pagedattn {
namespace {

constexpr int64_t kCpuDefaultPages = 4096;

// Whether this build has a CUDA backend and a device is present.
bool CudaBackendAvailable() {
#if PAGEDATTN_HAVE_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

#if PAGEDATTN_HAVE_CUDA
CudaBackend::Options CudaOptionsFromFlags() {
  CudaBackend::Options options;
  options.max_in_flight = absl::GetFlag(FLAGS_cuda_max_in_flight);
  options.spin_wait_us = absl::GetFlag(FLAGS_cuda_spin_wait_us);
  options.copy_threads = absl::GetFlag(FLAGS_cuda_copy_threads);
  options.host_ring_bytes = absl::GetFlag(FLAGS_cuda_host_ring_mib) * (int64_t{1} << 20);
  // options.tuning keeps its defaults: the measured-best launch choices.
  return options;
}
#endif

// --num_pages, with 0 resolved for the chosen backend (printed when it comes from the device).
absl::StatusOr<int64_t> ResolveNumPages(std::string_view backend_name,
                                        const kernels::Shape& model) {
  const int64_t pages = absl::GetFlag(FLAGS_num_pages);
  if (pages < 0) return absl::InvalidArgumentError("--num_pages must be >= 0");
  if (pages > 0) return pages;
#if PAGEDATTN_HAVE_CUDA
  if (backend_name == "cuda") {
    const double fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
    absl::StatusOr<CudaBackend::MemoryFit> fit = CudaBackend::PagesThatFit(
        CudaOptionsFromFlags(), model, absl::GetFlag(FLAGS_num_layers),
        absl::GetFlag(FLAGS_max_batch_size),
        fraction);
    if (!fit.ok()) return fit.status();
    constexpr double kGiB = 1 << 30;
    std::cout << "pagedattn-server: --num_pages=0: " << fit->num_pages << " pages per layer fit in "
              << fraction << " of the device's " << fit->free_bytes / kGiB << " GiB free (of "
              << fit->total_bytes / kGiB << " GiB)" << std::endl;
    return fit->num_pages;
  }
#else
  (void)backend_name;
  (void)model;
#endif
  return kCpuDefaultPages;
}

// The model shape and the fp8 scales from their flags; INVALID_ARGUMENT (with the supported
// set) for a shape this service does not serve.
absl::Status ModelFromFlags(Engine::Options* options) {
  kernels::Shape& model = options->model;
  model.num_qo_heads = absl::GetFlag(FLAGS_num_qo_heads);
  model.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  model.head_dim = absl::GetFlag(FLAGS_head_dim);
  model.page_size = absl::GetFlag(FLAGS_page_size);
  absl::StatusOr<kernels::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--dtype: ", dtype.status().message()));
  model.dtype = *dtype;
  const std::string kv = absl::GetFlag(FLAGS_kv_cache_dtype);
  absl::StatusOr<kernels::DType> kv_dtype = kv == "auto" ? *dtype : ParseDType(kv);
  if (!kv_dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype: ", kv_dtype.status().message()));
  }
  model.kv_dtype = *kv_dtype;
  if (const kernels::KernelStatus s = kernels::ValidateShape(model); !s.ok()) {
    return absl::InvalidArgumentError(s.message);
  }
  const std::string scales_file = absl::GetFlag(FLAGS_kv_cache_scales_file);
  if (scales_file.empty()) return absl::OkStatus();
  if (model.kv_dtype != kernels::DType::kFp8E4m3) {
    return absl::InvalidArgumentError("--kv_cache_scales_file needs --kv_cache_dtype=fp8_e4m3");
  }
  std::ifstream in(scales_file);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", scales_file));
  absl::StatusOr<KvCacheScales> scales = ParseKvCacheScales(text.str(), options->num_layers);
  if (!scales.ok()) return scales.status();
  options->k_scales = std::move(scales->k_scale);
  options->v_scales = std::move(scales->v_scale);
  return absl::OkStatus();
}

// The one place the backend is chosen. `choice` is auto, cpu or cuda.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(std::string_view choice, int32_t cpu_threads) {
  if (choice == "auto") choice = CudaBackendAvailable() ? "cuda" : "cpu";
  if (choice == "cuda") {
#if PAGEDATTN_HAVE_CUDA
    if (!CudaBackendAvailable()) {
      return absl::FailedPreconditionError(
          "--backend=cuda: no CUDA device of compute capability 9.0 (Hopper) is present; use "
          "--backend=cpu or auto");
    }
    absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create(CudaOptionsFromFlags());
    if (!cuda.ok()) return cuda.status();
    return std::unique_ptr<Backend>(*std::move(cuda));
#else
    return absl::FailedPreconditionError(
        "--backend=cuda: this build has no CUDA backend (built without nvcc or with "
        "-DPAGEDATTN_ENABLE_CUDA=OFF); use --backend=cpu or auto");
#endif
  }
  if (choice == "cpu") {
    CpuBackend::Options options;
    options.num_threads = cpu_threads > 0
                              ? cpu_threads
                              : static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(options);
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<Backend>(*std::move(cpu));
  }
  return absl::InvalidArgumentError(absl::StrCat("--backend must be auto, cpu or cuda, got ", std::string(choice)));
}

int Fail(std::string_view what, const absl::Status& status) {
  std::cerr << "pagedattn-server: " << what << ": " << status << std::endl;
  return 1;
}

// The PEM files and token file named by the flags, read once.
absl::Status ReadSecurityFlags(GrpcServer::Options* options) {
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  const std::string client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!client_ca.empty() && cert.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  for (auto [path, pem] : {std::pair{&cert, &options->tls.cert_pem},
                           std::pair{&key, &options->tls.key_pem},
                           std::pair{&client_ca, &options->tls.client_ca_pem}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> content = ReadSecretFile(*path);
    if (!content.ok()) return content.status();
    *pem = *std::move(content);
  }
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> content = ReadSecretFile(token_file);
    if (!content.ok()) return content.status();
    absl::StatusOr<std::string> token = ParseToken(*content);
    if (!token.ok()) return absl::InvalidArgumentError(absl::StrCat(token_file, ": ", token.status().message()));
    options->auth_token = *std::move(token);
  }
  return absl::OkStatus();
}

// Request tensors are ~0.5 MB per Decode of 64 sequences and up to the message limit per
// AppendKV, allocated on gRPC threads and freed on the engine's. glibc serves blocks over its
// (adaptive) mmap threshold with mmap/munmap, and trims freed heap tops back to the system:
// both turn every request into page faults and TLB shootdowns. Keep blocks up to 32 MiB (the
// largest threshold glibc takes) in the heap and the heap resident.
void TuneMalloc() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int Serve() {
  TuneMalloc();
  // Block the shutdown signals in every thread (the ones started below inherit the mask); the
  // main thread takes them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // The model shape first: a shape this service does not serve stops it before anything starts.
  Engine::Options engine_options;
  engine_options.num_layers = absl::GetFlag(FLAGS_num_layers);
  if (absl::Status s = ModelFromFlags(&engine_options); !s.ok()) return Fail("model shape", s);

  Metrics metrics;
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  const std::string metrics_address = absl::GetFlag(FLAGS_metrics_address);
  if (!metrics_address.empty()) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(metrics_address);
    } catch (const std::exception& e) {
      return Fail("metrics", absl::UnavailableError(absl::StrCat("cannot listen on ", metrics_address,
                                                                 ": ", e.what())));
    }
    exposer->RegisterCollectable(metrics.registry());
    const std::vector<int> ports = exposer->GetListeningPorts();
    metrics_port = ports.empty() ? 0 : ports.front();
  }

  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeBackend(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_cpu_threads));
  if (!backend.ok()) return Fail("backend", backend.status());
  const std::string backend_name((*backend)->name());

  absl::StatusOr<int64_t> num_pages = ResolveNumPages(backend_name, engine_options.model);
  if (!num_pages.ok()) return Fail("num_pages", num_pages.status());
  engine_options.num_pages = *num_pages;
  engine_options.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  engine_options.max_queue_delay = absl::Microseconds(absl::GetFlag(FLAGS_max_queue_delay_us));
  engine_options.max_queue_depth = absl::GetFlag(FLAGS_max_queue_depth);
  engine_options.max_memory_regions = absl::GetFlag(FLAGS_max_memory_regions);
  const bool cuda = backend_name == "cuda";
  const int64_t spin_us = absl::GetFlag(FLAGS_idle_spin_us);
  engine_options.idle_spin = absl::Microseconds(spin_us >= 0 ? spin_us : (cuda ? 2000 : 0));
  const std::string completion = absl::GetFlag(FLAGS_completion_thread);
  if (completion != "auto" && completion != "on" && completion != "off") {
    return Fail("flags", absl::InvalidArgumentError("--completion_thread must be auto, on or off"));
  }
  engine_options.completion_thread = completion == "on" || (completion == "auto" && cuda);
  {
    const int64_t host_bytes = absl::GetFlag(FLAGS_host_kv_bytes);
    // A host page holds one pool page of every layer, K and V, as the pages store them.
    const int64_t host_page_bytes =
        2 * int64_t{engine_options.num_layers} * engine_options.model.page_bytes();
    const std::string policy = absl::GetFlag(FLAGS_kv_offload_policy);
    if (host_bytes < 0 || (host_bytes > 0 && host_bytes < host_page_bytes)) {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--host_kv_bytes must be 0 or at least one host page (",
                               host_page_bytes, " bytes: 2 x num_layers x a page's bytes)")));
    }
    if (policy != "none" && policy != "lru") {
      return Fail("flags", absl::InvalidArgumentError("--kv_offload_policy must be none or lru"));
    }
    engine_options.host_pages = host_bytes / host_page_bytes;
    engine_options.offload_lru = policy == "lru";
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(engine_options, *std::move(backend), &metrics);
  if (!engine.ok()) return Fail("engine", engine.status());

  GrpcServer::Options server_options;
  if (absl::Status security = ReadSecurityFlags(&server_options); !security.ok()) {
    (*engine)->Shutdown(absl::ZeroDuration());
    return Fail("security flags", security);
  }
  server_options.address = absl::GetFlag(FLAGS_grpc_address);
  {
    const std::string mode = absl::GetFlag(FLAGS_unix_socket_mode);
    char* end = nullptr;
    const unsigned long parsed = std::strtoul(mode.c_str(), &end, 8);
    if (mode.empty() || *end != '\0' || parsed > 0777) {
      (*engine)->Shutdown(absl::ZeroDuration());
      return Fail("flags", absl::InvalidArgumentError("--unix_socket_mode must be octal, 0..0777"));
    }
    server_options.unix_socket_mode = static_cast<uint32_t>(parsed);
  }
  server_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  server_options.stream_max_in_flight = absl::GetFlag(FLAGS_stream_max_in_flight);
  server_options.export_piece_bytes = absl::GetFlag(FLAGS_export_piece_mib) << 20;
  server_options.http2_window_bytes = absl::GetFlag(FLAGS_http2_window_bytes);
  server_options.http2_max_frame_bytes = absl::GetFlag(FLAGS_http2_max_frame_bytes);
  {
    const std::string local = absl::GetFlag(FLAGS_local_channels);
    if (local != "on" && local != "off") {
      (*engine)->Shutdown(absl::ZeroDuration());
      return Fail("flags", absl::InvalidArgumentError("--local_channels must be on or off"));
    }
    server_options.local_channels = local == "on";
    server_options.local.max_channels = absl::GetFlag(FLAGS_max_local_channels);
    server_options.local.spin = absl::Microseconds(absl::GetFlag(FLAGS_local_spin_us));
    server_options.local.gpu_sync_timeout =
        absl::Milliseconds(absl::GetFlag(FLAGS_local_gpu_sync_timeout_ms));
  }
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start(server_options, engine->get(), &metrics);
  if (!server.ok()) {
    (*engine)->Shutdown(absl::ZeroDuration());
    return Fail("grpc", server.status());
  }

  const ModelConfig config = (*engine)->config();
  const std::string metrics_host = metrics_address.substr(0, metrics_address.rfind(':'));
  const double pool_gib = 2.0 * config.num_layers * static_cast<double>(config.num_pages) *
                          config.page_size * config.num_kv_heads * config.head_dim * 2 / (1 << 30);
  std::cout << "pagedattn-server: backend " << backend_name << ", pool " << config.num_layers
            << " layer(s) x " << config.num_pages << " pages (" << pool_gib << " GiB of K+V), "
            << "max_batch_size " << config.max_batch_size << std::endl;
  std::cout << "pagedattn-server: grpc tls "
            << (server_options.tls.cert_pem.empty()         ? "off"
                : server_options.tls.client_ca_pem.empty() ? "on"
                                                           : "mutual (client certificates required)")
            << ", bearer token " << (server_options.auth_token.empty() ? "off" : "required")
            << "; metrics endpoint is plaintext without auth" << std::endl;
  // Tests and scripts read the ports from this line.
  std::cout << "pagedattn-server: serving grpc=" << (*server)->target()
            << " metrics="
            << (metrics_address.empty() ? std::string("off")
                                        : absl::StrCat(metrics_host, ":", metrics_port))
            << std::endl;

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  std::cout << "pagedattn-server: signal " << signal_number << ", draining for up to "
            << absl::FormatDuration(drain) << std::endl;
  const absl::Time deadline = absl::Now() + drain;
  (*server)->Shutdown(deadline);
  (*engine)->Shutdown(std::max(absl::ZeroDuration(), deadline - absl::Now()));
  const EngineStats stats = (*engine)->GetStats();
  std::cout << "pagedattn-server: stopped after " << stats.batches << " batches" << std::endl;
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("pagedattn-server [flags]: the paged KV cache and decode service");
  absl::ParseCommandLine(argc, argv);
  return pagedattn::Serve();
}
