#!/usr/bin/env bash
# The first GPU call of a session, after tools/device_setup.sh: what the last session built but could
# not measure, most wanted first. Everything printed also goes to $OUT/round.log as it comes (a call
# that runs out of time returns what is under $OUT by then). The benches run before the long gpu tests:
# a stalling peer's test leaves a GPU sleep behind it for a while, which would slow what runs after it.
source tools/device_setup.sh
log() { tee -a "$OUT/round.log"; }
# the tenth session's MTP propose (pending pairs inside the graph) against the eager path, on the GPU
python -m pytest -q tests/test_mtp.py tests/test_step_graphs.py -m gpu -k "mtp or chain" -p no:cacheprovider 2>&1 | tail -3 | log
# MTP with --auto: the tuner now clips one-off capture steps; commits enter in one batched copy
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp --max-tokens 256 --batch 1 8 \
  --auto --json-out "$OUT/split_mtp_auto.json" 2>&1 | grep -v INFO | tail -2 | log
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp --max-tokens 256 --batch 1 8 \
  --drafts-by-batch 1:3 --json-out "$OUT/split_mtp_k3.json" 2>&1 | grep -v INFO | tail -2 | log
# what two more DFlash layers cost per step (random 4- and 6-layer drafters, fixed draft lengths)
python tools/random_dflash_pair.py /tmp/rd
for layers in 4 6; do
  python bench/draft_length.py --device cuda --dtype bfloat16 --drafter /tmp/rd/dflash$layers --max-tokens 128 \
    --batch 1 8 32 --drafts 3 7 15 --json-out "$OUT/draft_cost_layers$layers.json" 2>&1 | grep -v INFO | tail -12 | log
done
# the shipped (6-layer, tau 2.90) drafter in the split bench
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 32 64 \
  --auto --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -2 | log
python -m pytest -q tests/test_fused_kernels.py tests/test_step_graphs.py tests/test_split_gpu.py \
  tests/test_transport.py tests/test_dflash_graphs.py tests/test_mtp.py -m gpu -k "not random" -p no:cacheprovider 2>&1 | tail -5 | log
