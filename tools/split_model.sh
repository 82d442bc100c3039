#!/usr/bin/env bash
# Cut the default model's GGUF into pieces for the GPU host (the `device` tool), each as large as one
# call may carry beside the working tree: a call carries at most 64 MiB, tracked files included (the
# shipped drafter checkpoints alone weigh ~52 MiB now), and the last call carries .whl/ too.
#   bash tools/split_model.sh PATH/TO/model.gguf     -> .model/part00, part01, ... (.model/ git-excluded)
# After `bash tools/device_tree.sh slim` (the checkpoints left out of the tree) that is two pieces; see there.
# Then one call per piece but the last: `mkdir -p /var/tmp/stage && cp .model/partNN /var/tmp/stage/`
# carrying that piece (back to back: the machine is given back 30 s after a call), and a last call
# carrying the last piece and .whl that sources tools/device_setup.sh.
set -euo pipefail
gguf=${1:?usage: tools/split_model.sh PATH/TO/model.gguf}
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
wheels=$(du -sb .whl 2>/dev/null | cut -f1 || echo 0)
room=$(( 64 * 1024 * 1024 - tree - wheels - 1024 * 1024 ))  # 1 MiB to spare: untracked files, rounding
if [ "$room" -lt $(( 4 * 1024 * 1024 )) ]; then
  echo "only $room bytes left beside the working tree: too little to carry the model" >&2
  exit 1
fi
rm -f .model/part*
mkdir -p .model
split -b "$room" -d "$gguf" .model/part
ls -l .model/part* | awk '{print $5, $9}'
echo "$(ls .model/part* | wc -l) pieces of at most $room bytes"
