// The model shape as a start-up choice, end to end through the real server (CPU backend): for
// the shapes of common models (head counts, head sizes 64/128/256, pages of 16/32/64, bf16 or
// fp16 tensors, bf16/fp16 or fp8 pages with per-layer scales) GetModelConfig reports the shape,
// and appends and decode steps over two layers match the float64 reference over the values the
// pages hold (fp8 ones quantized as kernels::StoreKvValues does). Shapes outside the supported
// set, and bad scales files, stop the server at start with the reason.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/shape.h"
#include "tests/integration/server_process.h"

namespace pagedattn::testing {
namespace {

namespace k = kernels;
using k::DType;

constexpr int32_t kLayers = 2;

struct ModelCase {
  std::string name;
  k::Shape shape;
  std::vector<float> k_scales, v_scales;  // fp8 pages: a scales file with these; empty: none
};

std::vector<ModelCase> Cases() {
  const auto shape = [](int qo, int kv, int hd, int page, DType t, DType kvt) {
    return k::Shape{qo, kv, hd, page, t, kvt};
  };
  return {
      {"llama_3_1_8b_fp8", shape(32, 8, 128, 16, DType::kBf16, DType::kFp8E4m3), {0.02f, 0.03f},
       {0.04f, 0.05f}},
      {"llama_3_1_70b_tp8_fp16", shape(8, 1, 128, 16, DType::kFp16, DType::kFp16), {}, {}},
      {"qwen2_5_7b", shape(28, 4, 128, 32, DType::kBf16, DType::kBf16), {}, {}},
      {"gemma_2_9b_fp8_unscaled", shape(16, 8, 256, 16, DType::kBf16, DType::kFp8E4m3), {}, {}},
      {"head_dim_64_fp16_fp8", shape(12, 12, 64, 64, DType::kFp16, DType::kFp8E4m3), {0.05f, 0.02f},
       {0.03f, 0.06f}},
      {"default", k::Shape{}, {}, {}},
  };
}

std::string Flag(const std::string& name, int64_t value) {
  return absl::StrCat("--", name, "=", value);
}

std::vector<std::string> ShapeFlags(const k::Shape& s) {
  return {Flag("num_qo_heads", s.num_qo_heads), Flag("num_kv_heads", s.num_kv_heads),
          Flag("head_dim", s.head_dim), Flag("page_size", s.page_size),
          absl::StrCat("--dtype=", k::DTypeName(s.dtype)),
          absl::StrCat("--kv_cache_dtype=", k::DTypeName(s.kv_dtype))};
}

// A file that is removed with the test.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char name[] = "/tmp/pagedattn-scales-XXXXXX";
    const int fd = mkstemp(name);
    path_ = name;
    if (fd >= 0) {
      (void)!write(fd, text.data(), text.size());
      close(fd);
    }
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ScalesJson(const std::vector<float>& k_scales, const std::vector<float>& v_scales) {
  const auto list = [](const std::vector<float>& xs) {
    std::string s = "[";
    for (size_t i = 0; i < xs.size(); ++i) s += absl::StrCat(i ? ", " : "", xs[i]);
    return s + "]";
  };
  return absl::StrCat("{\n  \"k_scale\": ", list(k_scales), ",\n  \"v_scale\": ", list(v_scales),
                      "\n}\n");
}

// What the server's pages should hold: per sequence and layer, each token's K and V rows as
// stored (the pages' element type), and the committed length.
class ShapeMirror {
 public:
  ShapeMirror(const k::Shape& shape, std::vector<float> k_scales, std::vector<float> v_scales)
      : shape_(shape), k_scales_(std::move(k_scales)), v_scales_(std::move(v_scales)) {}

  float k_scale(int32_t layer) const { return k_scales_.empty() ? 1.0f : k_scales_[layer]; }
  float v_scale(int32_t layer) const { return v_scales_.empty() ? 1.0f : v_scales_[layer]; }

  // Rows k, v ([n, num_kv_heads, head_dim] in the callers' type) written into `layer`.
  void Write(uint64_t id, int32_t layer, const std::string& k, const std::string& v) {
    auto& [keys, values] = rows_[{id, layer}];
    const int64_t n = static_cast<int64_t>(k.size()) / shape_.token_bytes();
    const int64_t at = static_cast<int64_t>(keys.size());
    keys.resize(at + n * shape_.kv_token_bytes());
    values.resize(at + n * shape_.kv_token_bytes());
    k::StoreKvValues(shape_, k.data(), keys.data() + at, n * shape_.token_elems(), k_scale(layer));
    k::StoreKvValues(shape_, v.data(), values.data() + at, n * shape_.token_elems(), v_scale(layer));
  }

  // The reference decode of one sequence at `layer` over its `tokens` first tokens there.
  void Reference(uint64_t id, int32_t layer, int64_t tokens, const std::string& q, float sm_scale,
                 std::vector<double>* out, std::vector<double>* lse) const {
    const auto& [keys, values] = rows_.at({id, layer});
    // The tokens laid out in pages 0, 1, ... of a cache of their own.
    const int64_t p = shape_.page_size;
    const int64_t pages = (tokens + p - 1) / p;
    std::vector<uint8_t> kc(pages * shape_.page_bytes()), vc(pages * shape_.page_bytes());
    std::copy(keys.begin(), keys.begin() + tokens * shape_.kv_token_bytes(), kc.begin());
    std::copy(values.begin(), values.begin() + tokens * shape_.kv_token_bytes(), vc.begin());
    std::vector<int32_t> indptr = {0, static_cast<int32_t>(pages)}, indices(pages);
    for (int64_t i = 0; i < pages; ++i) indices[i] = static_cast<int32_t>(i);
    const int32_t last = static_cast<int32_t>(tokens - (pages - 1) * p);
    k::DecodeArgs a;
    a.q = q.data();
    a.k_cache = kc.data();
    a.v_cache = vc.data();
    a.kv_indptr = indptr.data();
    a.kv_indices = indices.data();
    a.kv_last_page_len = &last;
    a.batch_size = 1;
    a.num_pages = pages;
    a.sm_scale = sm_scale;
    a.shape = shape_;
    if (shape_.kv_dtype == DType::kFp8E4m3) {
      a.k_scale = k_scale(layer);
      a.v_scale = v_scale(layer);
    }
    out->assign(shape_.query_elems(), 0.0);
    lse->assign(shape_.num_qo_heads, 0.0);
    k::DecodeReferenceF64(a, out->data(), lse->data());
  }

 private:
  k::Shape shape_;
  std::vector<float> k_scales_, v_scales_;
  std::map<std::pair<uint64_t, int32_t>, std::pair<std::string, std::string>> rows_;
};

// Random normal values in `type`, as bytes.
std::string Random(DType type, int64_t elems, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string bytes(elems * k::DTypeBytes(type), '\0');
  for (int64_t i = 0; i < elems; ++i) k::StoreElem(type, bytes.data(), i, normal(rng));
  return bytes;
}

class ModelShapesTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelShapesTest, AppendsAndDecodeStepsMatchTheReferenceOverTheStoredValues) {
  const ModelCase& c = GetParam();
  const k::Shape& s = c.shape;
  std::vector<std::string> flags = ShapeFlags(s);
  for (const std::string& f :
       {Flag("num_layers", kLayers), std::string("--num_pages=64"), std::string("--cpu_threads=2"),
        std::string("--backend=cpu")}) {
    flags.push_back(f);
  }
  std::unique_ptr<TempFile> scales;
  if (!c.k_scales.empty()) {
    scales = std::make_unique<TempFile>(ScalesJson(c.k_scales, c.v_scales));
    flags.push_back("--kv_cache_scales_file=" + scales->path());
  }
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(flags);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions options;
  options.target = (*server)->grpc_target();
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  client::Client& cl = **client;

  absl::StatusOr<v1::GetModelConfigResponse> config = cl.GetModelConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_qo_heads(), s.num_qo_heads);
  EXPECT_EQ(config->num_kv_heads(), s.num_kv_heads);
  EXPECT_EQ(config->head_dim(), s.head_dim);
  EXPECT_EQ(config->page_size(), s.page_size);
  EXPECT_EQ(config->dtype(), k::DTypeName(s.dtype));
  EXPECT_EQ(config->kv_cache_dtype(), k::DTypeName(s.kv_dtype));

  std::mt19937_64 rng(std::hash<std::string>()(c.name));
  ShapeMirror mirror(s, c.k_scales, c.v_scales);
  // Lengths around page boundaries, and a longer one.
  const std::vector<int64_t> lengths = {1, s.page_size - 1, s.page_size + 1, 3 * s.page_size + 5};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const uint64_t id = 100 + i;
    ids.push_back(id);
    ASSERT_TRUE(cl.CreateSequence(id).ok());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const int64_t elems = lengths[i] * s.token_elems();
      const std::string kk = Random(s.dtype, elems, rng), vv = Random(s.dtype, elems, rng);
      v1::AppendKVRequest append;
      append.set_sequence_id(id);
      append.set_layer(layer);
      append.set_num_tokens(static_cast<int32_t>(lengths[i]));
      append.set_k(kk);
      append.set_v(vv);
      absl::StatusOr<int64_t> length = cl.AppendKV(append);
      ASSERT_TRUE(length.ok()) << length.status();
      mirror.Write(id, layer, kk, vv);
    }
  }
  // Two decode steps (each writes one token per sequence in every layer), checked per layer.
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  double worst = 0.0;
  for (int step = 0; step < 2; ++step) {
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const int64_t b = static_cast<int64_t>(ids.size());
      v1::DecodeRequest request;
      request.set_request_id(step * kLayers + layer + 1);
      request.set_layer(layer);
      for (uint64_t id : ids) request.add_sequence_ids(id);
      request.set_q(Random(s.dtype, b * s.query_elems(), rng));
      request.set_k(Random(s.dtype, b * s.token_elems(), rng));
      request.set_v(Random(s.dtype, b * s.token_elems(), rng));
      absl::StatusOr<v1::DecodeResponse> response = cl.Decode(request);
      ASSERT_TRUE(response.ok()) << response.status();
      ASSERT_EQ(static_cast<int64_t>(response->output().size()), b * s.query_bytes());
      ASSERT_EQ(static_cast<int64_t>(response->lse().size()), b * s.lse_bytes());
      for (int64_t i = 0; i < b; ++i) {
        mirror.Write(ids[i], layer, request.k().substr(i * s.token_bytes(), s.token_bytes()),
                     request.v().substr(i * s.token_bytes(), s.token_bytes()));
        std::vector<double> want, want_lse;
        mirror.Reference(ids[i], layer, lengths[i] + step + 1,
                         request.q().substr(i * s.query_bytes(), s.query_bytes()), sm_scale, &want,
                         &want_lse);
        const char* out = response->output().data() + i * s.query_bytes();
        double err = 0.0, norm = 0.0;
        for (int64_t e = 0; e < s.query_elems(); ++e) {
          const double got = k::LoadElem(s.dtype, out, e);
          err += (got - want[e]) * (got - want[e]);
          norm += want[e] * want[e];
        }
        const double rel = std::sqrt(err / norm);
        worst = std::max(worst, rel);
        EXPECT_LT(rel, 1e-2) << "sequence " << ids[i] << " layer " << layer << " step " << step;
        const float* lse = reinterpret_cast<const float*>(response->lse().data()) +
                           i * s.num_qo_heads;
        for (int h = 0; h < s.num_qo_heads; ++h) {
          EXPECT_NEAR(lse[h], want_lse[h], 1e-3 * std::max(1.0, std::fabs(want_lse[h])))
              << "sequence " << ids[i] << " head " << h;
        }
      }
    }
  }
  RecordProperty("worst_rel_l2", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Models, ModelShapesTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                           return info.param.name;
                         });

// A server of `shape` (CPU backend, two layers) and a client to it.
struct ShapeServer {
  std::unique_ptr<ServerProcess> process;
  std::unique_ptr<client::Client> client;
};

ShapeServer StartShapeServer(const k::Shape& shape, const std::string& scales_file,
                             const std::vector<std::string>& extra_flags = {}) {
  std::vector<std::string> flags = ShapeFlags(shape);
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  for (const std::string& f : {Flag("num_layers", kLayers), std::string("--num_pages=32"),
                               std::string("--cpu_threads=2"), std::string("--backend=cpu")}) {
    flags.push_back(f);
  }
  if (!scales_file.empty()) flags.push_back("--kv_cache_scales_file=" + scales_file);
  ShapeServer s;
  absl::StatusOr<std::unique_ptr<ServerProcess>> process = ServerProcess::Start(flags);
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return s;
  s.process = *std::move(process);
  client::ClientOptions options;
  options.target = s.process->grpc_target();
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  if (c.ok()) s.client = *std::move(c);
  return s;
}

// --host_kv_bytes buys host pages of the model's own size: one pool page of every layer, K and
// V, as the pages store them (16 KiB each here, a quarter of the default shape's).
TEST(ModelShapeHostTierTest, HostKvBytesBuysPagesOfTheModelsSize) {
  const k::Shape fp8{32, 8, 128, 16, DType::kBf16, DType::kFp8E4m3};
  const int64_t host_page = 2 * kLayers * fp8.page_bytes();
  ShapeServer s = StartShapeServer(fp8, "", {Flag("host_kv_bytes", 10 * host_page + 100)});
  ASSERT_TRUE(s.client);
  absl::StatusOr<v1::GetStatsResponse> stats = s.client->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->host_pages_total(), 10);
  EXPECT_EQ(stats->host_pages_free(), 10);
}

TEST(ModelShapeExportTest, Fp8PagesMoveWithTheirScalesAndOnlyToTheSamePages) {
  const k::Shape fp8{32, 8, 128, 16, DType::kBf16, DType::kFp8E4m3};
  k::Shape bf16 = fp8;
  bf16.kv_dtype = DType::kBf16;
  const TempFile scales(ScalesJson({0.02f, 0.03f}, {0.04f, 0.05f}));
  const TempFile other_scales(ScalesJson({0.02f, 0.03f}, {0.04f, 0.06f}));
  ShapeServer from = StartShapeServer(fp8, scales.path());
  ShapeServer same = StartShapeServer(fp8, scales.path());
  ShapeServer plain = StartShapeServer(bf16, "");
  ShapeServer other = StartShapeServer(fp8, other_scales.path());
  ASSERT_TRUE(from.client && same.client && plain.client && other.client);

  std::mt19937_64 rng(42);
  constexpr int32_t kTokens = 37;
  ASSERT_TRUE(from.client->CreateSequence(1).ok());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    const int64_t elems = kTokens * fp8.token_elems();
    ASSERT_TRUE(from.client
                    ->AppendKV(1, layer, kTokens, Random(fp8.dtype, elems, rng),
                               Random(fp8.dtype, elems, rng))
                    .ok());
  }
  absl::StatusOr<std::vector<v1::ExportSequenceChunk>> chunks = from.client->ExportSequence(1);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), static_cast<size_t>(kLayers));
  const v1::ExportSequenceChunk& first = chunks->front();
  EXPECT_EQ(first.kv_cache_dtype(), "fp8_e4m3");
  EXPECT_EQ(std::vector<float>(first.k_scale().begin(), first.k_scale().end()),
            (std::vector<float>{0.02f, 0.03f}));
  EXPECT_EQ(std::vector<float>(first.v_scale().begin(), first.v_scale().end()),
            (std::vector<float>{0.04f, 0.05f}));
  for (const v1::ExportSequenceChunk& c : *chunks) {
    EXPECT_EQ(static_cast<int64_t>(c.k().size()), kTokens * fp8.kv_token_bytes());  // 1 byte each
  }

  // Into pages of another type, or fp8 pages of other scales: refused, nothing made.
  for (ShapeServer* refusing : {&plain, &other}) {
    absl::StatusOr<int64_t> r = refusing->client->ImportSequence(1, *chunks);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    absl::StatusOr<v1::GetStatsResponse> stats = refusing->client->GetStats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->sequences(), 0);
    EXPECT_EQ(stats->pages_free(), stats->pages_total());
  }
  // Into the same pages and scales: later decodes are bitwise the exporter's.
  absl::StatusOr<int64_t> imported = same.client->ImportSequence(1, *chunks);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(*imported, kTokens);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    v1::DecodeRequest r;
    r.set_request_id(layer + 1);
    r.set_layer(layer);
    r.add_sequence_ids(1);
    r.set_q(Random(fp8.dtype, fp8.query_elems(), rng));
    r.set_k(Random(fp8.dtype, fp8.token_elems(), rng));
    r.set_v(Random(fp8.dtype, fp8.token_elems(), rng));
    absl::StatusOr<v1::DecodeResponse> a = from.client->Decode(r);
    absl::StatusOr<v1::DecodeResponse> b = same.client->Decode(r);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->output(), b->output()) << "layer " << layer;
    EXPECT_EQ(a->lse(), b->lse()) << "layer " << layer;
  }
}

// The server does not start; its output names the reason (and `expected`).
void ExpectRefusedAtStart(const std::vector<std::string>& flags, const std::string& expected) {
  std::vector<std::string> all = {"--backend=cpu", "--num_pages=16", "--num_layers=2"};
  all.insert(all.end(), flags.begin(), flags.end());
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(all, absl::Seconds(20));
  ASSERT_FALSE(server.ok()) << "started with " << flags.front();
  EXPECT_NE(server.status().message().find(expected), std::string::npos)
      << "flags " << flags.front() << ": " << server.status().message();
}

TEST(ModelShapeFlagsTest, ShapesOutsideTheSupportedSetAreRefusedAtStartWithTheSet) {
  const std::string supported = "supported: head_dim 64, 128 or 256";
  ExpectRefusedAtStart({"--head_dim=96"}, supported);
  ExpectRefusedAtStart({"--num_qo_heads=36"}, supported);  // 9 per KV head
  ExpectRefusedAtStart({"--num_qo_heads=10"}, supported);  // not a multiple of 4
  ExpectRefusedAtStart({"--page_size=8"}, supported);
  ExpectRefusedAtStart({"--dtype=fp8_e4m3"}, supported);
  ExpectRefusedAtStart({"--dtype=bf16", "--kv_cache_dtype=fp16"}, supported);
  ExpectRefusedAtStart({"--dtype=fp32"}, "unknown element type");
}

TEST(ModelShapeFlagsTest, BadScalesFilesAreRefusedAtStart) {
  const TempFile one_layer(ScalesJson({0.1f}, {0.1f}));
  ExpectRefusedAtStart({"--kv_cache_dtype=fp8_e4m3", "--kv_cache_scales_file=" + one_layer.path()},
                       "k_scale has 1 values for 2 layers");
  const TempFile negative(ScalesJson({0.1f, -1.0f}, {0.1f, 0.1f}));
  ExpectRefusedAtStart({"--kv_cache_dtype=fp8_e4m3", "--kv_cache_scales_file=" + negative.path()},
                       "finite and > 0");
  const TempFile garbage("{\"k_scale\": [0.1, 0.2], \"v_scales\": [1, 2]}");
  ExpectRefusedAtStart({"--kv_cache_dtype=fp8_e4m3", "--kv_cache_scales_file=" + garbage.path()},
                       "unexpected key \"v_scales\"");
  const TempFile good(ScalesJson({0.1f, 0.2f}, {0.1f, 0.2f}));
  ExpectRefusedAtStart({"--kv_cache_scales_file=" + good.path()}, "needs --kv_cache_dtype=fp8_e4m3");
  ExpectRefusedAtStart({"--kv_cache_dtype=fp8_e4m3", "--kv_cache_scales_file=/nonexistent/x"},
                       "cannot read");
}

}  // namespace
}  // namespace pagedattn::testing
