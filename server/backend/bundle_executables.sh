#!/usr/bin/env bash
# Gathers executables and the shared libraries they load into one self-contained folder, so that
# a build made on Debian 12 runs on a GPU host that has the CUDA driver but not gRPC, Abseil,
# protobuf or prometheus-cpp. Left out, because the host has its own and they must match its
# kernel and driver: the dynamic loader, the C library family, libstdc++/libgcc_s and libcuda.
#   usage: server/backend/bundle_executables.sh OUT_DIR EXECUTABLE...
#   result: OUT_DIR/bin/<executables>, OUT_DIR/lib/<libraries>; run on the host as
#           LD_LIBRARY_PATH=OUT_DIR/lib OUT_DIR/bin/NAME ...
set -euo pipefail
(($# >= 2)) || { echo "usage: $0 OUT_DIR EXECUTABLE..." >&2; exit 2; }
out=$1
shift
mkdir -p "$out/bin" "$out/lib"

host_provided() {  # host_provided SONAME: true for the libraries the GPU host brings itself
  case $1 in
    linux-vdso.so* | ld-linux* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
      libstdc++.so* | libgcc_s.so* | libcuda.so*) return 0 ;;
    *) return 1 ;;
  esac
}

for exe in "$@"; do
  [[ -x $exe ]] || { echo "bundle: $exe is not an executable" >&2; exit 1; }
  cp -f "$exe" "$out/bin/"
  # ldd lines of interest read "libfoo.so.1 => /path/to/libfoo.so.1 (0x...)"; a library ldd
  # cannot find ("=> not found") would fail on the host too, so it stops the bundle here.
  while read -r soname arrow path _; do
    [[ $arrow == "=>" ]] || continue
    host_provided "$soname" && continue
    [[ $path == /* ]] || { echo "bundle: $exe needs $soname, which is not found" >&2; exit 1; }
    cp -fL "$path" "$out/lib/$soname"
  done < <(ldd "$exe")
done
count() { find "$1" -maxdepth 1 -type f | wc -l; }
echo "bundle: $(count "$out/bin") executables, $(count "$out/lib") libraries, $(du -sh "$out" | cut -f1)"
