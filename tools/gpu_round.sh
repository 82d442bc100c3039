#!/usr/bin/env bash
# The GPU calls of a session, after the model's pieces are staged (tools/device_setup.sh): what the last
# session built but could not measure, most wanted first, in two phases of one call each (10 minutes
# at most a call):
#   bash tools/gpu_round.sh kernels   # the gpu tests of the kernels and the step, kernel benches
#   bash tools/gpu_round.sh steps     # tokens/s side by side, where a step's time goes
# Everything printed also goes to $OUT/round.log as it comes (a call that runs out of time returns what
# is under $OUT by then).
source tools/device_setup.sh
log() { tee -a "$OUT/round.log"; }
case "${1:-}" in
kernels)
  # the fourteenth session's one-launch reductions (split attention combined in-kernel, row max), then
  # the step graphs and chained steps that now run them
  python -m pytest -q -m gpu -p no:cacheprovider tests/test_row_max.py tests/test_paged_attention.py \
    tests/test_step_graphs.py tests/test_chain.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -30 | log
  python bench/kernels_bench.py --geometry smollm2 --batch 1 8 --q-len 1 16 --context 256 2048 \
    --out "$OUT/kernels_bench.json" 2>&1 | grep -v INFO | log
  python bench/gemm_probe.py --out "$OUT/gemm_probe.json" 2>&1 | grep -v -E "INFO|skip" | log
  ;;
steps)
  # captured whole against piece by piece at 1 / 2 / 4 / 8 streams, longer runs than the thirteenth
  # session's (its 8-stream loss was in a 0.3-s run that also paid for a capture)
  python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 512 --batch 1 2 4 8 \
    --auto --also-uncaptured --chain-capture 64 --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -3 | log
  python bench/profile_step.py --drafter dflash --batch 1 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | tail -30 | log
  ;;
*)
  echo "usage: bash tools/gpu_round.sh kernels|steps" >&2
  exit 2
  ;;
esac
