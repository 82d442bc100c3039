#!/usr/bin/env bash
# Regenerate the Python stubs of protos/specsplit/v1 (needs grpcio-tools==1.84.0: pip install -e .[dev]).
# Usage: tools/gen_protos.sh [OUT]  (default: the repository itself; OUT/protos/specsplit/v1 gets the stubs)
# protoc roots import paths at the repository (`protos.specsplit.v1`), but the package installs as
# `specsplit.protos.v1`; the stubs import each other relatively so they work wherever they land.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath "${1:-.}")
python -m grpc_tools.protoc -I . --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" protos/specsplit/v1/*.proto
stubs=("$out"/protos/specsplit/v1/*_pb2*.py*)
sed -i -e 's/^from protos\.specsplit\.v1 import /from . import /' \
       -e "s/'protos\.specsplit\.v1\.\([a-z_]*_pb2\)'/'specsplit.protos.v1.\1'/" "${stubs[@]}"
echo "generated: ${stubs[*]}"
