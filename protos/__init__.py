"""Versioned gRPC protocol of specsplit: .proto sources and their generated Python stubs."""
