#!/usr/bin/env bash
# The GPU calls of a session, after the model's pieces are staged (tools/device_setup.sh): what the last
# session built but could not measure, most wanted first, in two phases of one call each (10 minutes
# at most a call):
#   bash tools/gpu_round.sh kernels   # the gpu tests of the kernels and the step
#   bash tools/gpu_round.sh steps     # tokens/s side by side, where a step's time goes
# Everything printed also goes to $OUT/round.log as it comes (a call that runs out of time returns what
# is under $OUT by then).
source tools/device_setup.sh
log() { tee -a "$OUT/round.log"; }
case "${1:-}" in
kernels)
  # the fourteenth session's fused kernels (off by default; the step graph tests run them as their
  # fused="more" case), then the step graphs and chained steps
  python -m pytest -q -m gpu -p no:cacheprovider tests/test_swiglu_down.py tests/test_norm_linear.py \
    tests/test_row_max.py tests/test_step_graphs.py tests/test_chain.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -30 | log
  python bench/gemm_probe.py --quick --rows 1 16 64 --shapes down --cold-copies 256 --out "$OUT/gemm_probe.json" \
    2>&1 | grep -v -E "INFO|skip" | log
  # the training-data generator's step at 2,048 rows (18.6 ms where its GEMMs need ~1-2): where it goes
  python bench/dense_profile.py --batch 2048 --steps 24 --out "$OUT" 2>&1 | grep -v -E "INFO|USDT" | head -30 | log
  ;;
steps)
  # the fourteenth session's fusions, off by default until measured: SiLU·mul into the down projection
  # (SPECSPLIT_FUSED_DOWN), then also the post-attention norm into gate/up (SPECSPLIT_FUSED_NORM). Where
  # a step's time goes, then tokens/s, each setting its own processes (the variables are read at import);
  # beside it, chained steps captured whole against piecewise, without the captures' own time
  # (`*_excluding_captures`)
  for setting in "0 0" "1 0" "1 1"; do
    set -- $setting
    echo "SPECSPLIT_FUSED_DOWN=$1 SPECSPLIT_FUSED_NORM=$2" | log
    SPECSPLIT_FUSED_DOWN=$1 SPECSPLIT_FUSED_NORM=$2 python bench/profile_step.py --drafter dflash --batch 1 \
      --steps 40 --out "$OUT" 2>&1 | grep -v INFO | head -12 | log
    SPECSPLIT_FUSED_DOWN=$1 SPECSPLIT_FUSED_NORM=$2 python bench/split_bench.py --device cuda --dtype bfloat16 \
      --drafter dflash --max-tokens 512 --batch 1 2 4 8 --also-uncaptured --chain-capture 64 \
      --json-out "$OUT/split_fused_$1$2.json" 2>&1 | grep -v INFO | tail -2 | log
  done
  ;;
*)
  echo "usage: bash tools/gpu_round.sh kernels|steps" >&2
  exit 2
  ;;
esac
