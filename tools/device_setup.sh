#!/usr/bin/env bash
# Source on the GPU host (the `device` tool's machine) before a benchmark or gpu tests:
#   source tools/device_setup.sh
# It puts the default model's GGUF back together from the pieces earlier calls left in /var/tmp/stage
# (part00, part01, ...; a call carries at most 64 MiB with the working tree, ~54 MiB of it tracked
# files since the tenth session's drafter, so the 98 MB file travels in ~11 pieces cut by
# `bash tools/split_model.sh <the .gguf>`, one call per piece copying it to /var/tmp/stage/, the last
# piece carried with the call that sources this: see that script; two pieces after `tools/device_tree.sh
# slim`, whose calls must then carry drafter_service/checkpoints), installs the wheels the image lacks from
# .whl/ (gguf, grpcio-health-checking, grpcio-reflection, prometheus-client), installs this checkout
# editable and converts the model once into $SPECSPLIT_CACHE (kept under /var/tmp while the machine
# stays warm). Use `python -m pip` there: the image's `pip` belongs to another interpreter.
# (No `set -e`: sourced, it would end the calling shell at the first failure, silently where the call sends
# this script's output to /dev/null. Each failure says what is missing and returns 1; `gpu_round.sh` stops
# there.)
export SPECSPLIT_CACHE=${SPECSPLIT_CACHE:-/var/tmp/cache} PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /var/tmp/stage
cp -n .model/part* /var/tmp/stage/ 2>/dev/null || true
converted=$SPECSPLIT_CACHE/smollm2-135m-instruct/model.safetensors
if [ ! -f "$converted" ]; then
  if [ "$(head -c 4 /var/tmp/stage/part00 2>/dev/null)" != GGUF ]; then
    echo "device_setup: no model here and no first piece (/var/tmp/stage/part00) to make it from: this machine" \
      "is fresh; stage .model/part00 and the rest first (tools/device_tree.sh, tools/split_model.sh)" >&2
    return 1
  fi
  cat /var/tmp/stage/part* > /var/tmp/stage/model.gguf
fi
python -m pip install -q --no-deps --target /tmp/site .whl/*.whl > /tmp/pip-wheels.log 2>&1 || cat /tmp/pip-wheels.log
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-project.log 2>&1 || cat /tmp/pip-project.log
if [ ! -f "$converted" ]; then
  if ! python -c "
from specsplit.shared.gguf_import import DEFAULT_SUBDIR, cache_root, convert_gguf, to_stderr
convert_gguf('/var/tmp/stage/model.gguf', cache_root() / DEFAULT_SUBDIR, progress=to_stderr)"; then
    echo "device_setup: the pieces in /var/tmp/stage ($(ls /var/tmp/stage | tr '\n' ' ')) did not convert: one" \
      "missing or cut short?" >&2
    return 1
  fi
fi
