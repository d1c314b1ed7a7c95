// pagedattn-kernel-bench --shape: the decoder on a model shape other than the default, over the
// recorded workloads converted to the shape's page size (the same tokens per sequence) and
// batches of hundreds of short sequences (1-8 pages of 64 tokens each, converted the same way),
// each beside its floor (the streaming read of its K and V bytes, timed the same way).
#pragma once

namespace pagedattn::kernels::bench {

// argv as Main's, with --shape NAME present. Returns the process's exit code.
int RunShapes(int argc, char** argv);

}  // namespace pagedattn::kernels::bench
