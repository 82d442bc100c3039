#!/usr/bin/env bash
# The first GPU call of a session, after tools/device_setup.sh: what the last session built but could
# not measure, most wanted first. Everything printed also goes to $OUT/round.log as it comes (a call
# that runs out of time returns what is under $OUT by then). The benches run before the long gpu tests:
# a stalling peer's test leaves a GPU sleep behind it for a while, which would slow what runs after it.
source tools/device_setup.sh
log() { tee -a "$OUT/round.log"; }
# the thirteenth session's chained steps captured whole (ChainProgram), then the pieces they inline
python -m pytest -q tests/test_chain.py -m gpu -p no:cacheprovider 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -40 | log
# captured whole against piece by piece and unchained, in-process, same run (and the services beside them)
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 32 64 \
  --auto --also-unchained --also-uncaptured --chain-capture 64 --json-out "$OUT/split_dflash.json" 2>&1 | grep -v INFO | tail -3 | log
# where a chained step's time goes (wall vs GPU busy, top kernels)
python bench/profile_step.py --drafter dflash --batch 1 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | tail -30 | log
python bench/profile_step.py --drafter dflash --batch 8 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | tail -12 | log
