"""Generated gRPC stubs of proto/kvpool/v1/kvpool.proto."""
