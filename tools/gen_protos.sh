#!/usr/bin/env bash
# Regenerate the Python stubs of protos/specsplit/v1 (needs grpcio-tools==1.84.0: pip install -e .[dev]).
# Import paths are rooted at the repository root, so generated code imports `protos.specsplit.v1`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/specsplit/v1/*.proto
echo "generated: $(ls protos/specsplit/v1/*_pb2*.py* | tr '\n' ' ')"
