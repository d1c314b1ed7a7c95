#include "client/loadgen/workload.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sys/stat.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pagedattn::loadgen {
namespace {

// The position just after `"key"` and its colon, or npos.
size_t FindValue(absl::string_view line, absl::string_view key) {
  const std::string quoted = absl::StrCat("\"", key, "\"");
  size_t pos = 0;
  while ((pos = line.find(quoted, pos)) != absl::string_view::npos) {
    size_t p = pos + quoted.size();
    while (p < line.size() && std::isspace(static_cast<unsigned char>(line[p]))) ++p;
    if (p < line.size() && line[p] == ':') {
      ++p;
      while (p < line.size() && std::isspace(static_cast<unsigned char>(line[p]))) ++p;
      return p;
    }
    pos += quoted.size();
  }
  return absl::string_view::npos;
}

absl::StatusOr<std::vector<int64_t>> IntArray(absl::string_view line, absl::string_view key) {
  size_t p = FindValue(line, key);
  if (p == absl::string_view::npos || p >= line.size() || line[p] != '[') {
    return absl::InvalidArgumentError(absl::StrCat("no array \"", key, "\""));
  }
  const size_t end = line.find(']', p);
  if (end == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("unterminated array \"", key, "\""));
  }
  std::vector<int64_t> values;
  absl::string_view body = line.substr(p + 1, end - p - 1);
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == absl::string_view::npos) comma = body.size();
    absl::string_view item = body.substr(start, comma - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    if (!item.empty()) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(item, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("non-integer \"", item, "\" in \"", key, "\""));
      }
      values.push_back(v);
    } else if (comma != body.size() || !values.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("empty element in \"", key, "\""));
    }
    start = comma + 1;
  }
  return values;
}

absl::StatusOr<int64_t> IntField(absl::string_view line, absl::string_view key) {
  size_t p = FindValue(line, key);
  if (p == absl::string_view::npos) return absl::InvalidArgumentError(absl::StrCat("no field \"", key, "\""));
  size_t end = p;
  while (end < line.size() && (std::isdigit(static_cast<unsigned char>(line[end])) || line[end] == '-')) ++end;
  int64_t v = 0;
  if (!absl::SimpleAtoi(line.substr(p, end - p), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("field \"", key, "\" is not an integer"));
  }
  return v;
}

std::string StringField(absl::string_view line, absl::string_view key) {
  size_t p = FindValue(line, key);
  if (p == absl::string_view::npos || p >= line.size() || line[p] != '"') return "";
  const size_t end = line.find('"', p + 1);
  if (end == absl::string_view::npos) return "";
  return std::string(line.substr(p + 1, end - p - 1));
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

absl::StatusOr<WorkloadShape> ParseWorkloadLine(absl::string_view line, int32_t page_size) {
  WorkloadShape shape;
  shape.name = StringField(line, "name");
  absl::StatusOr<int64_t> batch_size = IntField(line, "batch_size");
  if (!batch_size.ok()) return batch_size.status();
  absl::StatusOr<std::vector<int64_t>> indptr = IntArray(line, "kv_indptr");
  if (!indptr.ok()) return indptr.status();
  absl::StatusOr<std::vector<int64_t>> last = IntArray(line, "kv_last_page_len");
  if (!last.ok()) return last.status();
  if (*batch_size < 1) return absl::InvalidArgumentError("batch_size < 1");
  if (static_cast<int64_t>(indptr->size()) != *batch_size + 1 || (*indptr)[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_indptr must have batch_size + 1 = ", *batch_size + 1,
                     " entries starting at 0, got ", indptr->size()));
  }
  if (static_cast<int64_t>(last->size()) != *batch_size) {
    return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len must have ", *batch_size,
                                                   " entries, got ", last->size()));
  }
  for (int64_t b = 0; b < *batch_size; ++b) {
    const int64_t pages = (*indptr)[b + 1] - (*indptr)[b];
    if (pages < 0) return absl::InvalidArgumentError("kv_indptr decreases");
    const int64_t lp = (*last)[b];
    if (pages == 0) {
      shape.lengths.push_back(0);
      continue;
    }
    if (lp < 1 || lp > page_size) {
      return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len[", b, "] = ", lp,
                                                     " is outside 1..", page_size));
    }
    shape.lengths.push_back((pages - 1) * page_size + lp);
  }
  return shape;
}

absl::StatusOr<std::vector<WorkloadShape>> LoadWorkloadFile(const std::string& path, int32_t page_size) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read workload file ", path));
  std::vector<WorkloadShape> shapes;
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    absl::StatusOr<WorkloadShape> shape = ParseWorkloadLine(line, page_size);
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": ", shape.status().message()));
    }
    shapes.push_back(*std::move(shape));
  }
  if (shapes.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no shapes"));
  return shapes;
}

std::string DefaultWorkloadFile() {
  const std::string path = std::string(kDefaultWorkloadDir) + kDefaultWorkloadName;
  return FileExists(path) ? path : "";
}

int32_t WorkloadPageSizeFromName(const std::string& path, int32_t fallback) {
  const size_t slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  for (size_t at = name.find("_ps"); at != std::string::npos; at = name.find("_ps", at + 1)) {
    size_t end = at + 3;
    while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
    if (end == at + 3 || end - at - 3 > 4 || (end < name.size() && name[end] != '.' && name[end] != '_')) continue;
    return static_cast<int32_t>(std::stoi(name.substr(at + 3, end - at - 3)));
  }
  return fallback;
}

absl::StatusOr<std::vector<int64_t>> DrawLengths(const LengthOptions& options, int64_t n,
                                                 int32_t page_size) {
  if (n < 1) return absl::InvalidArgumentError("need at least one sequence");
  std::vector<int64_t> lengths;
  lengths.reserve(static_cast<size_t>(n));
  std::mt19937_64 rng(options.seed);
  if (options.distribution == "fixed") {
    if (options.fixed_len < 1) return absl::InvalidArgumentError("fixed length must be >= 1");
    lengths.assign(static_cast<size_t>(n), options.fixed_len);
    return lengths;
  }
  if (options.distribution == "uniform") {
    if (options.min_len < 1 || options.max_len < options.min_len) {
      return absl::InvalidArgumentError(absl::StrCat("uniform lengths need 1 <= min <= max, got ",
                                                     options.min_len, "..", options.max_len));
    }
    std::uniform_int_distribution<int64_t> dist(options.min_len, options.max_len);
    for (int64_t i = 0; i < n; ++i) lengths.push_back(dist(rng));
    return lengths;
  }
  if (options.distribution != "workload") {
    return absl::InvalidArgumentError(absl::StrCat(
        "length distribution must be fixed, uniform or workload, got ", options.distribution));
  }
  if (options.workload_order != "cycle" && options.workload_order != "random") {
    return absl::InvalidArgumentError("workload order must be cycle or random");
  }
  const std::string path = options.workload_file.empty() ? DefaultWorkloadFile() : options.workload_file;
  if (path.empty()) {
    return absl::NotFoundError(absl::StrCat("no workload file given and ", kDefaultWorkloadName,
                                            " not found under ", kDefaultWorkloadDir,
                                            " (run from the repository root or give --workload_file)"));
  }
  const int32_t file_page_size = options.workload_page_size > 0
                                     ? options.workload_page_size
                                     : WorkloadPageSizeFromName(path, page_size);
  absl::StatusOr<std::vector<WorkloadShape>> shapes = LoadWorkloadFile(path, file_page_size);
  if (!shapes.ok()) return shapes.status();
  std::vector<int64_t> pool;
  if (options.shape_names.empty()) {
    for (const WorkloadShape& s : *shapes) pool.insert(pool.end(), s.lengths.begin(), s.lengths.end());
  } else {
    for (const std::string& name : options.shape_names) {
      const auto it = std::find_if(shapes->begin(), shapes->end(),
                                   [&](const WorkloadShape& s) { return s.name == name; });
      if (it == shapes->end()) {
        std::vector<std::string> names;
        for (const WorkloadShape& s : *shapes) names.push_back(s.name);
        return absl::NotFoundError(absl::StrCat("shape ", name, " is not in ", path, " (it has ",
                                                absl::StrJoin(names, ", "), ")"));
      }
      pool.insert(pool.end(), it->lengths.begin(), it->lengths.end());
    }
  }
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  for (int64_t i = 0; i < n; ++i) {
    int64_t len = options.workload_order == "cycle" ? pool[static_cast<size_t>(i) % pool.size()] : pool[pick(rng)];
    if (options.max_workload_len > 0) len = std::min(len, options.max_workload_len);
    lengths.push_back(std::max<int64_t>(len, 1));
  }
  return lengths;
}

}  // namespace pagedattn::loadgen
