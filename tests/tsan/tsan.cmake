# ThreadSanitizer build support, for the distribution's uninstrumented Abseil (see
# absl_sync_annotations.cc). Use it with PAGEDATTN_SANITIZE=thread:
#   cmake -S . -B build-tsan -DPAGEDATTN_SANITIZE=thread -DPAGEDATTN_ENABLE_CUDA=OFF \
#         -DCMAKE_PROJECT_INCLUDE=$PWD/tests/tsan/tsan.cmake
# At configure time it finds the mangled inline namespace of libabsl_synchronization, builds
# libpagedattn_tsan_absl.so into the build folder, and links it first into every executable
# (so that it interposes absl::Mutex for our code and for gRPC's). The library itself needs
# libabsl_synchronization (Condition), so CMake's own try_compile checks, which get the linker
# flags but no Abseil, still link. Run the tests with
# TSAN_OPTIONS=suppressions=tests/tsan.supp (.ci/run stage 3 does).
include_guard(GLOBAL)

if(NOT PAGEDATTN_SANITIZE STREQUAL "thread")
  message(FATAL_ERROR "tests/tsan/tsan.cmake is for PAGEDATTN_SANITIZE=thread builds")
endif()

find_library(PAGEDATTN_ABSL_SYNCHRONIZATION NAMES absl_synchronization REQUIRED)
find_program(PAGEDATTN_NM NAMES nm REQUIRED)
execute_process(COMMAND ${PAGEDATTN_NM} -D --defined-only ${PAGEDATTN_ABSL_SYNCHRONIZATION}
                OUTPUT_VARIABLE _tsan_symbols RESULT_VARIABLE _tsan_rc)
string(REGEX MATCH "_ZN4absl([0-9]+[A-Za-z_][A-Za-z0-9_]*)?5Mutex4LockEv" _tsan_lock "${_tsan_symbols}")
if(NOT _tsan_rc EQUAL 0 OR NOT _tsan_lock)
  message(FATAL_ERROR "tsan.cmake: absl::Mutex::Lock not found in ${PAGEDATTN_ABSL_SYNCHRONIZATION}")
endif()
set(_tsan_ns "${CMAKE_MATCH_1}")

set(_tsan_src ${CMAKE_CURRENT_LIST_DIR}/absl_sync_annotations.cc)
set(_tsan_lib ${CMAKE_BINARY_DIR}/libpagedattn_tsan_absl.so)
execute_process(
  COMMAND ${CMAKE_CXX_COMPILER} -std=c++17 -O2 -fPIC -shared "-DPAGEDATTN_ABSL_NS=\"${_tsan_ns}\""
          ${_tsan_src} -o ${_tsan_lib} ${PAGEDATTN_ABSL_SYNCHRONIZATION} -ldl
  RESULT_VARIABLE _tsan_rc ERROR_VARIABLE _tsan_err)
if(NOT _tsan_rc EQUAL 0)
  message(FATAL_ERROR "tsan.cmake: building ${_tsan_lib} failed:\n${_tsan_err}")
endif()
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_tsan_src})
message(STATUS "pagedattn: TSan annotations for Abseil (namespace '${_tsan_ns}'): ${_tsan_lib}")

# Before every object and library on the link line, so that it comes first in the lookup order.
string(APPEND CMAKE_EXE_LINKER_FLAGS " -Wl,--push-state,--no-as-needed ${_tsan_lib} -Wl,--pop-state")
