#!/usr/bin/env bash
# The first GPU call of a session, after tools/device_setup.sh: what the last session built but could
# not measure, most wanted first (a call may run out of time: what is under $OUT by then comes back).
# The benches run after the quick gpu tests of the new code and before the long ones: a stalling peer's
# test leaves a GPU sleep behind it for a while, which would slow what runs after it.
source tools/device_setup.sh
# the tenth session's MTP propose with its pending pairs inside the graph, against the eager path
python -m pytest -q tests/test_mtp.py tests/test_step_graphs.py -m gpu -k "mtp or chain" -p no:cacheprovider 2>&1 | tail -3
for graphs in 0 1; do
  SPECSPLIT_MTP_CHAIN_GRAPHS=$graphs python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp \
    --max-tokens 256 --batch 1 8 --drafts-by-batch 1:3 --json-out "$OUT/split_mtp_k3_graphs$graphs.json" 2>&1 \
    | grep -v INFO | tail -2
done
# the tenth session's 6-layer DFlash drafter in the split bench
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
  --auto --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -2
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp --max-tokens 256 --batch 1 8 \
  --auto --json-out "$OUT/split_mtp_auto.json" 2>&1 | grep -v INFO | tail -2
python -m pytest -q tests/test_fused_kernels.py tests/test_step_graphs.py tests/test_split_gpu.py \
  tests/test_transport.py tests/test_dflash_graphs.py tests/test_mtp.py -m gpu -k "not random" -p no:cacheprovider 2>&1 | tail -5
