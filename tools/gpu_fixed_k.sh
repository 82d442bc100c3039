#!/usr/bin/env bash
# Chained steps captured whole against piecewise at a fixed draft length (no tuner), 8 streams: the
# measurement behind EngineConfig.chain_capture's default. Run after tools/device_setup.sh's pieces are staged.
source tools/device_setup.sh
python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 8 \
  --also-uncaptured --chain-capture 64 --json-out "$OUT/split_fixed.json" 2>&1 | grep -v INFO | tail -3
