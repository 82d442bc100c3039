#!/usr/bin/env bash
# The first GPU call of a session, after tools/device_setup.sh: what the last session built but could
# not measure. Writes its JSON under $OUT. The benches run first: a gpu test leaves a stalling peer's
# GPU sleep behind it for a while, which would slow what runs after it.
source tools/device_setup.sh
# the target step: eager, unfused and fused graphs against the floor
python bench/step_bench.py --target default --batch 1 8 --query 1 16 --out "$OUT" 2>&1 | tail -8
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 32 64 \
  --auto --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -3
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp --max-tokens 256 --batch 1 8 \
  --auto --json-out "$OUT/split_mtp.json" 2>&1 | grep -v INFO | tail -3
# the MTP chain as CUDA graphs (drafter_service/mtp_graphs.py; off by default until this says it wins)
# (fixed 3 drafts as well: --auto learned 0 with the eager chain, which then never runs)
for graphs in 0 1; do
  SPECSPLIT_MTP_CHAIN_GRAPHS=$graphs python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp \
    --max-tokens 256 --batch 1 8 --drafts-by-batch 1:3 --json-out "$OUT/split_mtp_k3_graphs$graphs.json" 2>&1 \
    | grep -v INFO | tail -3
done
SPECSPLIT_MTP_CHAIN_GRAPHS=1 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter mtp --max-tokens 256 \
  --batch 1 8 --auto --json-out "$OUT/split_mtp_graphs.json" 2>&1 | grep -v INFO | tail -3
# where the drafter service's host time per Step goes (host only: no CUPTI inflating launches)
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 \
  --drafter-profile 50:120 /tmp/prof/drafter.json --drafter-profile-host --json-out /tmp/prof/split.json 2>&1 \
  | grep -v INFO | tail -2
cp /tmp/prof/drafter.json.txt "$OUT/drafter_host_profile.txt"
# the ninth session's drafter-side attack (two targets, one stalling) and everything gpu since
python -m pytest -q tests/test_fused_kernels.py tests/test_step_graphs.py tests/test_split_gpu.py \
  tests/test_transport.py tests/test_dflash_graphs.py tests/test_mtp.py -m gpu -k "not random" -p no:cacheprovider 2>&1 | tail -15
