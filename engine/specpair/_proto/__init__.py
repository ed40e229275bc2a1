"""Generated gRPC stubs for protos/ (scripts/gen-protos.sh). Do not edit."""
