#!/usr/bin/env bash
# Pack an earlier commit's tree for the GPU host, to run a benchmark there beside this checkout's (one machine, one
# call: `gpu_round.sh pair-ab`). The shipped drafter checkpoints stay out (the call carries this checkout's; the
# old tree links to them), so the pack is a few MB.
#   bash tools/old_tree.sh COMMIT      -> .old-tree.tar.gz (git-excluded: carry it, with the checkpoints and .whl)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
commit=${1:?usage: tools/old_tree.sh COMMIT}
git rev-parse --verify -q "$commit^{commit}" > /dev/null || { echo "old_tree: no commit $commit" >&2; exit 1; }
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.old-tree.tar.gz "$exclude" 2>/dev/null || echo /.old-tree.tar.gz >> "$exclude"
git archive --format=tar.gz -o .old-tree.tar.gz --prefix=old/ "$commit" -- . ':(exclude)drafter_service/checkpoints'
echo "$(git rev-parse --short "$commit") packed: $(du -h .old-tree.tar.gz | cut -f1) in .old-tree.tar.gz"
