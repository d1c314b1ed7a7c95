// pagedattn-cli: one pagedattn.v1 call per invocation, for people and scripts.
//   pagedattn-cli [flags] config | stats
//   pagedattn-cli [flags] create ID | release ID | fork PARENT CHILD
//   pagedattn-cli [flags] append ID [--num_tokens=N] [--layer=L] [--k_file=F --v_file=F]
//   pagedattn-cli [flags] decode ID[,ID...] [--layer=L] [--with_kv] [--q_file=F] [--output_file=F]
//   pagedattn-cli [flags] memory | register NAME KEY BYTES [--offset=O] | unregister NAME
//   pagedattn-cli [flags] export ID FILE | import ID FILE | offload ID | migrate ID TARGET
//   [--via_region] [--repeat=N]
// Exit status: 0 on success, 1 when the call fails (the status is printed), 2 for bad usage.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "google/protobuf/util/delimited_message_util.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/bf16.h"
#include "client/client.h"
#include "client/migration.h"
#ifdef PAGEDATTN_CLI_CUDA
#include "client/cuda_region.h"
#endif
#include "client/tls_flags.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address (any gRPC target)");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "Client send/receive message limit in bytes");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(60), "Deadline of each call (0: none)");
ABSL_FLAG(std::string, auth_token_file, "", "File holding the bearer token to send on every call");
ABSL_FLAG(int32_t, layer, -1, "Layer for append/decode; -1 walks every layer 0..L-1 in order");
ABSL_FLAG(int32_t, num_tokens, 64, "append: tokens of random K/V (ignored with --k_file/--v_file)");
ABSL_FLAG(std::string, k_file, "",
          "append: raw K [num_tokens, num_kv_heads, head_dim] in the server's dtype, for every layer");
ABSL_FLAG(std::string, v_file, "",
          "append: raw V [num_tokens, num_kv_heads, head_dim] in the server's dtype, for every layer");
ABSL_FLAG(bool, with_kv, false, "decode: append one random new token per sequence (a decode step)");
ABSL_FLAG(std::string, q_file, "",
          "decode: raw queries [B, num_qo_heads, head_dim] in the server's dtype (default: random "
          "normal)");
ABSL_FLAG(std::string, output_file, "", "decode: write the last layer's raw output here");
ABSL_FLAG(float, sm_scale, 0.0f, "decode: softmax scale (0: 1/sqrt(head_dim))");
ABSL_FLAG(uint64_t, request_id, 1, "decode: request id (echoed by the server)");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random normal data");
ABSL_FLAG(uint64_t, offset, 0, "register: where the region starts in the shared-memory object");
ABSL_FLAG(bool, via_region, false,
          "migrate: move the K/V through one shared-memory object registered on both servers "
          "(both on this host) instead of in the streams' messages");
ABSL_FLAG(int32_t, region_device, -1,
          "migrate --via_region: -1 a shared-memory object; N device memory on CUDA device N "
          "registered on both servers by IPC handle (a cuda region; a CLI built with CUDA)");
ABSL_FLAG(int32_t, repeat, 1,
          "migrate: runs (the copy on the target released between them); the median is printed");
ABSL_FLAG(int64_t, region_bytes, 0,
          "migrate --via_region: the object's size (0: enough for every committed token of "
          "--target, from its stats)");

namespace {

using pagedattn::client::Client;
namespace v1 = pagedattn::v1;


int Fail(const absl::Status& status) {
  std::cerr << "error: " << status << "\n";
  return 1;
}

int Usage(const std::string& why) {
  std::cerr << "usage error: " << why << "\n(run with --help for the commands)\n";
  return 2;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

absl::StatusOr<uint64_t> ParseId(const std::string& text) {
  uint64_t id;
  if (!absl::SimpleAtoi(text, &id)) return absl::InvalidArgumentError(absl::StrCat("bad id: ", text));
  return id;
}

void PrintJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  std::cout << json;
}

// Layers a command walks: the one asked for, or all of them in order.
absl::StatusOr<std::vector<int32_t>> Layers(Client& client) {
  const int32_t layer = absl::GetFlag(FLAGS_layer);
  if (layer >= 0) return std::vector<int32_t>{layer};
  absl::StatusOr<v1::GetModelConfigResponse> config = client.GetModelConfig();
  if (!config.ok()) return config.status();
  std::vector<int32_t> layers;
  for (int32_t l = 0; l < config->num_layers(); ++l) layers.push_back(l);
  return layers;
}

int Append(Client& client, uint64_t id, std::mt19937_64& rng) {
  absl::StatusOr<v1::GetModelConfigResponse> config = client.GetModelConfig();
  if (!config.ok()) return Fail(config.status());
  const int64_t row_elems = int64_t{config->num_kv_heads()} * config->head_dim();
  const std::string& dtype = config->dtype();
  std::string k, v;
  int32_t num_tokens = absl::GetFlag(FLAGS_num_tokens);
  const bool from_files = !absl::GetFlag(FLAGS_k_file).empty() || !absl::GetFlag(FLAGS_v_file).empty();
  if (from_files) {
    absl::StatusOr<std::string> kf = ReadFile(absl::GetFlag(FLAGS_k_file));
    if (!kf.ok()) return Fail(kf.status());
    absl::StatusOr<std::string> vf = ReadFile(absl::GetFlag(FLAGS_v_file));
    if (!vf.ok()) return Fail(vf.status());
    k = *std::move(kf);
    v = *std::move(vf);
    num_tokens = static_cast<int32_t>(k.size() / (row_elems * 2));
  }
  absl::StatusOr<std::vector<int32_t>> layers = Layers(client);
  if (!layers.ok()) return Fail(layers.status());
  int64_t length = 0;
  for (int32_t layer : *layers) {
    if (!from_files) {
      k = pagedattn::client::RandomNormal(dtype, num_tokens * row_elems, rng);
      v = pagedattn::client::RandomNormal(dtype, num_tokens * row_elems, rng);
    }
    absl::StatusOr<int64_t> result = client.AppendKV(id, layer, num_tokens, k, v);
    if (!result.ok()) return Fail(result.status());
    length = *result;
  }
  std::cout << "sequence " << id << ": appended " << num_tokens << " tokens to " << layers->size()
            << " layer(s), length " << length << "\n";
  return 0;
}

int Decode(Client& client, const std::string& ids_text, std::mt19937_64& rng) {
  v1::DecodeRequest request;
  for (absl::string_view part : absl::StrSplit(ids_text, ',', absl::SkipEmpty())) {
    absl::StatusOr<uint64_t> id = ParseId(std::string(part));
    if (!id.ok()) return Usage(std::string(id.status().message()));
    request.add_sequence_ids(*id);
  }
  const int64_t batch = request.sequence_ids_size();
  if (batch == 0) return Usage("decode needs sequence ids");
  request.set_request_id(absl::GetFlag(FLAGS_request_id));
  request.set_sm_scale(absl::GetFlag(FLAGS_sm_scale));
  std::string q;
  if (!absl::GetFlag(FLAGS_q_file).empty()) {
    absl::StatusOr<std::string> qf = ReadFile(absl::GetFlag(FLAGS_q_file));
    if (!qf.ok()) return Fail(qf.status());
    q = *std::move(qf);
  }
  absl::StatusOr<v1::GetModelConfigResponse> config = client.GetModelConfig();
  if (!config.ok()) return Fail(config.status());
  const int64_t query_elems = int64_t{config->num_qo_heads()} * config->head_dim();
  const int64_t row_elems = int64_t{config->num_kv_heads()} * config->head_dim();
  const std::string& dtype = config->dtype();
  absl::StatusOr<std::vector<int32_t>> layers = Layers(client);
  if (!layers.ok()) return Fail(layers.status());
  v1::DecodeResponse response;
  for (int32_t layer : *layers) {
    request.set_layer(layer);
    request.set_q(q.empty() ? pagedattn::client::RandomNormal(dtype, batch * query_elems, rng) : q);
    if (absl::GetFlag(FLAGS_with_kv)) {
      request.set_k(pagedattn::client::RandomNormal(dtype, batch * row_elems, rng));
      request.set_v(pagedattn::client::RandomNormal(dtype, batch * row_elems, rng));
    }
    absl::StatusOr<v1::DecodeResponse> result = client.Decode(request);
    if (!result.ok()) return Fail(result.status());
    response = *std::move(result);
    const std::vector<float> out = pagedattn::client::DecodeValues(dtype, response.output());
    const std::vector<float> lse = pagedattn::client::DecodeFloat32(response.lse());
    for (int64_t b = 0; b < batch; ++b) {
      double norm = 0.0;
      for (int64_t i = 0; i < query_elems; ++i) {
        norm += double{out[b * query_elems + i]} * out[b * query_elems + i];
      }
      std::cout << "request " << response.request_id() << " layer " << layer << " sequence "
                << request.sequence_ids(static_cast<int>(b)) << ": lse[head 0] "
                << lse[b * config->num_qo_heads()]
                << ", |output| " << std::sqrt(norm) << "\n";
    }
  }
  if (!absl::GetFlag(FLAGS_output_file).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_output_file), std::ios::binary);
    out << response.output();
    if (!out) return Fail(absl::InternalError("cannot write " + absl::GetFlag(FLAGS_output_file)));
  }
  return 0;
}

// The file of an export: its chunks, each a varint byte count then the ExportSequenceChunk.
int ExportToFile(Client& client, uint64_t id, const std::string& path) {
  absl::StatusOr<std::vector<v1::ExportSequenceChunk>> chunks = client.ExportSequence(id);
  if (!chunks.ok()) return Fail(chunks.status());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (const v1::ExportSequenceChunk& c : *chunks) {
    if (!out || !google::protobuf::util::SerializeDelimitedToOstream(c, &out)) break;
  }
  out.close();
  if (!out) {
    std::cerr << "pagedattn-cli: cannot write " << path << std::endl;
    return 1;
  }
  const int64_t length = chunks->empty() ? 0 : chunks->front().length();
  std::cout << "sequence " << id << ": " << length << " tokens exported to " << path << " ("
            << chunks->size() << " chunks)\n";
  return 0;
}

int ImportFromFile(Client& client, uint64_t id, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::cerr << "pagedattn-cli: cannot read " << path << std::endl;
    return 1;
  }
  google::protobuf::io::IstreamInputStream stream(&in);
  std::vector<v1::ExportSequenceChunk> chunks;
  while (true) {
    v1::ExportSequenceChunk c;
    bool clean_eof = false;
    if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&c, &stream, &clean_eof)) {
      if (clean_eof) break;
      std::cerr << "pagedattn-cli: " << path << " is not an export file" << std::endl;
      return 1;
    }
    chunks.push_back(std::move(c));
  }
  absl::StatusOr<int64_t> length = client.ImportSequence(id, chunks);
  if (!length.ok()) return Fail(length.status());
  std::cout << "sequence " << id << ": " << *length << " tokens imported from " << path << "\n";
  return 0;
}

// A migration: this client's server's export streamed straight into `to`'s import (same id,
// same options otherwise), timed; with --via_region through one shared-memory region registered
// on both servers (set up once, its time printed apart). With --repeat=N it runs N times,
// releasing the copy on `to` between runs, and prints the median too.
int Migrate(Client& from, uint64_t id, pagedattn::client::ClientOptions options, const std::string& to) {
  options.target = to;
  absl::StatusOr<std::unique_ptr<Client>> other = Client::Connect(options);
  if (!other.ok()) return Fail(other.status());
  const bool via_region = absl::GetFlag(FLAGS_via_region);
  const int32_t repeat = std::max<int32_t>(1, absl::GetFlag(FLAGS_repeat));
#ifdef PAGEDATTN_CLI_CUDA
  pagedattn::CudaRegion device_memory;  // outlives `region` (declared first, destroyed last)
#endif
  std::unique_ptr<pagedattn::client::SharedRegion> region;
  if (via_region) {
    const absl::Time start = absl::Now();
    absl::StatusOr<int64_t> region_bytes = absl::GetFlag(FLAGS_region_bytes);
    if (*region_bytes <= 0) region_bytes = pagedattn::client::RegionBytesFor(from);
    if (!region_bytes.ok()) return Fail(region_bytes.status());
    const int32_t device = absl::GetFlag(FLAGS_region_device);
    absl::StatusOr<std::unique_ptr<pagedattn::client::SharedRegion>> made;
    if (device < 0) {
      made = pagedattn::client::SharedRegion::Create({&from, other->get()}, *region_bytes);
    } else {
#ifdef PAGEDATTN_CLI_CUDA
      absl::StatusOr<pagedattn::CudaRegion> memory = pagedattn::CudaRegion::Create(device, *region_bytes);
      if (!memory.ok()) return Fail(memory.status());
      device_memory = *std::move(memory);
      made = pagedattn::client::SharedRegion::RegisterDevice(
          {&from, other->get()}, absl::StrCat("pa-migrate-cuda-", getpid()),
          device_memory.ipc_handle(), device, *region_bytes);
#else
      made = absl::FailedPreconditionError("this pagedattn-cli was built without CUDA (--region_device)");
#endif
    }
    if (!made.ok()) return Fail(made.status());
    region = *std::move(made);
    std::cout << (device < 0 ? "shared-memory" : "cuda") << " region " << region->name() << " of "
              << *region_bytes / 1048576.0
              << " MiB registered on both servers in "
              << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms\n";
  }
  std::vector<double> times;
  for (int32_t run = 0; run < repeat; ++run) {
    if (run > 0) {
      if (absl::Status s = (*other)->ReleaseSequence(id); !s.ok()) return Fail(s);
    }
    const absl::Time start = absl::Now();
    int64_t bytes = 0;
    absl::StatusOr<int64_t> length =
        via_region ? from.CopySequenceTo(id, **other, &bytes, region->ref())
                   : from.CopySequenceTo(id, **other, &bytes);
    if (!length.ok()) return Fail(length.status());
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    times.push_back(seconds);
    std::cout << "sequence " << id << ": " << *length << " tokens, " << bytes / 1048576.0
              << " MiB of K and V migrated" << (via_region ? " through a registered region" : "")
              << " in " << seconds * 1e3 << " ms, " << (seconds > 0 ? bytes / seconds / 1e9 : 0.0)
              << " GB/s\n";
  }
  if (repeat > 1) {
    std::sort(times.begin(), times.end());
    std::cout << "median of " << repeat << ": " << times[times.size() / 2] * 1e3 << " ms\n";
  }
  if (region != nullptr) {
    if (absl::Status s = region->Close(); !s.ok()) return Fail(s);
  }
  return 0;
}

int Run(const std::vector<std::string>& args) {
  if (args.empty()) return Usage("missing command");
  pagedattn::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  pagedattn::client::ApplyTlsFlags(&options);
  if (const std::string token_file = absl::GetFlag(FLAGS_auth_token_file); !token_file.empty()) {
    std::ifstream in(token_file);
    std::ostringstream content;
    if (in) content << in.rdbuf();
    if (!in) {
      std::cerr << "pagedattn-cli: cannot read " << token_file << std::endl;
      return 2;
    }
    options.bearer_token = std::string(absl::StripAsciiWhitespace(content.str()));
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return Fail(client.status());
  const std::string& command = args[0];
  // A stream per command, so that a decode's queries are not the K rows an append drew.
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) * 0x9E3779B97F4A7C15ull ^
                      std::hash<std::string>{}(command));
  auto want = [&](size_t n) { return args.size() == n + 1; };
  auto id_at = [&](size_t i) { return ParseId(args[i]); };

  if (command == "config" && want(0)) {
    absl::StatusOr<v1::GetModelConfigResponse> config = (*client)->GetModelConfig();
    if (!config.ok()) return Fail(config.status());
    PrintJson(*config);
    return 0;
  }
  if (command == "stats" && want(0)) {
    absl::StatusOr<v1::GetStatsResponse> stats = (*client)->GetStats();
    if (!stats.ok()) return Fail(stats.status());
    PrintJson(*stats);
    return 0;
  }
  if ((command == "create" || command == "release" || command == "append") && want(1)) {
    absl::StatusOr<uint64_t> id = id_at(1);
    if (!id.ok()) return Usage(std::string(id.status().message()));
    if (command == "append") return Append(**client, *id, rng);
    absl::Status status = command == "create" ? (*client)->CreateSequence(*id)
                                              : (*client)->ReleaseSequence(*id);
    if (!status.ok()) return Fail(status);
    std::cout << "sequence " << *id << ": " << (command == "create" ? "created" : "released") << "\n";
    return 0;
  }
  if (command == "fork" && want(2)) {
    absl::StatusOr<uint64_t> parent = id_at(1);
    absl::StatusOr<uint64_t> child = id_at(2);
    if (!parent.ok() || !child.ok()) return Usage("fork PARENT CHILD");
    if (absl::Status status = (*client)->ForkSequence(*parent, *child); !status.ok()) return Fail(status);
    std::cout << "sequence " << *child << ": forked from " << *parent << "\n";
    return 0;
  }
  if (command == "decode" && want(1)) return Decode(**client, args[1], rng);
  if (command == "memory" && want(0)) {
    absl::StatusOr<std::vector<v1::MemoryRegion>> regions = (*client)->ListMemory();
    if (!regions.ok()) return Fail(regions.status());
    v1::ListMemoryResponse response;
    for (v1::MemoryRegion& r : *regions) *response.add_regions() = std::move(r);
    PrintJson(response);
    return 0;
  }
  if (command == "register" && want(3)) {
    uint64_t bytes = 0;
    if (!absl::SimpleAtoi(args[3], &bytes)) return Usage("register NAME KEY BYTES");
    absl::Status status =
        (*client)->RegisterSystemMemory(args[1], args[2], absl::GetFlag(FLAGS_offset), bytes);
    if (!status.ok()) return Fail(status);
    std::cout << "memory region " << args[1] << ": registered\n";
    return 0;
  }
  if (command == "unregister" && want(1)) {
    if (absl::Status status = (*client)->UnregisterMemory(args[1]); !status.ok()) return Fail(status);
    std::cout << "memory region " << args[1] << ": unregistered\n";
    return 0;
  }
  if (command == "offload" && want(1)) {
    absl::StatusOr<uint64_t> id = id_at(1);
    if (!id.ok()) return Usage(std::string(id.status().message()));
    if (absl::Status status = (*client)->OffloadSequence(*id); !status.ok()) return Fail(status);
    std::cout << "sequence " << *id << ": offloaded\n";
    return 0;
  }
  if (command == "migrate" && want(2)) {
    absl::StatusOr<uint64_t> id = id_at(1);
    if (!id.ok()) return Usage(std::string(id.status().message()));
    return Migrate(**client, *id, options, args[2]);
  }
  if ((command == "export" || command == "import") && want(2)) {
    absl::StatusOr<uint64_t> id = id_at(1);
    if (!id.ok()) return Usage(std::string(id.status().message()));
    return command == "export" ? ExportToFile(**client, *id, args[2])
                               : ImportFromFile(**client, *id, args[2]);
  }
  return Usage(absl::StrCat("unknown command or wrong arguments: ", command));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pagedattn-cli [flags] COMMAND [ARGS]\n"
      "  config                     the server's model config (JSON)\n"
      "  stats                      pool and engine counters (JSON)\n"
      "  create ID                  create an empty sequence\n"
      "  append ID                  append --num_tokens random tokens (or --k_file/--v_file)\n"
      "                             to --layer, or to every layer in order (-1, the default)\n"
      "  decode ID[,ID...]          decode at --layer or every layer; --with_kv makes it a step\n"
      "  fork PARENT CHILD          child shares the parent's pages (copy on write)\n"
      "  release ID                 free a sequence\n"
      "  memory                     the registered memory regions (JSON)\n"
      "  register NAME KEY BYTES    register BYTES of shared-memory object KEY (\"/name\") from\n"
      "                             --offset as region NAME (tensors by reference)\n"
      "  unregister NAME            unlist a region; waits for the work that uses it\n"
      "                             (e.g. one a client that died left registered)\n"
      "  export ID FILE             write a sequence's KV (every layer) to FILE\n"
      "  import ID FILE             make sequence ID from an export FILE (e.g. of another server)\n"
      "  offload ID                 move an idle sequence to the server's host tier\n"
      "  migrate ID TARGET          export from --target and import into TARGET, timed;\n"
      "                             --via_region: through a shared-memory region (same host;\n"
      "                             --region_device=N: device memory of CUDA device N);\n"
      "                             --repeat=N: N runs and their median");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  return Run(args);
}
