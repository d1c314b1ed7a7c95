// The page-transfer part of the Backend interface: its defaults and the check both backends
// run before touching memory.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/backend/backend.h"

namespace pagedattn {

absl::StatusOr<char*> Backend::AllocateHostMemory(int64_t /*bytes*/) {
  return absl::UnimplementedError(
      absl::StrCat("the ", std::string(name()), " backend has no host memory for a host tier"));
}

absl::Status Backend::ReadPages(const std::vector<PageRun>& /*runs*/) {
  return absl::UnimplementedError(
      absl::StrCat("the ", std::string(name()), " backend cannot read pages to the host"));
}

absl::Status Backend::WritePages(const std::vector<PageRun>& /*runs*/) {
  return absl::UnimplementedError(
      absl::StrCat("the ", std::string(name()), " backend cannot write pages from the host"));
}

absl::Status Backend::CopyFromHost(const std::vector<MemoryCopy>& copies) {
  for (const MemoryCopy& c : copies) {
    if (c.dst_on_device || c.dst == nullptr || c.src == nullptr || c.bytes < 0) {
      return absl::InternalError(absl::StrCat("the ", std::string(name()),
                                              " backend cannot copy into device memory"));
    }
  }
  for (const MemoryCopy& c : copies) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
  return absl::OkStatus();
}

absl::Status ValidatePageRuns(const std::vector<PageRun>& runs, const Backend::PoolShape& shape) {
  const int64_t page_bytes = shape.model.page_bytes();
  for (const PageRun& r : runs) {
    if (r.layer < 0 || r.layer >= shape.num_layers || r.count <= 0 || r.page < 0 ||
        int64_t{r.page} + r.count > shape.num_pages || r.k == nullptr || r.v == nullptr) {
      return absl::InternalError(absl::StrCat("page run out of range: layer ", r.layer, " pages [",
                                              r.page, ", ", int64_t{r.page} + r.count, ") of ",
                                              shape.num_pages));
    }
    const bool part_ok = r.bytes == 0 ? r.offset == 0
                                      : r.bytes > 0 && r.offset >= 0 && r.offset < page_bytes &&
                                            r.offset + r.bytes <= r.count * page_bytes;
    if (!part_ok) {
      return absl::InternalError(absl::StrCat("page run of ", r.count, " pages copies ", r.bytes,
                                              " bytes from offset ", r.offset));
    }
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
