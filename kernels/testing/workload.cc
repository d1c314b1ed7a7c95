#include "workload.h"

#include <cstdlib>
#include <fstream>

namespace pagedattn::kernels::testing {
namespace {

// Finds `"key":` in a line and returns the position just past the colon, or npos.
size_t FindKey(const std::string& line, const std::string& key) {
  const std::string pattern = "\"" + key + "\"";
  size_t pos = line.find(pattern);
  if (pos == std::string::npos) return pos;
  pos = line.find(':', pos + pattern.size());
  return pos == std::string::npos ? pos : pos + 1;
}

bool ParseInt(const std::string& line, const std::string& key, int64_t* out) {
  const size_t pos = FindKey(line, key);
  if (pos == std::string::npos) return false;
  char* end = nullptr;
  *out = std::strtoll(line.c_str() + pos, &end, 10);
  return end != line.c_str() + pos;
}

bool ParseArray(const std::string& line, const std::string& key, std::vector<int32_t>* out) {
  size_t pos = FindKey(line, key);
  if (pos == std::string::npos) return false;
  pos = line.find('[', pos);
  const size_t close = line.find(']', pos);
  if (pos == std::string::npos || close == std::string::npos) return false;
  out->clear();
  const char* p = line.c_str() + pos + 1;
  const char* stop = line.c_str() + close;
  while (p < stop) {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p) {
      ++p;
      continue;
    }
    out->push_back(static_cast<int32_t>(v));
    p = end;
  }
  return true;
}

bool ParseString(const std::string& line, const std::string& key, std::string* out) {
  size_t pos = FindKey(line, key);
  if (pos == std::string::npos) return false;
  pos = line.find('"', pos);
  const size_t close = line.find('"', pos + 1);
  if (pos == std::string::npos || close == std::string::npos) return false;
  *out = line.substr(pos + 1, close - pos - 1);
  return true;
}

}  // namespace

int64_t Workload::Tokens() const {
  int64_t tokens = 0;
  for (int32_t b = 0; b < batch_size; ++b) {
    const int64_t pages = kv_indptr[b + 1] - kv_indptr[b];
    if (pages > 0) tokens += (pages - 1) * 64 + kv_last_page_len[b];
  }
  return tokens;
}

bool LoadWorkloads(const std::string& path, std::vector<Workload>* out, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Workload w;
    int64_t batch = 0;
    if (!ParseString(line, "name", &w.name) || !ParseInt(line, "batch_size", &batch) ||
        !ParseInt(line, "num_pages", &w.num_pages) ||
        !ParseArray(line, "kv_indptr", &w.kv_indptr) ||
        !ParseArray(line, "kv_indices", &w.kv_indices) ||
        !ParseArray(line, "kv_last_page_len", &w.kv_last_page_len)) {
      *error = path + ":" + std::to_string(line_no) + ": missing field";
      return false;
    }
    w.batch_size = static_cast<int32_t>(batch);
    if (static_cast<int64_t>(w.kv_indptr.size()) != batch + 1 ||
        static_cast<int64_t>(w.kv_last_page_len.size()) != batch ||
        static_cast<int64_t>(w.kv_indices.size()) != w.kv_indptr.back()) {
      *error = path + ":" + std::to_string(line_no) + ": inconsistent sizes";
      return false;
    }
    out->push_back(std::move(w));
  }
  return true;
}

std::string DefaultWorkloadPath() {
  if (const char* env = std::getenv("PAGEDATTN_WORKLOADS"); env != nullptr && *env != '\0') {
    return env;
  }
  return PAGEDATTN_DEFAULT_WORKLOADS;
}

}  // namespace pagedattn::kernels::testing
