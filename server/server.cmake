# pagedattn-server (build/bin/pagedattn-server): flags, wiring and signals in main.cc.
# PAGEDATTN_HAVE_CUDA is defined for main.cc once the CUDA backend target exists; until then
# --backend=cuda fails at start with a clear message.
# It needs the engine and the CPU backend (server/engine, server/backend).
if(NOT TARGET pagedattn_engine OR NOT TARGET pagedattn_backend)
  message(STATUS "pagedattn: no engine/backend yet, pagedattn-server is not built")
  return()
endif()
add_executable(pagedattn-server ${CMAKE_CURRENT_SOURCE_DIR}/main.cc)
target_link_libraries(pagedattn-server PRIVATE
  pagedattn_service pagedattn_engine pagedattn_backend pagedattn_metrics
  prometheus-cpp::pull absl::flags absl::flags_parse absl::status absl::statusor absl::strings
  absl::time Threads::Threads)
if(TARGET pagedattn_backend_cuda)
  target_link_libraries(pagedattn-server PRIVATE pagedattn_backend_cuda)
  target_compile_definitions(pagedattn-server PRIVATE PAGEDATTN_HAVE_CUDA=1)
else()
  target_compile_definitions(pagedattn-server PRIVATE PAGEDATTN_HAVE_CUDA=0)
endif()
