#!/usr/bin/env bash
# The first GPU call of a session, after tools/device_setup.sh: what the last session built but could
# not measure, most wanted first. Everything printed also goes to $OUT/round.log as it comes (a call
# that runs out of time returns what is under $OUT by then). The benches run before the long gpu tests:
# a stalling peer's test leaves a GPU sleep behind it for a while, which would slow what runs after it.
source tools/device_setup.sh
log() { tee -a "$OUT/round.log"; }
# the twelfth session's chained speculative steps on the GPU (and the paths they hand over to)
python -m pytest -q tests/test_chain.py tests/test_step_graphs.py -m gpu -p no:cacheprovider 2>&1 | tail -3 | log
# what chained steps over the split would stand on: stream waits on IPC words, and their release
timeout 120 python tools/bells_probe.py 2>&1 | tail -8 | log
# chained against unchained in-process steps, same run (target only and the services beside them)
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 32 64 \
  --auto --also-unchained --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -2 | log
# (if chaining failed there, the same bench without it, so the round still measures the rest)
[ -f "$OUT/split_dflash.json" ] || python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash \
  --max-tokens 256 --batch 1 8 --auto --no-chain --json-out "$OUT/split_unchained.json" 2>&1 | grep -v INFO | tail -20 | log
# where a chained step's time goes (wall vs GPU busy, top kernels)
python bench/profile_step.py --drafter dflash --batch 1 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | tail -30 | log
python bench/profile_step.py --drafter dflash --batch 8 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | tail -12 | log
python -m pytest -q tests/test_fused_kernels.py tests/test_split_gpu.py tests/test_chaos_gpu.py tests/test_transport.py \
  tests/test_dflash_graphs.py tests/test_mtp.py -m gpu -k "not random" -p no:cacheprovider 2>&1 | tail -5 | log
