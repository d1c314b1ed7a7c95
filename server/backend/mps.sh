# Sourced by the GPU-host scripts (device_e2e.sh, client/loadgen/run_local_h200.sh) for MPS=1.
# start_mps: starts an MPS control daemon for the processes this shell starts (one GPU context
# for all of them; docs/operations.md says when that matters) and stops it when the shell
# exits; sets MPS_LINE, the line to log. Call it in the script's own shell, not in $(...): the
# environment and the exit trap must stay there. Returns 1 if the daemon cannot start.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/pagedattn-mps-$$ CUDA_MPS_LOG_DIRECTORY=/tmp/pagedattn-mps-$$-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: nvidia-cuda-mps-control -d failed" >&2; return 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  MPS_LINE="MPS: on (control daemon at $CUDA_MPS_PIPE_DIRECTORY)"
}
