#!/usr/bin/env bash
# Make the working tree that travels with each `device` call small while the model goes up, and put it
# back after. The shipped drafter checkpoints (~57 MB) are tracked, so every call carries them and the
# 98 MB model fits beside them only in ~15 pieces (15 calls, ~8 s each); without them it goes in two.
#   bash tools/device_tree.sh slim      # untrack drafter_service/checkpoints (files stay) and ignore them
#   bash tools/split_model.sh PATH/TO/model.gguf   # now two pieces, .model/part00 and part01
#   ... call 1 carries .model/part00, call 2 .model/part01 (each: mkdir -p /var/tmp/stage && cp ... there);
#   ... EVERY later call carries drafter_service/checkpoints and .whl: an ignored path carried by one call
#       is gone in the next (the seventeenth session lost a 354-s round to that)
#   bash tools/device_tree.sh restore   # track them again, drop the ignore line; `git status` is clean
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dir=drafter_service/checkpoints
line="/$dir/"
exclude=.git/info/exclude
case "${1:-}" in
slim)
  if ! git diff --cached --quiet; then
    echo "device_tree: the index has staged changes; commit or unstage them first" >&2
    exit 1
  fi
  grep -qxF "$line" "$exclude" 2>/dev/null || echo "$line" >> "$exclude"
  # a commit while slim would delete the checkpoints from main (two sessions did): refuse commits until restore
  hooks=$(git rev-parse --git-path hooks)
  mkdir -p "$hooks"
  if [ -e "$hooks/pre-commit" ] && ! grep -q device-tree-slim "$hooks/pre-commit"; then
    echo "device_tree: a pre-commit hook of yours is there: commits are NOT refused while slim" >&2
  elif [ ! -e "$hooks/pre-commit" ]; then
    cat > "$hooks/pre-commit" <<'HOOK'
#!/bin/sh
if [ -e "$(git rev-parse --git-dir)/device-tree-slim" ]; then
  echo "device_tree: slim (the checkpoints untracked); run bash tools/device_tree.sh restore first" >&2
  exit 1
fi
HOOK
    chmod +x "$hooks/pre-commit"
  fi
  touch "$(git rev-parse --git-dir)/device-tree-slim"
  git rm -r --cached -q "$dir"
  echo "untracked $dir (still on disk, ignored); tracked files now $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
  ;;
restore)
  git reset -q -- "$dir"
  rm -f "$(git rev-parse --git-dir)/device-tree-slim"
  if [ -f "$exclude" ]; then
    grep -vxF "$line" "$exclude" > "$exclude.tmp" || true
    mv "$exclude.tmp" "$exclude"
  fi
  git status --short -- "$dir"
  echo "tracked $dir again"
  ;;
*)
  echo "usage: bash tools/device_tree.sh slim|restore" >&2
  exit 2
  ;;
esac
