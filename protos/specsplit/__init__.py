"""The specsplit proto package (rooted under protos/ so it never shadows the top-level CLI package)."""
