"""The gRPC surface: the servicer, request decoding and bounds, FetchFile streams, the token check, and the /metrics and /healthz endpoint."""
