"""pagedattn.v1 stubs: pagedattn_pb2 and pagedattn_pb2_grpc are generated from the .proto by the
build (CMake, or setup.py when pip installs the package)."""
