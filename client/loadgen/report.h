// The load generator's result: the JSON of one run, built from what the run measured, and its
// human summary. Internal to pagedattn_loadgen (RunLoad calls it); pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "client/loadgen/json.h"
#include "client/loadgen/loadgen.h"
#include "client/loadgen/reference_check.h"
#include "client/loadgen/run_state.h"
#include "client/loadgen/server_metrics.h"
#include "client/loadgen/server_shape.h"

namespace pagedattn::loadgen {

// What RunLoad gathered besides RunState's counters and samples.
struct RunFacts {
  const LoadGenOptions* options = nullptr;
  v1::GetModelConfigResponse config;
  KvScales kv_scales;                      // fp8 pages, when the check read them
  int64_t num_sequences = 0;
  int64_t prefill_tokens = 0, prefill_min = 0, prefill_max = 0;
  int32_t prefill_chunk_tokens = 0;
  double fill_seconds = 0;
  int64_t fill_bytes = 0;
  double elapsed = 0;                      // the timed phase
  Json open_loop;                          // open loop statistics (null for the closed loop)
  v1::GetStatsResponse stats_before, stats_after;
  bool metrics_wanted = false;
  std::string metrics_error;               // non-empty: a scrape failed
  Scrape metrics_before, metrics_after;
  bool check_enabled = false;
  ReferenceCheck::Options check_options;
  ReferenceCheck::Result check_result;
};

// The "pagedattn-loadgen/1" result (fields in client/loadgen/README.md). Reads state's samples,
// errors and counters (taking its mutex).
Json BuildResult(const RunFacts& facts, RunState& state);

}  // namespace pagedattn::loadgen
