#!/usr/bin/env bash
# The GPU calls of a session, after the model's pieces are staged (tools/device_setup.sh): what the last
# session built but could not measure, most wanted first, in phases of one call each (10 minutes
# at most a call):
#   bash tools/gpu_round.sh kernels   # the gpu tests of the kernels, the step and the chain
#   bash tools/gpu_round.sh steps     # tokens/s side by side, where a step's time goes
#   bash tools/gpu_round.sh services  # device-side ordering between two processes (stream_wait_probe)
#   bash tools/gpu_round.sh profile   # the in-process chained step's kernels at one and eight streams
#   bash tools/gpu_round.sh prefill   # captured prefill: time to first token, the speculative ratios
#   bash tools/gpu_round.sh capture   # eight and more streams' chained steps captured whole, or piecewise
#   bash tools/gpu_round.sh chain     # the services' steps chained, proposes sent ahead: GPU tests, tokens/s
#   bash tools/gpu_round.sh waits     # the target's stream waits on the device for chained drafts: probe, GPU tests
#   bash tools/gpu_round.sh waits-bench  # ... and its tokens/s against host polls and in-process
#   bash tools/gpu_round.sh probe-release  # the watchdog's release while a kernel module loads (no model)
#   bash tools/gpu_round.sh cross-gpu  # 2-GPU kind: a step's two graphs ordered by stream flags, drafter on GPU 0 or 1 (no model)
#   bash tools/gpu_round.sh timeline  # device waits' GPU tests, then both services' GPU work on one clock
#   bash tools/gpu_round.sh tail      # the target's side of a services chained step as one graph: GPU test, tokens/s, timeline
#   bash tools/gpu_round.sh prepare   # the drafter's chained steps prepared before the target's writes: GPU tests, tokens/s
#   bash tools/gpu_round.sh drafter-waits  # the drafter's stream waits on the device for the target's writes: GPU tests
#   bash tools/gpu_round.sh drafter-waits-bench  # ... and its tokens/s beside host polls and the target's waits alone
#   bash tools/gpu_round.sh serving   # held-out prompts through 1/8/16 slots, served speed; the 8-stream step's host and kernels
#   bash tools/gpu_round.sh head      # the LM head as one float32-out GEMM: GPU tests; head-bench: steps side by side
#   bash tools/gpu_round.sh overlap   # prefills read after the next launch: GPU tests, tokens/s on and off
#   bash tools/gpu_round.sh sync      # where a served run's host still waits for the device, by call site
#   bash tools/gpu_round.sh floor     # the 8B-shaped step kernel by kernel against its floor; its GEMMs, cuBLAS vs Triton
#   bash tools/gpu_round.sh skinny    # the few-rows projection kernel: GPU tests, the 8B step with it, the heads
#   bash tools/gpu_round.sh skinny-step  # ... its GPU tests with the graphs', the 8B step's variants, step_bench 8B
#   bash tools/gpu_round.sh floor-batch  # the 8B step's variants at 8 streams and in verifies (1 and 4 x 16 rows)
#   bash tools/gpu_round.sh fold      # norms, residual adds and SiLU·mul folded into the skinny kernel: GPU tests, 8B step
#   bash tools/gpu_round.sh fold-more # ... step_bench 8B with them, and the projections' tiles chosen cold
#   bash tools/gpu_round.sh fold-small  # the default model's step with the kernel and its folds below their bounds
#   bash tools/gpu_round.sh fold-default  # ... taken by every decoder layer: GPU tests, step_bench default
#   bash tools/gpu_round.sh fold-served   # ... served tokens/s with the folds against without
#   bash tools/gpu_round.sh tiles     # the folds past 16 rows (row tiles, small weights): the default step's variants, served steps
#   bash tools/gpu_round.sh tiles-tests   # ... the GPU tests of everything that runs fused layers
#   bash tools/gpu_round.sh tiles-served  # ... tokens/s with the folds against without, three rounds
#   bash tools/gpu_round.sh unanswered  # (next) device waits taking drafts before the answer: GPU tests, tokens/s
#   bash tools/gpu_round.sh services-host  # (next) where both hosts' time goes in a services step, by function
#   bash tools/gpu_round.sh both-host  # both streams on device waits: the target's host by function, the drafter's by stack
#   bash tools/gpu_round.sh replays   # the host's time in graph replays, in-process against the services, with/without MPS
#   bash tools/gpu_round.sh watchdog  # the device waits' watchdog no longer woken at every wait: GPU tests, tokens/s
#   bash tools/gpu_round.sh overhang  # sequences chain to their ends: GPU tests, tokens/s with requests coming and going
#   bash tools/gpu_round.sh churn     # requests ending and arriving through 8 slots: the services' host by function
#   bash tools/gpu_round.sh host-flags  # (next) the DONE buffer in a host page: the module-load hang's test, device waits' GPU tests
#   bash tools/gpu_round.sh host-flags-bench  # ... split_bench with both waits, the page against device memory
#   bash tools/gpu_round.sh host-flags-churn  # ... churn with both waits, the page's waits drained before new kernels or not
#   bash tools/gpu_round.sh regroup   # (next) a batch that changed takes the propose sent ahead: GPU test, churn with and without
#   bash tools/gpu_round.sh regroup-bench  # ... split_bench with requests coming and going, with and without, three rounds
#   bash tools/gpu_round.sh attach    # (next) the prefill GPU tests; churn with both waits, without and with --prefill-copies
#   bash tools/gpu_round.sh attach-bench  # split_bench --batch 1 8 --waves 4 --rounds 3 --also-both-waits
#   bash tools/gpu_round.sh mps       # `specsplit up --mps`: its GPU test; the services under MPS against without
#   bash tools/gpu_round.sh mps-timeline  # both services' work on one clock under MPS, both streams waiting on the device
#   bash tools/gpu_round.sh context-launch  # the drafter's context k/v in one launch (on): GPU tests, tokens/s beside apart
#   bash tools/gpu_round.sh waves     # eight streams kept full (48 requests through 8 slots): draft lengths with the tuner, the split bench
#   bash tools/gpu_round.sh draft-lengths # tokens/s by draft length at 1 and 8 streams, the tuner's; the 8-stream step at k = 3 and 15
#   bash tools/gpu_round.sh served-8b     # the 8B-shaped step as the engine serves it, against its floor
#   bash tools/gpu_round.sh host-steps    # where the host's part of a steady decode step goes, target only and in-process
#   bash tools/gpu_round.sh pdl-default   # Triton kernels launched dependent (on by default, heavy projections plain):
#                                         # GPU tests, the steps' replays and served tokens/s with and without
#   bash tools/gpu_round.sh qkv-rope      # the rotation and cache write in the q/k/v projection: GPU tests, steps on/off (run, dropped)
#   bash tools/gpu_round.sh mps-default   # the pair under MPS by default: its GPU tests, pair_bench with and without (run: on)
#   bash tools/gpu_round.sh mps-default-tests  # (next) test_split_gpu.py whole under the MPS default (21 of 32 passed in 320 s)
#   bash tools/gpu_round.sh pair-bench    # (run in the fifty-third session) --speculate-below 0 / 4 / 8 under MPS through the real pair, 1-8 streams,
#                                         # trees (up's default again) beside chains; then mps-trees: services / in-process
#   bash tools/gpu_round.sh engine-process-short  # (run in the fifty-fourth session) the served pair and target only
#                                          with the engine in a process of its own and not, at 1 and 8 streams, one round
#   bash tools/gpu_round.sh engine-process  # (next) the same, three rounds of 160 tokens; the front-end stand-in both ways
#   bash tools/gpu_round.sh served-pair   # (run in the fifty-fifth session) the pair as `up` starts it: host profiles, timeline,
#                                         # --speculate-below 0 / 4 at 1, 4, 8 streams; served-pair-tests: its GPU tests, b8 timeline
#   bash tools/gpu_round.sh round62       # (run in the sixty-third session: single runs spread 2.4-3.3 ms a step, no verdict;
#                                         # next with --timed-runs 7) the attach on the Step stream with trees regrouped,
#                                         # alternating with regrouping alone; then round63b
#   bash tools/gpu_round.sh round64       # (next) round62 with medians of seven timed runs, and one intra-op thread a process
#   bash tools/gpu_round.sh round63b      # (next) the served pair at 8 streams, --stream-attach against without
#   bash tools/gpu_round.sh tree-schedule # (run in the sixty-third session: 6:7 no better than 15; 7 best in process) 8 slots:
#                                         # trees of 15, of 7, and of 15 with --trees-by-batch 6:7, in process and services
#   bash tools/gpu_round.sh lanes         # (run in the sixty-second session: lanes lose, 0.85x and 0.69x) in process: 8 slots as one engine against 2 and 4 engines of 4 and 2
#                                         # slots on streams of their own (do their steps overlap on the GPU?)
#   bash tools/gpu_round.sh round61       # (run in the sixty-second session: regrouping on) round60b reordered: serving with and without tree_regroup, alternating
#   bash tools/gpu_round.sh tree-sizes    # (run in the sixty-second session: 7 best at 8 slots) in process through 8 slots: tok/s by tree size (7, 15, 31, 3)
#   bash tools/gpu_round.sh round61b      # (next) the served pair at 1 and 8 streams, PAIR_ARGS=--tree-regroup if it wins
#   bash tools/gpu_round.sh round60b      # (next) trees regrouped (EngineConfig.tree_regroup, off): serving, GPU tests
#   bash tools/gpu_round.sh round60       # (run in the sixtieth session) round59, then serving's host time by phase, unprofiled (--clock)
#   bash tools/gpu_round.sh round59       # (next) attaches riding the Step stream: the services' GPU tests that
#                                         # attach requests; serving through 8 slots with and without
#   bash tools/gpu_round.sh round58       # (run in the fifty-ninth session) GPU tests of chained steps captured after 2 runs; serving through 8
#                                         # slots in process, through the services (as they are, the drafter's graphs
#                                         # captured after 2 runs); round58c: unquiesced, the target's host polling
#   bash tools/gpu_round.sh pair-ab       # (next, after `tools/old_tree.sh 8f8d27d`) the served pair at one stream,
#                                         # this checkout beside the fifty-fifth session's tree (1.35x here, 1.74x there)
#   bash tools/gpu_round.sh round58b      # (next) the served pair at 1 and 8 streams (round57b's pair_bench) with it
#   bash tools/gpu_round.sh round57       # (run in the fifty-eighth session: all passed) the GPU tests of the tree
#                                         # candidates' copy and of the device waits
#   bash tools/gpu_round.sh round57b      # (run in the fifty-eighth session) target only with embeddings by indexing
#                                         # on/off; the pair's first chunks and step shape
#   bash tools/gpu_round.sh round56       # (run: the services' ms a step with the waits' fix and without; its tests got
#                                         # no verdict within their 230 s)
#   bash tools/gpu_round.sh waits-pruned  # (next) the device waits' fix: services' ms a step with and without, timeline;
#                                         # waits-pruned-tests: the device waits' GPU tests, test_split_gpu's last five
#   bash tools/gpu_round.sh embed-indexing  # (next) embeddings by weight[ids] (off): GPU tests on, steps on/off
#   bash tools/gpu_round.sh pair-step     # (next) the served pair's ~2-ms step at one stream: the target's host by phase,
#                                         # split_bench's services beside it
#   bash tools/gpu_round.sh front-end     # (run) gRPC clients' tokens/s with the clients as threads, then as processes
#   bash tools/gpu_round.sh h200-goals    # (next) the goals on the H200: steps, the held-out prompts at one stream, the 8B floor
#   bash tools/gpu_round.sh tables        # (next) the rotary tables in one launch (on): GPU tests, served tokens/s
#                                         # with against without (one-launch attention: measured, removed)
#   bash tools/gpu_round.sh served-trace  # the served decode steps under the profiler: where the device stands idle
#   bash tools/gpu_round.sh tau-sides     # issue 10: the shipped drafter's tau on held-out prompts and on trained-side ones
#   bash tools/gpu_round.sh fold-check    # (next) the GPU tests changed after the device time, tokens/s over 3 rounds
#   bash tools/gpu_round.sh eval      # issue 10: the shipped drafter's tau and speedup in one run, by kind
#   bash tools/gpu_round.sh train 27   # issue 10: the drafter continued 7.2 minutes
#   bash tools/gpu_round.sh tree-chains   # (forty-third session) trees chained, captured whole: GPU tests, tau, speedup
#   bash tools/gpu_round.sh tree-bench    # ... split_bench --also-trees 15 at one and eight streams, two rounds
#   bash tools/gpu_round.sh tree-scores   # (next) trees grown from the shipped tree scores against without: tau,
#                                         # speedup at one stream; the GPU tests of chained trees with them
#   bash tools/gpu_round.sh wide-trees-eval  # (forty-seventh session: run on an H100; README) trees of
#                                         # 63, 31 and 15 nodes at one stream: tau and speedup in one run each; then
#                                         # wide-trees-bench: tokens/s at 1, 2 and 4 streams (31 beside 15: which
#                                         # trees_by_batch to make the default); trees-ahead: the services' tree
#                                         # candidates sent ahead, its GPU tests and tokens/s; wide-trees: the GPU
#                                         # tests changed without a device; wide-trees-profile: a step's kernels
#   bash tools/gpu_round.sh trees         # issue 10: draft trees' walk by budget, static trees calibrated over 3,000
#                                         # training-side prompts (paths saved), the engine's eager tree steps held out
#   (next, after the forty-second session, which ran on an H100: `defaults` (second half passed), `train 48` (the
#   shipped recipe with the H100's pool doubled: 3.59 -> 3.55, not shipped), and draft trees measured teacher-forced
#   (`bench/tree_tau.py`: a best-first tree of 15 nodes takes the walk 3.67 -> 4.28, chat 3.20 -> 3.77): `trees`
#   (the engine's tree steps decoded on the GPU, static shapes calibrated at scale for the captured verify that
#   comes next); then `regroup-bench`, `attach-bench`; `predecessor` (~5 min, the shallow correction: the trees
#   do what it aimed at, so it is the least wanted))
# Start with the two uploads and the first phase in one message of back-to-back calls (`services` needs no
# model: it can ride on the first upload's call): the machine is given back 30 s after a call, and the
# nineteenth session lost two fresh machines' start-up to a reply that came later than that.
# Everything printed also goes to $OUT/round.log as it comes (a call that runs out of time returns what
# is under $OUT by then).
log() { tee -a "$OUT/round.log"; }
fused_layer_tests() {  # the GPU tests of everything that runs the fused layers, within $1 seconds
  timeout "$1" python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_linear.py tests/test_step_graphs.py \
    tests/test_chain.py tests/test_dflash_graphs.py tests/test_graphed_prefill.py 2>&1 \
    | grep -E "drafts accepted|Error|error|assert|FAILED|passed|failed" | tail -30 | log
}
device_waits_round() {  # the device-wait GPU tests within $1 s, then split_bench's $3 rounds within $2 s, into split_$4.json
  timeout "$1" python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "waited_for or never_writes or device_waits" 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout "$2" python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --waves 4 --rounds "$3" --also-device-waits --also-both-waits --json-out "$OUT/split_$4.json" 2>&1 \
    | grep -E "^batch [0-9]+" | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) for k, v in \
    d[b]['rounds']['median'].items() if 'over' in k}) for b in d if b.startswith('batch')]" "$OUT/split_$4.json" 2>&1 | log
}
serving_variants() {  # 24 held-out prompts through 8 slots (trees of 15), each of "$@" within what `left` gives
  # (--time-replays: the host's time inside graph replays, unprofiled; the services' profile showed ~0.9 ms a replay
  # serving, 54 us in process)
  # (--timed-runs 7, since the sixty-third session: single timed runs of the services, 0.3 s each, spread 2.4-3.4 ms a
  # step on one machine; the median of seven)
  local serve="python bench/host_profile.py --device cuda --batch 8 --serving 24 --max-tokens 128 --draft-tree 15 \
    --time-replays --timed-runs 7"
  local services="--split --split-only --both-waits --mps" variant flags
  local threads variant_name
  for variant_name in "$@"; do
    [ "$(left)" -gt 70 ] || { echo "$variant_name: no time left" | log; break; }
    # (omp1-VARIANT: VARIANT with one intra-op thread in every process, the drafter service's inherited; torch's
    # default is one a core, 16 here, in each of the processes sharing the host)
    variant=${variant_name#omp1-} threads=
    [ "$variant" = "$variant_name" ] || threads=1
    case $variant in
      in-process) flags="" ;;
      services) flags="$services" ;;  # (trees regrouped: the default since the sixty-second session)
      no-tree-regroup) flags="$services --no-tree-regroup" ;;
      unquiesced) flags="$services --unquiesced" ;;
      overlapped) flags="$services --overlap-attach" ;;
      stream-attach) flags="$services --stream-attach" ;;
      tree-regroup) flags="$services" ;;
      stream-attach-regroup) flags="$services --stream-attach" ;;
      drafter-after-2) flags="$services --drafter-capture-after 2" ;;
      host-polls) flags="--split --split-only --mps" ;;
      in-process-mps) flags="--mps" ;;
      no-mps) flags="--split --split-only --both-waits" ;;
      # (--clock: a fourth run, each engine phase and drafter verb clocked, unprofiled)
      in-process-clock) flags="--clock" ;;
      stream-attach-clock) flags="$services --stream-attach --clock" ;;
      *) echo "serving_variants: no variant $variant" | log; continue ;;
    esac
    env ${threads:+OMP_NUM_THREADS=$threads} timeout $([ "${variant%-clock}" = "$variant" ] && echo 75 || echo 100) $serve $flags \
      > "$OUT/serving-$variant_name.txt" 2>&1
    grep -E "serving|chained steps|^drafter \(|Error|^clocked" "$OUT/serving-$variant_name.txt" \
      | sed "s/^/$variant_name: /" | log
  done
}
if [ "${1:-}" = services ]; then
  # can the target's and the drafter's streams order each other through a flag, with no host waiting
  # (the services' steps in series through both hosts cost ~2.4x an in-process chained step)? Needs no
  # model: runs on a machine fresh from its first call.
  # (seventeenth session: the ping-pong across processes through device memory ran at 9.5 us a round trip;
  # the next part, a device-memory wait released by its own host, hung until the round's timeout and took
  # the later parts along: each part now runs in its own process, at most 25 s)
  timeout 200 python tools/stream_wait_probe.py --rounds 2000 --part-timeout 25 2>&1 | log
  exit
fi
if [ "${1:-}" = cross-gpu ]; then
  # (twenty-fifth session, not run yet; on the 2-GPU kind, nvidia-h200-x2) the split's step reduced to two graphs
  # ordered by stream flags across two processes, the drafter on GPU 0 (time-sliced with the target, as the
  # services run now) and on GPU 1 (its own, rows read across NVLink): ms a step against one process. On one GPU
  # the services' step is 1.63 ms against 1.27 in-process; is a GPU of its own the way to 0.97x? Needs no model
  timeout 300 python tools/cross_gpu_probe.py --drafter-gpu 0 1 2>&1 | log
  exit
fi
if [ "${1:-}" = probe-release ]; then
  # can the watchdog take back a device wait while CUDA's lazy loading loads a kernel's module (which
  # waits for the whole context)? Needs no model; in a fresh process, kernels not loaded yet. Part 7 (a
  # flag in device memory, released by a stream write) hung in the twenty-third session; part 8 (twenty-fifth,
  # not run yet): the flag in registered host memory, released by a plain store, no CUDA call. If it gets
  # through, device waits on host-memory flags can be safe, and on by default
  echo "probe: a watchdog thread's release while a new kernel loads" | log
  timeout -k 10 60 python tools/stream_wait_probe.py --part 7 2>&1 | tail -6 | log
  echo "probe: a watchdog thread's plain store into host memory while a new kernel loads" | log
  timeout -k 10 60 python tools/stream_wait_probe.py --part 8 2>&1 | tail -6 | log
  exit
fi
source tools/device_setup.sh || { echo "gpu_round: no model on this machine (above); nothing run" | log; exit 1; }
case "${1:-}" in
kernels)
  # the GPU tests of the kernels, the step graphs, the chain and the DFlash graphs (the k < 15 check prints
  # the drafts each chained path accepted beside the eager drafter's)
  python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_row_max.py tests/test_paged_attention.py \
    tests/test_step_graphs.py tests/test_chain.py tests/test_dflash_graphs.py 2>&1 \
    | grep -E "drafts accepted|Error|error|assert|FAILED|passed|failed" | tail -30 | log
  ;;
steps)
  # where a step's time goes at one and eight streams, then tokens/s by draft length (and the tuner's view)
  for batch in 1 8; do
    python bench/profile_step.py --drafter dflash --batch $batch --steps 40 --out "$OUT" 2>&1 | grep -v INFO | head -12 | log
  done
  # at eight streams a step of k = 3 took ~1.96 ms against k = 15's ~1.78, captures left out (the tuner saw
  # 2.20 vs 1.95; sixteenth session): fewer drafts should never cost more. Where?
  python bench/profile_step.py --drafter dflash --batch 8 --num-drafts 3 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | head -12 | log
  python bench/draft_length.py --device cuda --dtype bfloat16 --batch 1 8 --drafts 3 7 15 --auto --max-tokens 256 \
    --json-out "$OUT/draft_length.json" 2>&1 | grep -v INFO | tail -16 | log
  python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 512 --batch 1 2 4 8 \
    --also-uncaptured --json-out "$OUT/split.json" 2>&1 | grep -v INFO | tail -2 | log
  ;;
profile)
  # where the in-process chained step's time goes at eight streams (1.67 ms against target-only's 0.92 at
  # tau 2.4: 1.07x, where the goal is 0.6 tau), beside one stream: kernels by GPU time, host ops
  for batch in 1 8; do
    timeout 150 python bench/profile_step.py --drafter dflash --batch $batch --steps 40 --out "$OUT" 2>&1 | grep -v INFO | head -24 | log
  done
  ;;
prefill)
  # short prompts through captured prefill forwards (EngineConfig.graphed_prefill): time to first token beside
  # eager prefill, then what it does to the speculative ratios (an eager prefill cost ~43 ms a prompt, a
  # quarter of the one-stream benches' time), the GPU tests, and eight streams captured whole
  (cd bench && python prefill_bench.py --device cuda --dtype bfloat16 --json-out "$OUT/prefill.json" 2>&1 | grep -v INFO | log)
  python bench/draft_length.py --device cuda --dtype bfloat16 --batch 1 8 --drafts 7 15 --max-tokens 256 \
    --json-out "$OUT/draft_length.json" 2>&1 | grep -v INFO | tail -8 | log
  python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 512 --batch 1 8 \
    --json-out "$OUT/split.json" 2>&1 | grep -v INFO | tail -2 | log
  python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_graphed_prefill.py tests/test_step_graphs.py \
    -k "captured_prefill or device_drafts or decoding_ahead_on_the_gpu" 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -12 | log
  python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 512 --batch 8 --chain-capture 8 \
    --json-out "$OUT/split_capture8.json" 2>&1 | grep -v INFO | tail -2 | log
  ;;
chain)
  # the services' steps chained, each chained propose now sent as the step before it launches (twentieth
  # session: RemoteProposer.chain_prefetch, so the drafter's host works while the target verifies, where the
  # target's host time and the round trip ran in series: 2.34 ms a step against in-process 1.28), and the
  # drafter's graphs on by default (they replayed there: its host 0.43 ms a Step against 1.06). GPU tests,
  # then tokens/s with proposes ahead against not ahead and chained against step by step, three rounds
  timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "graphs_draft_as_uncaptured or (drafts_left and chained)" 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -12 | log
  timeout 300 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-not-ahead --also-unchained --rounds 3 --json-out "$OUT/split_chain.json" 2>&1 | grep -v INFO | tail -2 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, d[b].get('chain_proposes_sent_ahead'), \
    d[b].get('chain_proposes_taken_ahead'), d[b].get('drafter_chain_graph_steps'), d[b].get('rounds', {}).get('median'), \
    d[b]['drafter_phase_mean_ms']) for b in d if b.startswith('batch_')]" "$OUT/split_chain.json" 2>&1 | log
  ;;
waits)
  # (twenty-first session, not measured yet) the target's stream waits on the device for each chained
  # step's drafts (RemoteProposer(device_waits=True), target serve --device-waits): the drafter's stream
  # writes a done value into the target's DONE buffer after them, where the target's host polled the
  # drafter's event before it queued the verify. Measured there with proposes sent ahead: all 2,265 taken
  # at one stream, yet 0.99x not ahead (services 2.46 ms a step against 1.28 in-process): the host poll kept
  # the round in series. Here the probe and the GPU tests (equal output; a drafter that never writes costs a
  # deadline), first the watchdog against lazy module loading, alone in fresh processes (kernels not loaded
  # yet); tokens/s in `waits-bench`
  echo "probe: a watchdog thread's release while a new kernel loads" | log
  timeout -k 10 60 python tools/stream_wait_probe.py --part 7 2>&1 | tail -4 | log
  timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "never_writes" 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "waited_for" 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  ;;
waits-bench)
  # device waits against host polls and in-process, tokens/s, three rounds side by side (after `waits`)
  timeout 420 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-device-waits --rounds 3 --json-out "$OUT/split_waits.json" 2>&1 | grep -v INFO | tail -2 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, d[b].get('device_waits'), \
    d[b].get('device_waits_released'), d[b].get('rounds', {}).get('median'), \
    d[b]['services_device_waits']['per_step_ms']) for b in d if b.startswith('batch_')]" "$OUT/split_waits.json" 2>&1 | log
  ;;
timeline)
  # (twenty-third session) device waits measured 1.06x / 1.04x over host polls at 1 / 8 streams, but the
  # services still ran 0.57x / 0.55x in-process, a step 2.03 ms against ~1.2, its host waiting 1.9 ms on
  # the drafter. Where does the GPU go? First the device waits' GPU tests (a drafter that never writes
  # costs a deadline; equal output), then both processes' kernels on one clock (bench/timeline.py): GPU
  # busy per side, time-sliced, idle because a host launched late or while the GPU waited
  timeout 240 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "never_writes or waited_for" 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  (cd bench && timeout 140 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --out "$OUT/b1" 2>&1 \
    | grep -v INFO | tail -4 | log)
  (cd bench && timeout 150 python timeline.py --batch 8 --max-tokens 1024 --skip 30 --steps 100 --out "$OUT/b8" 2>&1 \
    | grep -v INFO | tail -4 | log)
  ;;
tail)
  # EngineConfig.chain_capture_remote (on by default since the twenty-fourth session, which measured it at
  # 1.15x / 1.09x the uncaptured tail's tokens/s at 1 / 8 streams): through the services, what follows each
  # chained step's drafts (verify, accept, outcome, next feed) replays as one graph of the target's. The GPU
  # test (equal tokens and acceptance, replays), then tokens/s against uncaptured, three rounds, then the timeline
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "replayed_as_a_graph" 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 300 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-tail-uncaptured --rounds 3 --json-out "$OUT/split_tail.json" 2>&1 | grep -v INFO | tail -2 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, d[b].get('rounds', {}).get('median'), \
    d[b]['services']['per_step_ms']) for b in d if b.startswith('batch_')]" "$OUT/split_tail.json" 2>&1 | log
  (cd bench && timeout 140 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --out "$OUT/b1" \
    2>&1 | grep -v INFO | tail -3 | log)
  ;;
prepare)
  # (twenty-fourth session, not measured yet) the drafter's host work for a chained propose sent ahead done as
  # it arrives, while the target's GPU still verifies (Session.prepare_chain), where it sat between the two
  # GPUs (~0.2 ms of a 1.8-ms services step); and the target's tail graph now on by default. Every GPU test
  # of the services first (both changes are the default for all of them), then tokens/s against a second
  # drafter service with --no-prepare-chains and against the tail uncaptured, three rounds
  timeout 330 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -12 | log
  timeout 250 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-unprepared --also-tail-uncaptured --rounds 3 --json-out "$OUT/split_prepare.json" 2>&1 | grep -v INFO | tail -2 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, d[b].get('rounds', {}).get('median'), \
    d[b]['drafter_chain_graph_steps'], d[b]['drafter_phase_mean_ms'], d[b]['services']['per_step_ms']) \
    for b in d if b.startswith('batch_')]" "$OUT/split_prepare.json" 2>&1 | log
  ;;
drafter-waits)
  # (twenty-fifth session, not measured yet) drafter --device-waits: a prepared chained step's graph launched as
  # its Step arrives, the drafter's stream waiting on the device for the value the target's stream writes after
  # its rows and feed, where its host polled their events (then launched: ~0.13 ms of a 1.79-ms services step,
  # in series). Its GPU tests: equal acceptance with both streams waiting on the device, and a target that never
  # writes its value (a deadline, then that stream ends; the next target is served)
  # (after the twenty-fifth session's Engine._quiesce, also the target's device-wait tests: its host now lets the
  # waits pass before any step but the same chained one again)
  timeout 330 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "drafters_device_waits or never_writes or waited_for" 2>&1 | grep -E "drafter:|Error|assert|FAILED|passed|failed" | tail -12 | log
  ;;
drafter-waits-bench)
  # ... and tokens/s: host polls on both sides (the default), the target's stream waiting (--also-device-waits),
  # both streams waiting (--also-both-waits: a third drafter service, --device-waits --max-targets 1), 3 rounds
  timeout 330 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-device-waits --also-both-waits --rounds 3 --json-out "$OUT/split_both.json" 2>&1 | grep -v INFO | tail -2 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, d[b].get('rounds', {}).get('median'), \
    d[b].get('both_waits_drafter_chain_graph_steps'), d[b].get('both_waits_target_waits_released'), \
    d[b]['services']['per_step_ms'], d[b]['services_both_waits']['per_step_ms']) for b in d if b.startswith('batch_')]" \
    "$OUT/split_both.json" 2>&1 | log
  ;;
eval)
  # (after the twenty-third session) the shipped drafter's held-out tau with its speedup over target-only
  # measured in the same run, as issue 10's "done" asks: float32 at batch 16 (the training's eval, now
  # warmed up with the whole run, so the speedup no longer holds one-time captures), then bf16 at batch 1
  # and 16 (the serving dtype; near-ties may move tau by a few hundredths)
  specsplit eval-acceptance --device cuda --dtype float32 --drafter dflash --max-tokens 128 2>&1 | grep -v INFO | tail -20 | log
  for batch in 1 16; do
    specsplit eval-acceptance --device cuda --dtype bfloat16 --drafter dflash --max-tokens 128 --batch $batch 2>&1 \
      | grep -v INFO | tail -20 | log
  done
  ;;
host-steps)
  # (twenty-ninth session) the engine served the default model's decode at 0.90 ms a step against a replay of 0.82
  # (step_bench --served): with each step launched before the last is read, the host's part of a step outlasts
  # the device's. Where it goes, target only and in-process, one and eight streams, steady state
  timeout 300 python bench/host_profile.py --batch 1 8 --target-only --steps 300 --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -A22 "ms/step" | log
  ;;
pdl-default)
  # (thirtieth session) PDL on by default, heavy projections (8B's) plain: the GPU tests of everything that runs
  # the kernels and graphs, the steps' variants, served tokens/s against without PDL (the drafter's graphs too).
  # Its first call ran the GPU tests with SPECSPLIT_PDL=1 (PDL off by default then; 76 passed) and
  # floor_profile --pdl; its second the same with tests/test_pdl.py alone and split_bench's --also-pdl: the
  # default model's replay 811 -> 679 us with PDL, the 8B shape's 4,464 -> 4,766, and 4,411 with the
  # projections plain; served 1.19x target only
  timeout 260 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_pdl.py tests/test_skinny_linear.py \
    tests/test_step_graphs.py tests/test_dflash_graphs.py tests/test_chain.py tests/test_row_max.py 2>&1 \
    | grep -E "Error|error|assert|FAILED|passed|failed" | tail -12 | log
  for target in default qwen3-8b; do
    timeout 90 python bench/floor_profile.py --target $target --pdl --out "$OUT" 2>&1 | grep -v INFO \
      | grep -E "x  " | log
  done
  timeout 110 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-no-pdl --rounds 3 --json-out "$OUT/split_pdl.json" 2>&1 | grep -v INFO | grep -E "pdl" | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) if isinstance(v, float) else v \
    for k, v in d[b].items() if 'over' in k or 'differing' in k or k == 'rounds'}) for b in d if b.startswith('batch')]" \
    "$OUT/split_pdl.json" 2>&1 | log
  ;;
tables)
  # (thirty-first session) the rotary cos/sin tables in one launch, on by default since the one-launch phase
  # measured the replays: 679.6 -> 666.0 us (SmolLM2), 4,410 -> 4,400 (8B shape). That phase also measured each
  # layer's attention combining its key splits in its own launch (each tile's last split, by an arrival
  # counter): 924 us against 680 and 4,532 against 4,410, served 0.74x at one stream, and its serial loop over
  # the splits summed them in another order than the combine kernel's tree, so tokens differed; removed. The
  # kernels' GPU tests (the tables equal torch's bit for bit, eager and replayed), then served tokens/s with them
  # against torch's seven launches (its requests' tokens compared)
  timeout 120 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fused_kernels.py 2>&1 \
    | grep -E "Error|error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 110 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-tables-apart --rounds 3 --json-out "$OUT/split_tables.json" 2>&1 | grep -v INFO | grep -E "tablesapart" | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) if isinstance(v, float) else v \
    for k, v in d[b].items() if 'over' in k or 'differing' in k}, d[b]['rounds']['median']) for b in d if b.startswith('batch')]" \
    "$OUT/split_tables.json" 2>&1 | log
  ;;
served-trace)
  # (twenty-ninth session) the engine's served decode step took 0.897 ms against a replay of 0.825 (default model)
  # and 4.59 against 4.47 (8B shape): is that the device idle, waiting for the host, or device work outside the
  # graph? The served steps under the profiler, where the device stood idle
  timeout 200 python bench/step_bench.py --target default --batch 1 8 --query 1 --repeats 20 --served 256 \
    --trace-served --out "$OUT" 2>&1 | grep -v INFO | log
  timeout 200 python bench/step_bench.py --target qwen3-8b --batch 1 --query 1 --repeats 20 --served 128 \
    --trace-served --out "$OUT" 2>&1 | grep -v INFO | log
  ;;
tau-sides)
  # (twenty-ninth session, issue 10) chat's held-out tau has stood at 3.02-3.06 over six runs whatever the recipe:
  # is chat short of data like it (a drafter that does better on prompts like those it trained on) or is it the
  # drafter? The shipped drafter on the held-out prompts and on the same draw from the training side, float32
  python -c "from specsplit.train_data import heldout_prompts, write_prompts; import sys; \
    write_prompts(sys.argv[1], heldout_prompts(trained=True))" /tmp/trained_side.jsonl
  for prompts in specsplit/data/heldout_prompts.jsonl /tmp/trained_side.jsonl; do
    echo "prompts: $prompts" | log
    specsplit eval-acceptance --device cuda --dtype float32 --drafter dflash --max-tokens 128 --prompts $prompts 2>&1 \
      | grep -v INFO | tail -24 | log
  done
  ;;
serving)
  # (twenty-sixth session) what a server sees: the 80 held-out prompts through 1, 8 and 16 slots, requests
  # admitted as others end, bf16; eval-acceptance now times the bare drafter (the engine's chained, captured
  # steps), where its recorded run went step by step through the plain verbs (0.73x target-only at 16).
  # Then where a steady eight-stream in-process step's host time goes, and its kernels
  for batch in 1 8 16; do
    specsplit eval-acceptance --device cuda --dtype bfloat16 --drafter dflash --max-tokens 128 --batch $batch 2>&1 \
      | grep -v INFO | grep -E "prompts|^tau |generated|target steps|tokens/s|speculative|outputs" | log
  done
  timeout 150 python bench/host_profile.py --device cuda --batch 8 --steps 60 --out "$OUT" 2>&1 | grep -v INFO | head -50 | log
  timeout 150 python bench/profile_step.py --drafter dflash --batch 8 --steps 40 --out "$OUT" 2>&1 | grep -v INFO | head -24 | log
  ;;
head)
  # (twenty-sixth session) the LM head as one GEMM writing float32 (shared.layers.head_logits; 24 against 39 µs
  # at 128 rows in bench/lm_head_bench.py): its GPU tests, the step graphs', the chain's (greedy equality in
  # float32) and the DFlash graphs'
  timeout 330 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_head_logits.py tests/test_step_graphs.py \
    tests/test_chain.py tests/test_dflash_graphs.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  ;;
head-bench)
  # ... whole steps with each head side by side (target only and in-process DFlash, steady batches of 1, 8, 16),
  # then what a server sees (the held-out prompts through 8 and 16 slots) with the new head
  timeout 300 python bench/head_step_bench.py --batch 1 8 16 --out "$OUT" 2>&1 | grep -v INFO | log
  for batch in 8 16; do
    specsplit eval-acceptance --device cuda --dtype bfloat16 --drafter dflash --max-tokens 128 --batch $batch 2>&1 \
      | grep -v INFO | grep -E "prompts|^tau |tokens/s|speculative|engine:|outputs" | log
  done
  # where a served run's host time goes (admissions, prefills, chained steps) at 8 and 16 slots
  timeout 200 python bench/host_profile.py --device cuda --serving 80 --batch 8 16 --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -A14 "serving" | log
  ;;
overlap)
  # (twenty-sixth session) a step that completes a prompt reads its first token after launching the others'
  # step (EngineConfig.overlap_prefill; the served runs' host profile put ~1 ms a step of host waits on the
  # device at 16 slots, prefills 40 % of the run). The GPU tests of graphed prefill, the chain and the step
  # graphs (equal tokens with admissions, float32), then tokens/s side by side: held-out prompts through 8
  # and 16 slots, overlap on and off, 3 rounds (at one slot no prompt completes while others decode)
  timeout 170 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_graphed_prefill.py tests/test_chain.py \
    tests/test_step_graphs.py tests/test_engine.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  timeout 220 python bench/serving_bench.py --batch 8 16 --rounds 3 --out "$OUT" 2>&1 | grep -v INFO | log
  ;;
sync)
  # what still makes a served run's host wait for the device (torch's sync debug mode), by call site
  timeout 200 python bench/sync_sites.py --requests 80 --batch 8 16 --out "$OUT" 2>&1 | grep -v INFO | head -60 | log
  ;;
floor)
  # (twenty-seventh session) the Qwen3-8B-shaped decode step is 1.37x its floor (goal 1.15x): one replay traced
  # kernel by kernel (a layer's kernels averaged over the 36, the gaps between them, each projection's TB/s),
  # then the same for the default model, then the 8B projections alone: cuBLAS, cuBLASLt, Triton tiles
  timeout 150 python bench/floor_profile.py --target qwen3-8b --batch 1 --query 1 --out "$OUT" 2>&1 | grep -v INFO | log
  timeout 100 python bench/floor_profile.py --target default --batch 1 --query 1 --out "$OUT" 2>&1 | grep -v INFO | log
  timeout 250 python bench/gemm_probe.py --geometry qwen3-8b --rows 1 8 --quick --blas-lt --calls 20 --replays 10 \
    --out "$OUT/gemm_probe_8b.json" 2>&1 | grep -v INFO | log
  ;;
skinny)
  # (twenty-seventh session) kernels/skinny_linear.py where cuBLAS streamed the 8B step's weights at 2-3.6 TB/s
  # (floor phase): its GPU tests and the graphs' that run it, the 8B step and the default model's in three
  # variants (the table sized for the context / like the engine's / with the kernel), the LM heads at both
  # widths, and the 8B projections read cold (qkv and o fit in L2 when one copy is reused)
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_linear.py tests/test_head_logits.py \
    tests/test_step_graphs.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  timeout 150 python bench/floor_profile.py --target qwen3-8b --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -v "^ +[0-9.]+ µs  (void|Memset)" | log
  timeout 100 python bench/floor_profile.py --target default --out "$OUT" 2>&1 | grep -v INFO | grep -E "replay|x  " | log
  for geometry in smollm2 qwen3-8b; do
    timeout 100 python bench/lm_head_bench.py --geometry $geometry --rows 1 8 16 128 --out "$OUT" 2>&1 | grep -v INFO | log
  done
  timeout 150 python bench/gemm_probe.py --geometry qwen3-8b --shapes qkv o down --rows 1 8 --quick --calls 20 \
    --replays 10 --cold-copies 40 --out "$OUT/gemm_probe_8b_cold.json" 2>&1 | grep -v INFO | grep -v skip | log
  ;;
skinny-step)
  # (twenty-seventh session) the skinny phase put the 8B step at 1.16x its floor (4.51 ms, from 4.94 in the
  # table sized for the context and 4.76 sized like the engine's), and K >= 2048 for the kernel (SmolLM2's head
  # lost with it): GPU tests with the graphs that run the layers, the 8B step's variants, then the goal's table
  # (bench/step_bench.py, now with the engine's table). Two variants of the kernel measured here the same
  # session were dropped (SiLU·mul folded in; a one-row kernel without tl.dot): see kernels/skinny_linear.py
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_linear.py tests/test_head_logits.py \
    tests/test_step_graphs.py tests/test_fused_kernels.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  timeout 150 python bench/floor_profile.py --target qwen3-8b --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -v "^ +[0-9.]+ µs  (void|Memset)" | log
  timeout 200 python bench/step_bench.py --target qwen3-8b --batch 1 8 --query 1 16 --repeats 50 --out "$OUT" 2>&1 \
    | grep -v INFO | log
  ;;
fold)
  # (twenty-eighth session) the 8B step was 4.51 ms a replay, 1.16x its floor, with ten launches a layer; four
  # of them (two add+RMSNorms, SiLU·mul, and their gaps) cost ~7.5 µs a layer. Folded into the skinny kernel's
  # loads and stores: GPU tests (the kernel's with the folds, whole layers folded against unfolded, the
  # graphs'), then the 8B step's four variants at one stream, at eight, and in a 16-row verify, then the
  # goal's table
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_linear.py tests/test_head_logits.py \
    tests/test_step_graphs.py tests/test_fused_kernels.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  timeout 150 python bench/floor_profile.py --target qwen3-8b --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -v "^ +[0-9.]+ µs  (void|Memset)" | log
  for bq in "8 1" "1 16"; do
    set -- $bq
    timeout 100 python bench/floor_profile.py --target qwen3-8b --batch $1 --query $2 --out "$OUT" 2>&1 | grep -v INFO \
      | grep -E "replay|x  |a layer" | log
  done
  ;;
fold-more)
  # ... the goal's table with the folds, then which tiles stream qkv, o and down fastest from HBM (the
  # tiles were chosen warm, where qkv and o sit in L2; cold they ran at 3.1-3.5 TB/s against 4.25)
  timeout 150 python bench/step_bench.py --target qwen3-8b --batch 1 8 --query 1 16 --repeats 50 --out "$OUT" 2>&1 \
    | grep -v INFO | log
  timeout 300 python bench/gemm_probe.py --geometry qwen3-8b --shapes qkv o down --rows 1 --tune-cold --calls 20 \
    --replays 10 --cold-copies 40 --out "$OUT/gemm_probe_8b_tune.json" 2>&1 | grep -v INFO | grep -v skip | log
  ;;
fold-small)
  # (twenty-eighth session) the folds took the 8B step from 4.51 to 4.41 ms (1.13x its floor); the default model
  # never takes the kernel (its weights are below the bounds), but its step is launch-bound: 311 kernels in
  # 0.90 ms, ten a layer. Its step with the kernel and every fold for every projection, at one stream, in a
  # 16-row verify and at eight streams; then the 8B step's variants again with SiLU·mul's wider programs
  timeout 150 python bench/floor_profile.py --target default --unbounded --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E -v "^ +[0-9.]+ µs  (void|Memset)" | log
  for bq in "1 16" "8 1"; do
    set -- $bq
    timeout 100 python bench/floor_profile.py --target default --unbounded --batch $1 --query $2 --out "$OUT" 2>&1 \
      | grep -v INFO | grep -E "replay|x  |a layer" | log
  done
  timeout 150 python bench/floor_profile.py --target qwen3-8b --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E "replay|x  |a layer|_skinny" | log
  ;;
fold-default)
  # (twenty-eighth session) the kernel and its folds took the default model's captured step from 0.90 ms to 0.77
  # (fold-small, bench/floor_profile.py --unbounded); decoder layers now take them whatever their widths. The
  # GPU tests of everything that runs those layers (the step graphs, the chain, the DFlash graphs, captured
  # prefill); then (fold-served) served tokens/s with the folds against without, target-only and in-process,
  # at one and eight streams
  fused_layer_tests 330
  ;;
fold-served)
  timeout 330 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-unfolded --json-out "$OUT/split_fold.json" 2>&1 | grep -v INFO | grep -E "unfolded|^\{" | cut -c1-600 | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) if isinstance(v, float) else v \
    for k, v in d[b].items() if 'over' in k or 'differing' in k}) for b in d if b.startswith('batch')]" \
    "$OUT/split_fold.json" 2>&1 | log
  ;;
tiles)
  # (twenty-ninth session) the folds stopped at 16 rows: eight streams' verify (128 rows) and the DFlash
  # drafter's blocks at eight streams kept cuBLAS and ten launches a layer. Row tiles side by side for weights
  # in L2: the default model's step at 8 x 16 and 4 x 16 in variants (folds kept to one tile; row tiles of
  # 16 / 32 / 64 rows), then the goal's table with the engine's own served steps
  for bq in "8 16" "4 16"; do
    set -- $bq
    timeout 120 python bench/floor_profile.py --target default --row-tiles --batch $1 --query $2 --out "$OUT" 2>&1 \
      | grep -v INFO | grep -E "replay|x  |a layer" | log
  done
  timeout 250 python bench/step_bench.py --target default --batch 1 8 --query 1 16 --repeats 50 --served 256 \
    --out "$OUT" 2>&1 | grep -v INFO | log
  ;;
tiles-tests)
  fused_layer_tests 470
  ;;
tiles-served)
  timeout 500 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-unfolded --rounds 3 --json-out "$OUT/split_tiles.json" 2>&1 | grep -v INFO | grep -E "unfolded" | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) if isinstance(v, float) else v \
    for k, v in d[b].items() if 'over' in k or 'differing' in k or k == 'rounds' or 'tok' in k}) for b in d if b.startswith('batch')]" \
    "$OUT/split_tiles.json" 2>&1 | log
  ;;
draft-lengths)
  # (thirty-third session) in-process speculation at eight streams is 1.09x target-only at tau 2.87 (0.38 tau; the
  # goal is 0.6 tau) with 15 drafts a step, a verify of 8 x 16 rows. Tokens/s by draft length at one and eight
  # streams with the tuner beside them, then where the eight-stream step's time goes at k = 3 and 15
  timeout 360 python bench/draft_length.py --device cuda --dtype bfloat16 --batch 1 8 --drafts 3 5 7 15 --auto \
    --max-tokens 256 --json-out "$OUT/draft_length.json" 2>&1 | grep -v INFO | tail -16 | log
  for k in 3 15; do
    timeout 100 python bench/profile_step.py --drafter dflash --batch 8 --num-drafts $k --steps 40 --out "$OUT" 2>&1 \
      | grep -v INFO | head -24 | log
  done
  ;;
waves)
  # (thirty-third session) the eight-stream runs so far were a closed batch of eight that drains: speculative
  # sequences end at different steps (this bench's prompts take 32 to 133 steps for 256 tokens, one stream), so its
  # last steps ran fewer than eight (target-only's all end together). With 32 requests through eight slots the
  # mean batch was still 6.4 (the same tail, simulated from the steps by request: 6.5), and the tuner, timing
  # every chained read, saw 2.0 ms a step for every k where steady steps took 1.2 and chose k = 1 (0.96x). Now
  # 48 requests (--waves 6), the rate while every slot is busy beside the whole run's, the tuner timing steady
  # steps only
  timeout 200 python bench/draft_length.py --device cuda --dtype bfloat16 --batch 8 --waves 6 --drafts 7 15 --auto \
    --max-tokens 256 --json-out "$OUT/draft_length_waves.json" 2>&1 | grep -v INFO | tail -12 | log
  timeout 200 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 8 \
    --waves 6 --json-out "$OUT/split_waves.json" 2>&1 | grep -E "^batch [0-9]+, " | log
  ;;
mps)
  # (thirty-fourth session) two processes' CUDA contexts time-slice one GPU: the two-process skeleton of a step
  # (tools/cross_gpu_probe.py) took 0.90 ms against 0.66 in one process; under an MPS server of our own, 0.64.
  # The services with both streams waiting on the device went from 0.70x to 0.80x in-process at one stream
  # (0.47x to 0.52x at eight), every engine under the server in the second run. Now `specsplit up --mps` starts
  # such a server with the pair (specsplit.mps): its GPU test (the pair under it equals the pair without), then
  # split_bench without and with --mps, both waits beside the default, two rounds each
  timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_mps.py 2>&1 \
    | grep -E "Error|error|assert|FAILED|passed|failed" | tail -8 | log
  for run in nomps mps; do
    flag=$([ $run = mps ] && echo --mps)
    timeout 220 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 \
      --batch 1 8 --waves 4 --rounds 2 --also-both-waits $flag --json-out "$OUT/split_$run.json" 2>&1 \
      | grep -E "^batch [0-9]+|mps|MPS" | sed "s/^/$run: /" | log
  done
  ;;
unanswered)
  # (thirty-fourth session, not run yet) with device waits the target takes the drafts of the chained propose sent
  # ahead before the drafter's answer and reads the answer after its verify launches (RemoteProposer._take_unanswered):
  # until now each services step passed through both hosts in turn (timeline: GPU idle ~1.2 of 2.3 ms, target's
  # host late 0.7, drafter's 0.5). The device-wait GPU tests (accepted drafts equal to host polls'), then tokens/s:
  # the target's waits alone and both sides' beside host polls, three rounds
  device_waits_round 240 330 3 unanswered
  ;;
services-host)
  # (thirty-fourth session, not run yet) both hosts are on a services step's critical path (timeline: each late
  # ~0.5 ms a step); the drafter's phases of a chained Step (one stream, host polls): parse 0.10 ms (since then
  # 1.55x faster on the CPU), the step's preparation 0.17, waiting for the target's writes 0.20, the launch 0.13.
  # The target's side under cProfile (per step, by function), then the drafter's host with Python stacks
  # (thirty-fifth session: host_profile asked for more tokens than the context holds and printed nothing; the
  # drafter's host under the profiler: ~1 graph launch and 3.4 slices a chained Step, 0.21 ms of torch calls).
  # Then both services' work on one clock without MPS, both streams waiting on the device, the answer taken
  # after the verify's launch
  timeout 200 python bench/host_profile.py --batch 1 8 --split --steps 300 --out "$OUT" > "$OUT/host_profile.txt" 2>&1
  grep -v -E "INFO|^I1" "$OUT/host_profile.txt" | grep -E -A24 "ms/step|Error" | log
  (cd bench && timeout 120 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --drafter-device-waits \
    --out "$OUT/b1" 2>&1 | grep -v INFO | tail -14 | log)
  (cd bench && timeout 130 python timeline.py --batch 8 --max-tokens 1024 --skip 30 --steps 100 --drafter-device-waits \
    --out "$OUT/b8" 2>&1 | grep -v INFO | tail -14 | log)
  ;;
both-host)
  # (thirty-fifth session) with both streams waiting on the device and the answer taken after the verify's launch,
  # the services ran 1.13x host polls at one stream (0.68x in-process) but 0.86x at eight; the target's host still
  # spent 0.88 ms of a 1.40 ms step in the drafter's calls. (The timeline above is no guide to the hosts: under
  # CUPTI a graph's launch costs ~1.4 us a node, the drafter's 100-node graph 140 us.) Where both hosts wait: the
  # target under cProfile, the drafter's host with Python stacks (Step messages 300-600: one stream's steady
  # steps), by function
  timeout 240 python bench/host_profile.py --batch 1 8 --split --split-only --both-waits --steps 300 \
    --drafter-trace "$OUT/drafter_both.json" --out "$OUT" > "$OUT/host_profile_both.txt" 2>&1
  grep -v -E "INFO|^I1" "$OUT/host_profile_both.txt" | grep -E -A40 "ms/step|Error" | log
  python bench/trace_functions.py "$OUT/drafter_both.json" --steps 300 --top 45 2>&1 | head -60 | log
  gzip -f "$OUT/drafter_both.json" 2>/dev/null
  ;;
replays)
  # (thirty-fifth session) the target's cProfile put ~0.5-0.7 ms a step under the services' graph replay (in-process
  # ~0.03), host polls or device waits alike; cProfile on Python 3.12 sees every thread, so timed here on this
  # thread alone, unprofiled: in-process against the services, host polls, both waits, and both waits under MPS
  # (is it the launch waiting for the GPU's time slice between the two processes' contexts?)
  timeout 150 python bench/host_profile.py --batch 1 8 --split --time-replays --steps 200 > "$OUT/replays.txt" 2>&1
  timeout 80 python bench/host_profile.py --batch 1 8 --split --split-only --both-waits --time-replays --steps 200 \
    >> "$OUT/replays.txt" 2>&1
  timeout 80 python bench/host_profile.py --batch 1 8 --split --split-only --both-waits --time-replays --steps 200 \
    --mps 2>&1 | sed "s/^/mps: /" >> "$OUT/replays.txt"
  grep -E "ms/step|Error|error:" "$OUT/replays.txt" | log
  ;;
watchdog)
  # (thirty-fifth session) the device waits' watchdog looks at the earliest deadline or every second, no longer
  # woken by every wait (it took the GIL at every step on both hosts): the device-wait GPU tests (a peer that never
  # writes is released at its deadline), then tokens/s, both waits and the target's alone beside host polls
  device_waits_round 150 110 2 watchdog
  ;;
overhang)
  # (after the thirty-fifth session, not run yet) room for three chained steps' rows past each budget, held from
  # admission (Engine._overhang): sequences chain to their last token. The GPU tests that run chained steps to the
  # ends of their requests (in-process and through the services, captured), then tokens/s at one and eight streams
  # with requests ending and arriving, both waits beside host polls (before: services 0.60x / 0.35x in-process)
  timeout 260 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_chain.py tests/test_split_gpu.py 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 300 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --waves 4 --rounds 3 --also-both-waits --json-out "$OUT/split_overhang.json" 2>&1 | grep -E "^batch [0-9]+" | log
  ;;
churn)
  # (after the thirty-fifth session, not run yet) at eight streams split_bench's services ran 3.19 ms a step against
  # in-process 1.20 (0.35x), 0.34x even while every slot was busy; steady steps of eight identical requests measured
  # 1.84 ms host polls, 1.55 both waits (0.68x / 0.81x in-process). So requests ending and arriving cost the
  # services most of a step. Held-out prompts through 8 slots as a server sees them: the target's host by function,
  # the Step answers its host waited for a step, both waits and host polls
  timeout 200 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --time-replays \
    > "$OUT/churn.txt" 2>&1
  timeout 150 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --split-only --both-waits \
    --time-replays >> "$OUT/churn.txt" 2>&1
  grep -v -E "INFO|^I1" "$OUT/churn.txt" | grep -E -A30 "ms/step|Error" | log
  ;;
host-flags)
  # (thirty-eighth session, not run yet) device waits are off by default for one hang: a kernel's first launch
  # while a stream waits loads its module, which waits for the held stream, and the watchdog's release by a
  # stream write never got through (part 7); a plain store into registered host memory did (part 8). Now the
  # target's done values go into a page of host memory both processes map (a sealed memfd passed with the step
  # socket's hello; the drafter never waits on it), released by a store, and the watchdog makes no CUDA call
  # while such a wait is pending. The test of that very hang with the real page and watchdog, then the device
  # waits' GPU tests with the DONE buffer in the page and in device memory (both placements parametrized; the
  # silent drafter also with EngineConfig.unquiesced_host_flags, the engine launching new kernels while its
  # stream waits). If they pass: `host-flags-churn`, then device waits can be measured for the default.
  timeout -k 10 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_host_flags.py 2>&1 \
    | grep -E "launch returned|Error:|assert|FAILED|passed|failed" | tail -8 | log
  timeout 400 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "waited_for or never_writes or device_waits" 2>&1 | grep -E "Error:|assert|FAILED|passed|failed" | tail -10 | log
  ;;
host-flags-bench)
  # (thirty-eighth session) the target's stream waiting on the device, the DONE buffer in the host page (a GPU
  # polling host memory: across the bus) against in its device memory (--no-host-flags), two rounds each
  # (ROUNDS=1 in a call's environment: one each, about half the time, for what is left of a session's budget)
  rounds=${ROUNDS:-2}
  for flags in --host-flags --no-host-flags; do
    timeout $((90 + 90 * rounds)) python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 \
      --batch 1 8 --waves 4 --rounds "$rounds" --also-device-waits $flags --json-out "$OUT/split_flags$flags.json" 2>&1 \
      | grep -E "^batch [0-9]+|host page" | log
  done
  ;;
host-flags-churn)
  # (measured in the thirty-ninth session: 2.397 ms a step as shipped, 2.383 unquiesced, the same within a run's
  # spread; unquiesced_host_flags stays off)
  # (thirty-eighth session; only once `host-flags` passed) with the DONE buffer in the host page a wait outlives a
  # kernel module's load, so the target need not drain its waits before work that may launch a kernel for the
  # first time, nor wait on its host for the drafts of a chained step unlike the one before (Engine._quiesce):
  # EngineConfig.unquiesced_host_flags (off) against as shipped, requests ending and arriving through 8 slots,
  # the target's stream waiting on the device (the drafter's host polling: its waits never use the page)
  for variant in "" --unquiesced; do
    timeout 120 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --split-only --target-waits \
      --time-replays $variant >> "$OUT/host_flags_churn.txt" 2>&1
  done
  grep -v -E "INFO|^I1" "$OUT/host_flags_churn.txt" | grep -E "ms/step|Error" | log
  ;;
regroup)
  # (measured in the thirty-ninth session: the GPU test passed; ms a step without -> with, host polls 2.696 ->
  # 2.405, both waits 2.641 -> 2.468, sampled 3.697 -> 3.427; Step answers waited for 0.22 -> 0.01 a step)
  # (thirty-seventh session) serving through the services at eight streams the target's host waited for 0.22 Step
  # answers a step (0.25 ms a step of 2.83): one at each request's end and one at each arrival, the batch
  # changed so the chained propose sent ahead was not taken. Now it also asks for the sequences attached as
  # it goes and those sitting the step out (a sampled one near its end), and the next step takes its rows for
  # a batch that lost or gained sequences (CPU: 10 waits to 3 in 65 steps; mixed greedy and sampled, 109 to
  # 4). The GPU test (host polls, device waits; the drafts' rows taken on the device), then the churn
  # profile with host polls and both waits, each without (--no-regroup) and with, side by side.
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "ending_and_arriving" \
    2>&1 | grep -E "Error:|assert|FAILED|passed|failed" | tail -8 | log
  for waits in "" --both-waits; do
    for variant in --no-regroup ""; do
      timeout 90 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --split-only $waits \
        --time-replays $variant >> "$OUT/regroup.txt" 2>&1
    done
  done
  for variant in --no-regroup ""; do  # sampled requests (T = 0.8, seeded): their ends sit steps out
    timeout 90 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --split-only \
      --temperature 0.8 --time-replays $variant >> "$OUT/regroup_sampled.txt" 2>&1
  done
  grep -v -E "INFO|^I1" "$OUT/regroup.txt" "$OUT/regroup_sampled.txt" | grep -E "ms/step|Error" | log
  grep -E "_chain_step|_chain_launch" "$OUT/regroup.txt" | log
  ;;
regroup-bench)
  # (thirty-seventh session) tokens/s through the services with requests coming and going, taking the proposes
  # sent ahead for batches that changed against not (--also-no-regroup), beside in-process
  timeout 420 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --waves 4 --rounds 3 --also-no-regroup --json-out "$OUT/split_regroup.json" 2>&1 | grep -E "^batch [0-9]+" | log
  ;;
attach)
  # (thirty-sixth session) serving through the services, each request's arrival cost its host 3.3 ms of
  # unary calls (an AllocState, then its PrefillDrafter), 0.44 ms a step at eight streams; its end 0.9 ms
  # (the free waited for the answer to the chained propose sent ahead). Now the prefill allocates (one
  # round trip) and a free is only queued: measured 2.83 / 2.66 ms a step (host polls / both waits; were
  # 2.94 / 2.74, in-process 1.52), the attach still 2.9 ms (0.38 ms a step), the release 7.5 us a step (was
  # 124). Then (not run yet): the new prefill GPU tests (the copy-out answers before a minute of GPU work
  # queued on the drafter's stream; the rows copied out are the target's as sent, the buffer overwritten at
  # once; requests attached behind the next launch, EngineConfig.overlap_attach, draft as those attached
  # before it), then the churn profile through the services with both waits: as shipped; with the drafter's
  # --prefill-copies (its PrefillDrafter calls waiting only for their rows' copy, not its whole stream); and
  # with --overlap-attach too (the attach after the next step launched, its rows' copy behind the prefill
  # alone), each with the drafter's host seconds of a PrefillDrafter by phase (the "drafter (run):" lines, one per run since the
  # thirty-ninth session: over all three runs, warm-up included, its churn averaged 5.6 ms a call, 5.0 of them
  # the context forward, whose graphs' first uses and captures fall in the warm-up; on the CPU the warm-up's
  # took 55.8 ms a call, the timed run's 7.6). If
  # they win and the tests pass, make them the defaults (overlap_attach with device waits: see its comment).
  # (Since the thirty-seventh session's regroup an arrival costs no Step answer; one attached behind the next
  # launch, --overlap-attach, has the propose sent ahead sent again after its attach, Engine._send_ahead_again.)
  timeout 220 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "prefill or attached_behind" \
    2>&1 | grep -E "Error:|assert|FAILED|passed|failed|xfail" | tail -8 | log
  for variant in "" --prefill-copies "--prefill-copies --overlap-attach"; do
    timeout 120 python bench/host_profile.py --serving 48 --batch 8 --max-tokens 256 --split --split-only --both-waits \
      --time-replays $variant >> "$OUT/attach.txt" 2>&1
  done
  grep -v -E "INFO|^I1" "$OUT/attach.txt" | grep -E "ms/step|^drafter|Error" | log
  grep -E "_attach|_finish_prefill|_chain_step" "$OUT/attach.txt" | log
  ;;
defaults)
  # (forty-first session) the prefill test's drafter warmed before its stream is held (it failed on a kernel's first
  # load, not on the copies), and the pair as `specsplit up` starts it: tokens equal in-process and target-only,
  # the target's stream waiting on the host page by default (passed on the H100: 3 passed, 1 xfailed, 205 s).
  # Then (not run yet) every other GPU test that starts the pair as `specsplit up` does, now on that default:
  # the drafter SIGKILLed mid-stream (the watchdog's release path) and the pair under MPS
  timeout 280 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "prefill_answers_without_waiting or split_equals_in_process" 2>&1 | grep -E "Error:|assert|FAILED|passed|failed|xfail" \
    | tail -12 | log
  timeout 280 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_chaos_gpu.py tests/test_mps.py 2>&1 \
    | grep -E "Error:|assert|FAILED|passed|failed|xfail" | tail -12 | log
  ;;
trees)
  # (forty-second session) draft trees (shared/tree.py): the shipped drafter's held-out walk by tree budget, the
  # static trees' paths calibrated over 3,000 training-side continuations and saved for a captured verify, the
  # first 16 prompts decoded for real with each (outputs and step counts against the walk's); then the in-process
  # engine's eager tree steps (EngineConfig.draft_tree) on all 80 held-out prompts in float32: decoded tau beside
  # the trees' teacher-forced walk, 0 mismatches wanted (the speed is an eager step's, not a served one's). First
  # the paged attention kernel's tree mask against its reference (interpreted on the CPU only so far)
  # and the engine's tree steps replaying a captured tree bucket (`StepGraphs.forward_tree`)
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_attention.py tests/test_tree.py -k tree \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  timeout 280 python -m specsplit.cli eval-acceptance --device cuda --dtype float32 --draft-tree 15 --max-tokens 128 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree.txt" | grep -E "^tau|walk|mismatches|speedup" | log
  ;;
tree-chains)
  # (forty-third session) draft trees chained and captured whole (Engine._chain_tree): the GPU tests of trees and
  # chains, then the shipped drafter's tau by kind and the speedup in one run (bf16, all 80 held-out prompts)
  timeout 260 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree.py tests/test_chain.py \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 300 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree_chains.txt" | grep -E "^tau|walk|mismatches|speedup|engine" | log
  ;;
tree-bench)
  # ... and tokens/s at one and eight streams: trees beside chains and target only, two rounds; first the GPU tests
  # of the one-launch trees (kernels/tree_grow.py) and the chained tree steps that build theirs with it. (Next
  # session: first issue 10's figure at one stream, tau by kind and the speedup in one run)
  timeout 200 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 --batch 1 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree_b1.txt" | grep -E "^tau|walk|mismatches|speedup|engine" | log
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree_grow.py tests/test_tree.py \
    tests/test_row_max.py tests/test_top_k.py -k "grow or chained or triton or top_k" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 560 python bench/split_bench.py --device cuda --batch 1 8 --max-tokens 128 --also-trees 15 --rounds 2 \
    --json-out "$OUT/tree_bench.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
tree-batch)
  # (forty-fourth session) where trees stop paying (EngineConfig.draft_tree_batch): two and four streams kept full,
  # beside chains and target only; then `generate --local` on a GPU with its default --draft-tree auto (trees), and
  # the chained trees' GPU tests with tree buckets captured up to a batch
  timeout 420 python bench/split_bench.py --device cuda --batch 2 4 --waves 4 --max-tokens 128 --also-trees 15 \
    --rounds 2 --json-out "$OUT/tree_batch.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  for tree in auto 0; do
    timeout 60 python -m specsplit.cli generate --local --device cuda --drafter dflash --max-tokens 128 --ignore-eos \
      --prompt "Write a Python function that merges two sorted lists." --draft-tree $tree 2>&1 >/dev/null \
      | grep -E "tokens|Error" | sed "s/^/draft-tree $tree: /" | log
  done
  timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree.py -k "chained or tree_batch" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  ;;
issue10-final)
  # (forty-fourth session) issue 10's last figures: the chained, captured trees in float32 over all 80 held-out
  # prompts at one stream (mismatches against target-only: 0 expected), and the MTP head's tau beside DFlash's
  timeout 300 python -m specsplit.cli eval-acceptance --device cuda --dtype float32 --draft-tree 15 --max-tokens 128 \
    --batch 1 2>&1 | grep -v INFO | tee "$OUT/eval_tree_b1_fp32.txt" \
    | grep -E "^tau|walk|mismatches|speedup|engine" | log
  timeout 200 python -m specsplit.cli eval-acceptance --device cuda --drafter mtp --max-tokens 128 \
    2>&1 | grep -v INFO | tee "$OUT/eval_mtp.txt" | grep -E "^tau|mismatches|speedup" | log
  ;;
services-trees)
  # (forty-fourth session) draft trees through the two services (ChainStep.tree_keep): the GPU tests (candidates in
  # the target's drafts buffer, host polls and device waits), then tokens/s at one, two and four streams beside the
  # services' chains, the in-process trees and target only
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "draft_trees" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 330 python bench/split_bench.py --device cuda --batch 1 2 4 --max-tokens 128 --also-trees 15 --rounds 2 \
    --json-out "$OUT/services_trees.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
wide-trees)
  # (forty-fifth session, not run yet: no device was lent) the GPU tests changed without a device: the services'
  # captured chain test (lengths fixed: its two-sequence phase had 4 steps), `target serve --draft-tree auto` (now
  # trees on a GPU) through the harness, the chained trees' (trees wider than the drafter's rows now chain too)
  timeout 540 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py tests/test_tree.py \
    -k "replayed_as_a_graph or draft_tree or split_equals_in_process or chained" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  ;;
tree-scores)
  # (forty-seventh session, not run yet) trees grown from the shipped drafter's tree scores against its
  # log-probabilities, at one stream (CPU float32 walk, held-out: 4.286 -> 4.393 at 15 nodes): tau and speedup
  for scores in --tree-scores --no-tree-scores; do
    timeout 120 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 --batch 1 \
      $scores 2>&1 | grep -v INFO | tee "$OUT/eval${scores}.txt" | grep -E "^tau|walk|mismatches|speedup" | log
  done
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree.py tests/test_split_gpu.py \
    -k "chained_tree_steps_replay_whole or draft_trees_through_the_drafter_service" 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  ;;
tree-accept)
  # (forty-eighth session) a chained tree step's bookkeeping after its verify in one launch (kernels/tree_accept.py,
  # some forty torch kernels before) and its verify's inputs made by the tree kernel (grow_verify_inputs, seven
  # fewer): their GPU tests and the tree steps' (in-process and through the services), then ms a step beside the
  # torch accept at one and eight streams, and the speedup at one stream
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree_accept.py tests/test_tree_grow.py \
    tests/test_tree.py tests/test_split_gpu.py \
    -k "accept or grows or chained_tree_steps_replay_whole or draft_trees_through_the_drafter_service" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  for batch in 1 8; do
    for accept in kernel torch kernel torch; do
      timeout 60 python bench/profile_step.py --drafter dflash --batch $batch --steps 60 --draft-tree 15 \
        $([ $accept = torch ] && echo --torch-kernels tree_accept) --out "$OUT" 2>&1 | grep -E "^drafter|Error" | log
    done
  done
  timeout 120 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 --batch 1 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree_accept.txt" | grep -E "^tau|mismatches|speedup" | log
  ;;
one-launch)
  # (forty-eighth session) a chained step's small torch ops as one launch each: the verify's inputs
  # (kernels/fed_inputs.py; fifteen kernels a chain step, nineteen a tree step), the drafter's propose and commit
  # inputs (kernels/chain_meta.py; seven and fourteen) and a tree step's k/v moves (kernels/kv_move.py; four):
  # their GPU tests and the chained steps' (in-process and through the services), then ms a step beside the torch
  # ops, chains and trees at one and eight streams (and trees beside all of this session's kernels in torch)
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_fed_inputs.py tests/test_chain_meta.py \
    tests/test_kv_move.py tests/test_chain.py tests/test_tree.py tests/test_split_gpu.py \
    -k "fed or meta or moves or chained_steps_on or chained_tree_steps_replay_whole or replayed_as_the_drafters" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  torch_ops="--torch-kernels fed_inputs chain_meta kv_move"
  for batch in 1 8; do
    for tree in 0 15; do
      variants=("" "$torch_ops" "" "$torch_ops")
      [ $tree = 15 ] && variants+=("$torch_ops tree_accept")
      for kernels in "${variants[@]}"; do
        timeout 30 python bench/profile_step.py --drafter dflash --batch $batch --steps 60 --draft-tree $tree \
          $kernels --out "$OUT" 2>&1 | grep -E "^drafter|Error" | log
      done
    done
  done
  ;;
scored-top-k)
  # (forty-eighth session, not run yet) the tree scores computed in the top-k's launch (kernels/top_k.py, five
  # elementwise kernels fewer a tree step), a chain step's greedy acceptance in one launch (kernels/chain_accept.py,
  # about ten fewer) and kv_move a sequence a program: their GPU tests and the chained steps', ms a chain step beside
  # the torch acceptance, then the end-to-end speedup at one stream with every one-launch kernel of the session,
  # trees and chains (the last measured before them: 2.46x trees on the H200 with only the tree acceptance kernel)
  export SPECSPLIT_CHAIN_ACCEPT_KERNEL=1 SPECSPLIT_TOP_K_SCORES=1  # (both off by default until this had run; on since)
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_top_k.py tests/test_chain_accept.py \
    tests/test_kv_move.py tests/test_chain.py tests/test_tree.py tests/test_split_gpu.py \
    -k "reference_on_cuda or accepts_as or moves_as or chained_steps_on or chained_tree_steps_replay_whole or draft_trees_through" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  for batch in 1 8; do
    for kernels in "" "--torch-kernels chain_accept"; do
      timeout 30 python bench/profile_step.py --drafter dflash --batch $batch --steps 60 $kernels --out "$OUT" 2>&1 \
        | grep -E "^drafter|Error" | log
    done
  done
  for tree in 15 0; do
    timeout 120 python -m specsplit.cli eval-acceptance --device cuda --draft-tree $tree --max-tokens 128 --batch 1 \
      2>&1 | grep -v INFO | tee "$OUT/eval_tree$tree.txt" | grep -E "^tau|mismatches|speedup" | log
  done
  ;;
kernels-bench)
  # (forty-ninth session) with every one-launch kernel on (the last two by their switches): tokens/s at one and eight
  # streams kept full, in-process trees and chains beside target only and the services (host polls, and both
  # streams waiting on the device), one round; the goals' figures (0.8 tau, 0.6 tau, 0.97x in-process)
  timeout 570 python bench/split_bench.py --device cuda --batch 1 8 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --json-out "$OUT/kernels_bench.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
mps-trees)
  # (forty-ninth session) the services with both streams waiting on the device, chains and trees sent ahead, under a
  # private MPS server (one GPU context for both processes: no time-slicing between the target's and the drafter's)
  # and without, one stream and eight kept full: the services over in-process in each
  for mps in --mps ""; do
    timeout 280 python bench/split_bench.py --device cuda --batch 1 8 --waves 4 --max-tokens 128 --also-trees 15 \
      --also-both-waits $mps --json-out "$OUT/bench${mps:-_no_mps}.json" 2>&1 | grep -v INFO \
      | grep -E "^batch|Error|error" | sed "s/^/${mps:-no mps}: /" | log
  done
  ;;
linked-pair)
  # (forty-ninth session) a pair on a GPU now links its streams by default (ServiceSpec.device_waits: the drafter
  # --device-waits --max-targets 1, the target --trees-ahead): the GPU tests that start pairs as `specsplit up`
  # does, the drafter SIGKILLed mid-stream among them, and the pair under MPS
  timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "split_equals_in_process or streams_the_in_process_trees" 2>&1 \
    | grep -E "Error:|assert|FAILED|passed|failed|xfail" | tail -10 | log
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_chaos_gpu.py tests/test_mps.py \
    -k "sigkill_of_either_side or mps" 2>&1 | grep -E "Error:|assert|FAILED|passed|failed|xfail" | tail -10 | log
  ;;
qk-norm-in-rope)
  # (forty-ninth session, not run yet) a fused layer's per-head q and k norms in the rotary kernel's launch
  # (kernels/rope.py QK_NORM_IN_ROPE, off until this has run): its GPU tests (the kernel against its reference,
  # replayed in a graph; the drafter's paged forwards; a Qwen3 target's graph replays; chained tree steps), then
  # side by side, alternating: ms a tree step at one stream (the drafter's 6 layers: 12 launches fewer), the
  # Qwen3-8B-shaped decode step against its floor (72 fewer), and the speedup at one stream
  export SPECSPLIT_QK_NORM_IN_ROPE=1
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_kernels.py tests/test_dflash_graphs.py \
    tests/test_step_graphs.py tests/test_tree.py -k "rope or triton_paged or cuda_graph_replay_equals_eager or chained_tree" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  for round in 1 2; do
    for on in 1 0; do
      SPECSPLIT_QK_NORM_IN_ROPE=$on timeout 60 python bench/profile_step.py --drafter dflash --batch 1 --steps 60 \
        --draft-tree 15 --out "$OUT/qk$on" 2>&1 | grep -E "^drafter|Error" | sed "s/^/qk norm in rope $on: /" | log
      SPECSPLIT_QK_NORM_IN_ROPE=$on timeout 150 python bench/floor_profile.py --target qwen3-8b --batch 1 --query 1 \
        --out "$OUT/qk$on" 2>&1 | grep -v INFO | grep -iE "ms|floor|Error" | head -4 | sed "s/^/qk norm in rope $on: /" | log
    done
  done
  timeout 120 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 --batch 1 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree15.txt" | grep -E "^tau|mismatches|speedup" | log
  ;;
wide-policy)
  # (fiftieth session) Through the services on one GPU, speculation at sixteen and thirty-two streams ran 0.43-0.58x
  # target only (trees-wide-batch): where does it stop paying, and what does a step of no drafts cost while the
  # drafter stays attached? Services linked as `specsplit up` pairs them (trees ahead, both waits), target only and
  # in-process beside them, at 4, 8, 12 and 16 streams; then the same with speculation off from 8 sequences a step
  # (`--drafts-by-batch 8:0`: the rows still committed, the drafter caught up when the batch falls below 8)
  timeout 330 python bench/split_bench.py --device cuda --batch 4 8 12 16 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --json-out "$OUT/wide_policy.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  timeout 200 python bench/split_bench.py --device cuda --batch 8 16 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --drafts-by-batch 8:0 --json-out "$OUT/wide_off.json" 2>&1 | grep -v INFO \
    | grep -E "^batch|Error|error" | log
  ;;
resting)
  # (fiftieth session) sequences rest from the drafter where the schedule drafts nothing (EngineConfig.resume_after,
  # built after wide-policy measured such steps at 0.13-0.38x target only): its GPU tests, then the same
  # split_bench as wide-policy's second (speculation off from 8 sequences a step), then the services beside
  # in-process and target only at 2 and 3 streams (where do they stop paying?)
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_chain.py -k "resting or on_the_gpu_equal" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  timeout 200 python bench/split_bench.py --device cuda --batch 8 16 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --drafts-by-batch 8:0 --json-out "$OUT/resting.json" 2>&1 | grep -v INFO \
    | grep -E "^batch|Error|error" | log
  timeout 170 python bench/split_bench.py --device cuda --batch 2 3 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --json-out "$OUT/narrow.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
pair-bench)
  # (fiftieth session, not run yet; rewritten in the fifty-second, when MPS became `up`'s default) what gRPC clients
  # see: pairs started as `specsplit up` starts them (linked, under MPS), drafting below 0 (always), 4 (the default)
  # and 8 sequences, 1 to 8 concurrent clients streaming held-out prompts, against the same target serving them with
  # speculation off (bench/pair_bench.py). Is 4 still the right default under MPS (0.91x target only at 4 streams,
  # 1.00x at 8, one short round each in the fifty-second session)?
  # (and, with --also-chains, each beside the chains `up` verified before the fifty-second session's fix)
  timeout 560 python bench/pair_bench.py --device cuda --streams 1 2 3 4 6 8 --speculate-below 0 4 8 --requests 3 \
    --max-tokens 160 --rounds 2 --mps --also-chains --json-out "$OUT/pair_bench_mps.json" 2>&1 | grep -v INFO \
    | grep -E "^streams|^pair|Error" | log
  ;;
tree-grow-preload)
  # (fiftieth session; run in the fifty-second: no faster, dropped) the best-first tree kernel with each block's candidates read into registers
  # before its pops (kernels/tree_grow.py PRELOAD_BLOCK, off until this has run; the forty-ninth session's profile
  # had the kernel at 18 us a tree step, its pops' three global reads in series): its GPU tests both ways and the
  # chained tree steps', then side by side, alternating, ms a tree step at one stream and the kernel's own time
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_tree_grow.py tests/test_tree.py \
    -k "cuda or chained_tree" 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  for round in 1 2; do
    for on in 1 0; do
      SPECSPLIT_TREE_GROW_PRELOAD=$on timeout 60 python bench/profile_step.py --drafter dflash --batch 1 --steps 60 \
        --draft-tree 15 --out "$OUT/preload$on" 2>&1 | grep -E "^drafter|Error" | sed "s/^/preload $on: /" | log
      grep -E "_best_first_kernel" "$OUT/preload$on/profile-dflash-b1-tree15.txt" | head -1 | sed "s/^/preload $on: /" | log
    done
  done
  ;;
qkv-rope)
  # (fifty-first session; run in the fifty-second: no faster, dropped, kernels/rope.py's docstring) the q/k/v projection doing the rotation and the KV-cache write on its way
  # out (kernels/qkv_rope.py, ROPE_IN_QKV, off until this has run): one launch a layer fewer, 30 a target-only
  # step and 36 a tree step at one stream (each rope launch ~4 us in last session's profile). Its GPU tests (against
  # the reference; SmolLM2's captured steps with it against without), the engine's lossless GPU tests with it on;
  # then ms a step on and off, alternating, target only and trees of 15 at one and eight streams
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_qkv_rope.py 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | sed "s/^/qkv-rope tests: /" | log
  SPECSPLIT_ROPE_IN_QKV=1 timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_step_graphs.py \
    tests/test_chain.py tests/test_tree.py 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 \
    | sed "s/^/engine tests, on: /" | log
  # (fifty-second session: cut to three pairs, 40 s each, for the call to end within its 600 s)
  for args in "--drafter none --batch 1" "--drafter dflash --batch 1 --draft-tree 15" \
      "--drafter dflash --batch 8 --draft-tree 15"; do
    for on in 1 0; do
      SPECSPLIT_ROPE_IN_QKV=$on timeout 40 python bench/profile_step.py $args --steps 60 --out "$OUT/qkv$on" 2>&1 \
        | grep -E "^drafter|Error" | sed "s/^/qkv-rope $on: /" | log
    done
  done
  ;;
short-round)
  # (fifty-first session: machines scarce, one call; its test runs hit their timeouts, no verdict) the pair under
  # MPS by default: its GPU tests; the attention's splits combined by its last program (FOLD_COMBINE): its GPU
  # tests and ms a step on and off, alternating. The steps ran 1.36-1.51x slower with it: switch and code gone
  # (kernels/paged_attention.py's docstring), this phase kept as the record of what ran
  timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py tests/test_chaos_gpu.py \
    tests/test_mps.py 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | sed "s/^/mps default: /" | log
  SPECSPLIT_ATTENTION_FOLD_COMBINE=1 timeout 100 python -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_paged_attention.py tests/test_step_graphs.py tests/test_dflash_graphs.py -k "fold or graph or eager" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | sed "s/^/fold tests: /" | log
  for args in "--drafter none --batch 1" "--drafter dflash --batch 1 --draft-tree 15" \
      "--drafter dflash --batch 8 --draft-tree 15" "--drafter dflash --batch 1 --draft-tree 15"; do
    for on in 1 0; do
      SPECSPLIT_ATTENTION_FOLD_COMBINE=$on timeout 45 python bench/profile_step.py $args --steps 60 \
        --out "$OUT/fold$on" 2>&1 | grep -E "^drafter|Error" | sed "s/^/fold $on: /" | log
    done
  done
  ;;
mps-default)
  # (fifty-first session; run in the fifty-second, now the default) should `specsplit up` try a private MPS server by default on a CUDA device
  # (`--mps auto`, ServiceSpec.mps None: the services start without it where it cannot)? Here (this machine's copy
  # of the tree only) the default is set to auto, then the pair's GPU tests run under it (the split equals
  # in-process, SIGKILL of either side over CUDA IPC, the pair under MPS equals the pair without); then what gRPC
  # clients see, pairs with and without MPS, target only beside each (bench/pair_bench.py)
  sed -i 's/^    mps: bool | None = False$/    mps: bool | None = None/' specsplit/pair.py
  grep -q '^    mps: bool | None = None$' specsplit/pair.py || { echo "mps-default: the default was not set" | log; exit 1; }
  timeout 270 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py tests/test_chaos_gpu.py \
    tests/test_mps.py 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  for mps in "" --mps; do
    timeout 150 python bench/pair_bench.py --device cuda --streams 1 2 4 8 --speculate-below 4 --requests 2 \
      --max-tokens 128 --rounds 1 $mps --json-out "$OUT/pair_bench${mps:-_no_mps}.json" 2>&1 | grep -v INFO \
      | grep -E "^streams|^pair|Error" | sed "s/^/${mps:-no mps}: /" | log
  done
  ;;
front-end)
  # (fifty-third session; run: clients as processes or threads alike, coalescing no faster, README) pair-bench's target only served gRPC clients 3,500 tok/s at eight streams, where the engine
  # steps 10,000+ (split_bench, in-process): do the bench's client threads bound it, or the target service's?
  # The pair under MPS drafting at every batch size, target only beside it, the clients as threads of the bench,
  # then as processes of their own. (pair-bench's rounds at one and two streams also moved
  # 1,084 -> 1,547 and 396 -> 1,693 tok/s: the longest wait for a chunk and the target's counters say why)
  # (and, where bench/_server_before.py is here, the target's Generate before steps queued behind a stream went
  # out as one chunk: that session's working tree only)
  for variant in "--mps" "--mps --client-processes" "--mps --client-processes before"; do
    if [ "${variant% before}" != "$variant" ]; then
      [ -f bench/_server_before.py ] || continue
      cp target_service/server.py /tmp/server_after.py && cp bench/_server_before.py target_service/server.py
    fi
    timeout 110 python bench/pair_bench.py --device cuda --streams 1 8 --speculate-below 0 --requests 3 \
      --max-tokens 160 --rounds 3 ${variant% before} --json-out "$OUT/front_end${variant// /}.json" 2>&1 \
      | grep -v INFO | grep -E "^streams|Error" | sed "s/^/$variant: /" | log
    [ -f /tmp/server_after.py ] && cp /tmp/server_after.py target_service/server.py && rm /tmp/server_after.py
  done
  ;;
engine-process-short)
  # engine-process in ~200 s of device time (what a session had left after failed starts): one round
  timeout 200 python bench/pair_bench.py --device cuda --streams 1 8 --speculate-below 0 --requests 2 \
    --max-tokens 128 --rounds 1 --mps --client-processes --engine-process both \
    --json-out "$OUT/engine_process.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  ;;
engine-process)
  # (fifty-fourth session) the served target ran ~2 ms a step at 1 stream and ~1.8 ms at 8 against 0.76-0.8 in
  # process: its front end's threads share the engine's GIL. The engine in a process of its own
  # (target serve --engine-process), each way beside its own target only, under MPS as `up` starts them
  timeout 270 python bench/pair_bench.py --device cuda --streams 1 8 --speculate-below 0 --requests 3 \
    --max-tokens 160 --rounds 2 --mps --client-processes --engine-process both \
    --json-out "$OUT/engine_process.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  # the stand-in engine (host-bound: 0.05 ms slept, 0.7 ms of GIL a step) on this host's CPUs, both ways
  timeout 80 python bench/front_end_bench.py --sleep-ms 0.05 --hold-ms 0.7 --streams 1 8 16 \
    --json-out "$OUT/front_end.json" 2>&1 | grep -v INFO | log
  ;;
served-pair)
  # (fifty-fifth session) with the target's engine in its own process (now the default on a GPU): (a) where a served
  # pair's step goes at one stream (1.3 ms against 1.0 in-process for a tree step): both processes' GPU work on one
  # clock, trees of 15 linked as `up` pairs them, under MPS; (b) does drafting still stop paying at four streams
  # (`up`'s --speculate-below 4 was chosen with the engine in the front end's process)? Pairs drafting always and
  # below 4, each beside its own target only, the target's host ms a step by phase
  # (first run: the bench's client processes started on demand halved the first pair's clients; the drafter's
  # window outlasted the run) the target's host by function (cProfile) and the drafter's by stack, one stream
  timeout 150 python bench/host_profile.py --device cuda --batch 1 --split --both-waits --draft-tree 15 \
    --mps --steps 300 --drafter-trace "$OUT/drafter_host.json" --out "$OUT" 2>&1 | grep -v INFO | head -60 | log
  (cd bench && timeout 150 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --draft-tree 15 \
    --drafter-device-waits --mps --out "$OUT/b1_trees" 2>&1 | grep -v INFO | tail -16 | log)
  rm -f "$OUT"/b1_trees/*.txt "$OUT/drafter_host.json"  # (at most 8 files come back)
  timeout 260 python bench/pair_bench.py --device cuda --streams 1 4 8 --speculate-below 0 4 --requests 3 \
    --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on \
    --json-out "$OUT/served_pair.json" 2>&1 | grep -v INFO | grep -E "^streams|^pair|Error" | log
  ;;
served-pair-tests)
  # ... the pair's GPU tests with the engine in its own process by default: SIGKILL of either side over CUDA IPC,
  # the pair under MPS equals the pair without; then the eight-stream timeline
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_chaos_gpu.py tests/test_mps.py 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  (cd bench && timeout 170 python timeline.py --batch 8 --max-tokens 512 --skip 30 --steps 100 --draft-tree 15 \
    --drafter-device-waits --mps --out "$OUT/b8_trees" 2>&1 | grep -v INFO | tail -16 | log)
  ;;
round59)
  # (fifty-ninth session) a request's attach rides the Step stream (EngineConfig.stream_attach, off until this
  # passes; DrafterDescription.step_attach) instead of a PrefillDrafter call after the answer to the Step sent ahead
  # (~2.7 ms of host an arrival): its GPU tests first (its first run referenced rows before their generation was
  # recorded: fixed since), then serving through 8 slots each way, in process beside them. If they pass and it
  # wins, make it the default (EngineConfig.stream_attach; tests/test_metrics.py then counts step_attaches)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "on_the_stream or arriving" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/tests: /" | log
  serving_variants stream-attach services in-process stream-attach
  ;;
round61)
  # (sixty-first session) round60b reordered: on a fresh machine the first serving run pays the drafter's start (the
  # sixtieth session's regroup run timed out behind it), so the services without regrouping go first, then with and
  # without alternating; the GPU tests of trees sent ahead (regrouping required); the attach on the stream last
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  serving_variants services tree-regroup services tree-regroup
  [ "$(left)" -gt 130 ] && timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "draft_trees_through and sent-ahead" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/tests: /" | log
  serving_variants stream-attach-regroup
  ;;
round62)
  # (sixty-second session, next) with trees regrouped (on since that session) the attach on the Step stream ran one
  # serving run at 2.037 ms a step against 2.234 / 2.332 without; before regrouping it gained nothing (sixtieth).
  # Alternating, twice each; then the served pair: PAIR_ARGS=--stream-attach bash tools/gpu_round.sh round61b
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  serving_variants tree-regroup stream-attach-regroup tree-regroup stream-attach-regroup
  ;;
round64)
  # (sixty-third session, next) round62 again with the median of seven timed runs a variant (one run of the services
  # spread 2.4-3.4 ms a step there): regrouped as is, with the attach on the Step stream, and as is with one intra-op
  # thread a process (do the processes' torch thread pools, 16 each, crowd the hosts?); in process last, for the ratio
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  serving_variants services stream-attach-regroup omp1-services services stream-attach-regroup omp1-services in-process
  ;;
round63b)
  # (sixty-third session) the served pair at eight streams with the attach on the Step stream and without, one
  # pair_bench each (each pair beside its own target only): the pair's clients send a stream's next request when
  # its last ends, so arrivals (each a PrefillDrafter round trip without it, ~2.7 ms of the target's host) come
  # about every six steps there (seven rounds: a round at eight streams is about half a second)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  for pair_args in --stream-attach "" --stream-attach; do
    [ "$(left)" -gt 120 ] || break
    timeout $(( $(left) > 270 ? 250 : $(left) - 20 )) python bench/pair_bench.py --device cuda --streams 8 \
      --speculate-below 9 --requests 4 --max-tokens 160 --rounds 7 --mps --client-processes --engine-process on \
      --target-args="$pair_args" --json-out "$OUT/pair63${pair_args:+_attach}.json" 2>&1 | grep -v INFO \
      | grep -E "^streams|Error" | sed "s/^/${pair_args:-as is}: /" | log
  done
  ;;
tree-schedule)
  # (sixty-second session, next) in process through 8 slots trees of 7 served 1.09-1.19x trees of 15 (14,317-14,401
  # against 12,057-13,086 tok/s), where at 1 and 4 slots 15 served more (2,880 against 2,613; 7,900 against
  # 7,430-7,612). Trees of 15 lowered to 7 from 6 sequences a step (--trees-by-batch 6:7) beside 15 and 7, in
  # process, then through the services (regrouped), alternating
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  for flags in "--draft-tree 15" "--draft-tree 15 --trees-by-batch 6:7" "--draft-tree 7" "--draft-tree 15" \
      "--draft-tree 15 --trees-by-batch 6:7" "--split --split-only --both-waits --mps --draft-tree 15" \
      "--split --split-only --both-waits --mps --draft-tree 15 --trees-by-batch 6:7"; do
    [ "$(left)" -gt 80 ] || break
    timeout 75 python bench/host_profile.py --device cuda --batch 8 --serving 24 --max-tokens 128 --timed-runs 7 \
      $flags 2>&1 | grep -E "^(in-process|services).*serving|Error" | sed "s/^/$flags: /" | log
  done
  ;;
lanes)
  # (sixty-second session) at 8 slots an in-process tree step is the device's (1.48 ms against target only's 0.73),
  # its kernels latency-bound, one after another: do two or four engines ("lanes", each on a stream of its own,
  # the host stepping them in turn) serve the same 8 slots faster? Target only and trees of 15, then chains.
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  timeout $(( $(left) > 300 ? 280 : $(left) - 20 )) python bench/lanes_probe.py --device cuda --slots 8 --lanes 1 2 4 \
    --serving 24 --max-tokens 128 --draft-tree 15 --rounds 3 --json-out "$OUT/lanes.json" 2>&1 | grep -v INFO | log
  [ "$(left)" -gt 150 ] && timeout $(( $(left) - 20 )) python bench/lanes_probe.py --device cuda --slots 8 \
    --lanes 1 2 --serving 24 --max-tokens 128 --draft-tree 0 --rounds 3 --no-target-only \
    --json-out "$OUT/lanes_chains.json" 2>&1 | grep -v INFO | sed "s/^/chains: /" | log
  ;;
tree-sizes)
  # (sixty-first session, next) which tree size serves 8 slots fastest in process: the step is the device's there
  # (1.48 ms against target only's 0.73, trees of 15); host_profile's timed line now gives tok/s and tokens a step
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  for nodes in 15 7 31 3 15 7; do
    [ "$(left)" -gt 70 ] || break
    timeout 75 python bench/host_profile.py --device cuda --batch 8 --serving 24 --max-tokens 128 \
      --draft-tree $nodes 2>&1 | grep -E "^(in-process|target-only) serving|Error" | sed "s/^/trees of $nodes: /" | log
  done
  ;;
round61b)
  # (sixty-first session) the served pair at 1 and 8 streams (round58b), its targets given $PAIR_ARGS (e.g.
  # --tree-regroup, as round61 decides)
  # (--target-args=...: a value that starts with "--" must be joined to its option)
  ROUND_SECONDS=${ROUND_SECONDS:-570} timeout 420 python bench/pair_bench.py --device cuda --streams 1 8 \
    --speculate-below 9 --requests 3 --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on \
    --target-args="${PAIR_ARGS:-}" --json-out "$OUT/pair61.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  ;;
round60b)
  # (sixtieth session) round60 found the services' 8-slot tree steps waiting ~1.3-2 ms at each batch change (0.24
  # a step): a tree's candidates sent ahead served only the same batch. With EngineConfig.tree_regroup (off until
  # this passes and wins) a batch that lost or gained sequences takes their rows (as chains did): serving with
  # and without it, the GPU tests of trees sent ahead, then with the attach on the stream too (it may win now)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  serving_variants tree-regroup services
  timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "draft_trees_through and sent-ahead" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/tests: /" | log
  serving_variants stream-attach-regroup tree-regroup
  ;;
round60)
  # (sixtieth session) round59's GPU tests and serving (the attach riding the Step stream, then without), then where
  # the host's time goes in a serving step, unprofiled (--clock), in process and through the services attaching on
  # the stream: the in-process chained step is ~1.6 ms of host at eight sequences, the device's ~0.8
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  timeout 180 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "on_the_stream or arriving" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/tests: /" | log
  serving_variants stream-attach-clock services in-process-clock  # (the first: its timed run is stream-attach's)
  ;;
round58)
  # (fifty-eighth session) chained-step shapes are captured after 2 uncaptured runs (EngineConfig.chain_capture_after,
  # was 8): the GPU tests of captured chained steps first; then 24 held-out prompts through 8 slots (trees of 15), in
  # process and through the services, each run's captures beside its ms a step (host_profile prints both, and the
  # drafter's chained steps by outcome: its own captures come after 8 runs, or 2 as `drafter-after-2` asks)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_chain.py tests/test_split_gpu.py \
    -k "capture or chained_steps_equal or riders" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/tests: /" | log
  serving_variants in-process services drafter-after-2
  ;;
round58c)
  # (fifty-eighth session) round58's serving through 8 slots, the other ways: the services unquiesced (no host wait for
  # the drafts at a batch change: serving has one every ~3 steps), and with the target's host polling for the drafts
  # instead of its stream waiting on the device, and without MPS, and in process under MPS (are the replays' ~0.9 ms
  # the device waits', or MPS's?)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  serving_variants services host-polls no-mps in-process-mps unquiesced
  ;;
pair-ab)
  # (fifty-eighth session) the served pair at one stream ran 1.35x target only on this session's machine, 1.74x on the
  # fifty-fifth session's: the machine, or a regression? This checkout beside an earlier commit's tree
  # (`bash tools/old_tree.sh COMMIT`, carried as .old-tree.tar.gz beside the checkpoints and .whl), alternating on one
  # machine, each pair beside its own target only; each tree installed (editable) in turn, this one again at the end
  [ -f .old-tree.tar.gz ] || { echo "pair-ab: no .old-tree.tar.gz here (bash tools/old_tree.sh COMMIT)" | log; exit 1; }
  rm -rf /tmp/ab && mkdir -p /tmp/ab && tar xzf .old-tree.tar.gz -C /tmp/ab
  ln -s "$PWD/drafter_service/checkpoints" /tmp/ab/old/drafter_service/checkpoints
  here=$PWD
  for side in new old new old; do
    tree=$here; [ "$side" = old ] && tree=/tmp/ab/old
    (cd "$tree" && python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-ab.log 2>&1) \
      || { tail -3 /tmp/pip-ab.log | sed "s/^/$side: /" | log; break; }
    (cd "$tree" && timeout 130 python bench/pair_bench.py --device cuda --streams 1 --speculate-below 9 --requests 3 \
      --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on --json-out "$OUT/ab-$side.json" 2>&1 \
      | grep -v INFO | grep -E "^streams|Error" | sed "s/^/$side: /" | log)
  done
  (cd "$here" && python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1)
  ;;
round58b)
  # (fifty-eighth session) round57b's served pair with chained shapes captured after 2 runs: tokens/s, tau, step shape
  ROUND_SECONDS=${ROUND_SECONDS:-570} timeout 400 python bench/pair_bench.py --device cuda --streams 1 8 \
    --speculate-below 9 --requests 3 --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on \
    --json-out "$OUT/pair58.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  ;;
round57)
  # (fifty-seventh session) round56's test run got no verdict within its 230 s (too many selected): the GPU tests of
  # the tree candidates copied straight into the engine's graph inputs (the services' trees) first, then those of
  # the device waits and host pages and test_split_gpu.py's five not reached, each run with a verdict of its own
  timeout 250 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py -k "tree" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/trees: /" | log
  timeout 280 python -m pytest -q -m gpu -p no:cacheprovider tests/test_host_flags.py tests/test_split_gpu.py \
    -k "host_flags or prefill or attached_behind or never_land or waited_for" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/waits: /" | log
  ;;
round57b)
  # (fifty-seventh session, after round57) the target-only step with embeddings by indexing (on since the fifty-sixth
  # session; its tree steps were measured, target only not: the machine went), off and on alternating; then the pair
  # as `up` starts it with each request's wait for its first chunk (waits-pruned-tests' second half) and, since the
  # fifty-seventh session, the shape of the target's steps: sequences a step (eight streams' served pair ran 1.10x
  # target only at tau 3.25 where host_profile's steps would give ~2x: a batch not full?) and wall ms a step
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  for v in 0 1 0 1; do
    [ "$(left)" -gt 250 ] || break
    SPECSPLIT_EMBED_BY_INDEXING=$v timeout 45 python bench/profile_step.py --drafter none --batch 1 --steps 60 \
      --out /tmp/steps 2>&1 | grep -E "^drafter|Error" | sed "s/^/by indexing $v: /" | log
  done
  timeout $(( $(left) - 5 )) python bench/pair_bench.py --device cuda --streams 1 8 --speculate-below 9 --requests 3 \
    --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on \
    --json-out "$OUT/pair_first_chunks.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  ;;
round56)
  # (fifty-sixth session: machines scarce, one call planned) the GPU tests of what changed without a device (the tree
  # candidates copied from the drafts buffer straight into the engine's graph inputs; the device waits forgotten
  # before the next is queued) and test_split_gpu.py's five not reached; then waits-pruned's services' ms a step
  # with the fix and without, alternating, each run within what is left of the call's 570 s
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  tests=$(( $(left) / 2 )); [ "$tests" -lt 230 ] || tests=230  # (ROUND_SECONDS: a shorter call, where less is left)
  timeout $tests python -m pytest -q -m gpu -p no:cacheprovider tests/test_host_flags.py tests/test_split_gpu.py \
    -k "host_flags or tree or prefill or attached_behind or never_land or waited_for" --durations=3 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -10 | log
  for variant in after before after2 before2; do
    [ "$(left)" -gt 100 ] || { echo "$variant: no time left" | log; break; }
    if [ "${variant%2}" = before ]; then
      [ -f bench/_device_waits_before.py ] || continue
      cp shared/device_waits.py /tmp/device_waits_after.py && cp bench/_device_waits_before.py shared/device_waits.py
    fi
    keep="--out /tmp/$variant"; [ "${variant%2}" = "$variant" ] && keep="--out $OUT/$variant"
    timeout $(( $(left) - 5 )) python bench/host_profile.py --device cuda --batch 1 8 --split --split-only \
      --both-waits --draft-tree 15 --mps --steps 300 --clock $keep 2>&1 | grep -E "ms/step unprofiled|^clocked" \
      | sed "s/^/$variant: /" | log
    [ -f /tmp/device_waits_after.py ] && cp /tmp/device_waits_after.py shared/device_waits.py && rm /tmp/device_waits_after.py
  done
  ;;
waits-pruned)
  # (fifty-fifth session, not run yet) the target's device waits on the DONE host page: the waits seen done are now
  # forgotten as the next is armed (they piled up a step at a time, and past their deadlines the watchdog read the
  # page for each every 10 ms: ~80 reads a step in the target's host profile). The services' ms a step at one and
  # eight streams (host_profile, unprofiled, trees linked as `up` pairs them, MPS), with the fix and, where
  # bench/_device_waits_before.py is here (`git show 385484c~1:shared/device_waits.py > bench/_device_waits_before.py`
  # before the call), without it, alternating; then both services' work on one clock at one stream
  # (each side's first run keeps its whole table: the target's host by function under cProfile, no drafter
  # profiled, and by phase and drafter verb unprofiled, host_profile --clock)
  for variant in after before after2 before2; do
    if [ "${variant%2}" = before ]; then
      [ -f bench/_device_waits_before.py ] || continue
      cp shared/device_waits.py /tmp/device_waits_after.py && cp bench/_device_waits_before.py shared/device_waits.py
    fi
    keep="--out /tmp/$variant"; [ "${variant%2}" = "$variant" ] && keep="--out $OUT/$variant"
    timeout 130 python bench/host_profile.py --device cuda --batch 1 8 --split --split-only --both-waits \
      --draft-tree 15 --mps --steps 300 --clock $keep 2>&1 | grep -E "ms/step unprofiled|^clocked" \
      | sed "s/^/$variant: /" | log
    [ -f /tmp/device_waits_after.py ] && cp /tmp/device_waits_after.py shared/device_waits.py && rm /tmp/device_waits_after.py
  done
  (cd bench && timeout 150 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --draft-tree 15 \
    --drafter-device-waits --mps --out "$OUT/b1" 2>&1 | grep -v INFO | tail -6 | log)
  rm -f "$OUT"/b1/*.txt  # (at most 8 files come back: the three traces, timeline.json, round.log)
  ;;
waits-pruned-tests)
  # ... the GPU tests of device waits and host pages, and the five of test_split_gpu.py the fifty-fifth session's
  # time did not reach (27 of its 32 passed with the engine in its own process by default)
  timeout 280 python -m pytest -q -m gpu -p no:cacheprovider tests/test_host_flags.py tests/test_split_gpu.py \
    -k "host_flags or prefill or attached_behind or never_land or waited_for" --durations=4 2>&1 \
    | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -10 | log
  # the pair as `up` now starts it (drafting up to eight sequences a step), with each request's wait for its first
  # chunk: at one stream the served pair's steps averaged 1.26 ms (tokens/s over tau) against host_profile's 1.168,
  # about 4 ms a request beyond its steps, where target only's averaged its steady 0.74
  timeout 170 python bench/pair_bench.py --device cuda --streams 1 8 --speculate-below 9 --requests 3 \
    --max-tokens 160 --rounds 2 --mps --client-processes --engine-process on \
    --json-out "$OUT/pair_first_chunks.json" 2>&1 | grep -v INFO | grep -E "^streams|Error" | log
  ;;
embed-indexing)
  # (fifty-fifth session, not run yet) shared.layers.EMBED_BY_INDEXING (SPECSPLIT_EMBED_BY_INDEXING=1, off): the
  # target's and the drafter's graph-captured embeddings by weight[ids] instead of F.embedding, whose small-index
  # kernel took 8-10 µs for 16 ids (twice a tree step at one stream). Its GPU tests (the graphs against eager, the
  # chained trees), then steps on and off alternating; on by default only if it wins
  # (fifty-sixth session: each step run within what is left of the call's 570 s, trees first)
  started=$(date +%s); left() { echo $((${ROUND_SECONDS:-570} - $(date +%s) + started)); }
  SPECSPLIT_EMBED_BY_INDEXING=1 timeout 220 python -m pytest -q -m gpu -p no:cacheprovider tests/test_step_graphs.py \
    tests/test_dflash_graphs.py tests/test_chain.py 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -6 | log
  for v in 0 1 0 1; do
    for args in "--drafter dflash --batch 1 --draft-tree 15" "--drafter dflash --batch 8 --draft-tree 15" \
        "--drafter none --batch 1"; do
      [ "$(left)" -gt 45 ] || break 2
      SPECSPLIT_EMBED_BY_INDEXING=$v timeout 45 python bench/profile_step.py $args --steps 60 --out /tmp/steps 2>&1 \
        | grep -E "^drafter|Error" | sed "s/^/by indexing $v: /" | log
    done
  done
  ;;
pair-step)
  # (fifty-third session) the pair as `up` starts it took ~2 ms a step at one stream (front-end: 402 steps for 1,212
  # tokens at 1.0-1.1x target only's 0.76 ms a step, with MPS or without), where split_bench's services (the target
  # engine in the bench's own process, the drafter a service; trees ahead, both waits, MPS) took ~1.2 in the
  # forty-ninth session: where does the served target's step go? pair_bench now prints the target's host ms a step
  # by phase (propose, verify, control); split_bench's services beside it in the same call
  timeout 150 python bench/pair_bench.py --device cuda --streams 1 2 --speculate-below 0 --requests 3 \
    --max-tokens 160 --rounds 3 --mps --client-processes --json-out "$OUT/pair_step.json" 2>&1 | grep -v INFO \
    | grep -E "^streams|Error" | log
  timeout 280 python bench/split_bench.py --device cuda --batch 1 --waves 4 --max-tokens 128 --also-trees 15 \
    --also-both-waits --mps --json-out "$OUT/split_one_stream.json" 2>&1 | grep -v INFO | grep -E "^batch|Error" | log
  # the front end alone on this host's CPUs (a stand-in engine: 0.4 ms slept, 0.3 ms of GIL a step)
  timeout 90 python bench/front_end_bench.py 2>&1 | grep -v INFO | log
  ;;
h200-goals)
  # (fifty-third session) the issue's goals on the H200 it names (every figure since the thirty-third session is an
  # H100's): ms a step and kernels, target only and trees of 15 at one and eight streams; the 80 held-out prompts at
  # one stream, trees of 15 (tau, speedup over target only in the same run: 0.8 tau); the Qwen3-8B-shaped decode
  # step against its floor (1.15x). The services against in-process (0.97x) and eight streams (0.6 tau): mps-trees
  for args in "--drafter none --batch 1" "--drafter dflash --batch 1 --draft-tree 15" "--drafter none --batch 8" \
      "--drafter dflash --batch 8 --draft-tree 15"; do
    timeout 40 python bench/profile_step.py $args --steps 60 --out "$OUT/steps" 2>&1 | grep -E "^drafter|Error" | log
  done
  timeout 150 python -m specsplit.cli eval-acceptance --device cuda --draft-tree 15 --max-tokens 128 --batch 1 \
    2>&1 | grep -v INFO | tee "$OUT/eval_tree15.txt" | grep -E "^tau|mismatches|speedup|tok/s" | log
  timeout 120 python bench/floor_profile.py --target qwen3-8b --batch 1 --query 1 --out "$OUT/floor" 2>&1 \
    | grep -v INFO | grep -iE "ms|floor|Error" | head -6 | log
  ;;
mps-default-tests)
  # (fifty-second session) mps-default's test run gave no verdict within 270 s: the same files with MPS tried by
  # default, each within its own time, and which tests took longest
  sed -i 's/^    mps: bool | None = False$/    mps: bool | None = None/' specsplit/pair.py
  grep -q '^    mps: bool | None = None$' specsplit/pair.py || { echo "mps-default: the default was not set" | log; exit 1; }
  # (test_mps.py 43 s and test_chaos_gpu.py 69 s passed; test_split_gpu.py passed 21 of 32 in 320 s: next, it alone)
  for spec in "test_split_gpu.py 560"; do
    set -- $spec
    timeout "$2" python -m pytest -q -m gpu -p no:cacheprovider --durations=3 "tests/$1" 2>&1 \
      | grep -E "Error|assert|FAILED|passed|failed|^[0-9.]+s call" | tail -8 | sed "s/^/$1: /" | log
  done
  ;;
trees-wide-batch)
  # (forty-ninth session, not run yet) `target serve --draft-tree-batch` is 8 now (trees beat chains at eight
  # streams, 1.20-1.33x): do they at sixteen and thirty-two? In-process and through the services, trees of 15
  # beside chains and target only, two rounds (the benches' engines bound no tree batch)
  timeout 560 python bench/split_bench.py --device cuda --batch 16 32 --waves 4 --max-tokens 128 --also-trees 15 \
    --rounds 2 --json-out "$OUT/trees_wide_batch.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
wide-trees-eval)
  # ... trees of 63 and 31 nodes from the drafter's 15 rows (the CPU decode of all 80 held-out prompts, float32: tau
  # 4.66 at 31 against 4.29 at 15; the teacher-forced walk 5.00 at 63): tau and the speedup at one stream beside 15
  for tree in 63 31 15; do
    timeout 120 python -m specsplit.cli eval-acceptance --device cuda --draft-tree $tree --max-tokens 128 --batch 1 \
      2>&1 | grep -v INFO | tee "$OUT/eval_tree$tree.txt" | grep -E "^tau|walk|mismatches|speedup|engine" | log
  done
  ;;
wide-trees-profile)
  # ... a step's kernels at one stream, trees of 31 beside 15
  for tree in 31 15; do
    timeout 100 python bench/profile_step.py --drafter dflash --batch 1 --steps 30 --draft-tree $tree \
      --out "$OUT" 2>&1 | grep -v INFO | head -12 | log
  done
  ;;
trees-ahead)
  # (forty-sixth session, not run yet) a tree step's next candidates asked for as it launches (`--trees-ahead`):
  # its GPU tests (host polls and device waits), then tokens/s beside the services' trees not sent ahead
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_split_gpu.py \
    -k "draft_trees_through_the_drafter_service" 2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 380 python bench/split_bench.py --device cuda --batch 1 2 4 --max-tokens 128 --also-trees 15 \
    --also-trees-ahead --rounds 2 --json-out "$OUT/trees_ahead.json" 2>&1 | grep -v INFO \
    | grep -E "^batch|Error|error" | log
  ;;
wide-trees-bench)
  # ... tokens/s at one, two and four streams: in-process and services' trees of 31 beside chains and target only,
  # and in-process trees of 15 beside those of 31 (which trees_by_batch to make the default)
  timeout 560 python bench/split_bench.py --device cuda --batch 1 2 4 --max-tokens 128 --also-trees 31 15 --rounds 2 \
    --json-out "$OUT/wide_trees.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
tree-waves)
  # ... eight streams kept full (32 requests through 8 slots): batch 8's steady state, its shapes captured early
  timeout 560 python bench/split_bench.py --device cuda --batch 8 --waves 4 --max-tokens 128 --also-trees 15 \
    --rounds 2 --json-out "$OUT/tree_waves.json" 2>&1 | grep -v INFO | grep -E "^batch|Error|error" | log
  ;;
tree-profile)
  # (forty-third session) where a chained tree step's time goes beside a chain step's: a 16-sequence tree step took
  # 4.4 ms in eval-acceptance; kernels by GPU time at one and sixteen streams
  for batch in 1 16; do
    for tree in 0 15; do
      timeout 120 python bench/profile_step.py --drafter dflash --batch $batch --steps 30 --draft-tree $tree \
        --out "$OUT" 2>&1 | grep -v INFO | head -22 | log
    done
  done
  ;;
tree-topk)
  # (forty-third session) the candidates' top-k in one launch (kernels/top_k.py): its GPU tests and the chained trees',
  # then a tree step's profile at one and sixteen streams (were 1.258 and 2.191 ms with log_softmax + topk)
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_top_k.py tests/test_tree.py \
    -k "top_k or chained" \
    2>&1 | grep -E "Error|assert|FAILED|passed|failed" | tail -8 | log
  for batch in 1 16; do
    timeout 100 python bench/profile_step.py --drafter dflash --batch $batch --steps 30 --draft-tree 15 \
      --out "$OUT" 2>&1 | grep -v INFO | head -1 | log
  done
  ;;
trees-walk)
  # (forty-third session) the second half of `trees`: the walk by budget, static trees calibrated at scale
  timeout 400 python bench/tree_tau.py --device cuda --gen-batch 128 --budgets 15 23 31 63 --calibrate 3000 \
    --save-paths "$OUT/tree_paths.json" --decode 16 2>&1 | grep -v INFO | tee "$OUT/tree_tau.txt" | tail -16 | log
  ;;
predecessor)
  # (forty-first session, not run yet) issue 10: would drafts gain from seeing the draft before them, through a
  # shallow correction on the frozen drafter's rows (bench/predecessor_head.py)? On the CPU (473 training
  # sequences, 29,095 anchors) it memorized: its walk tau given the true tokens 3.79 against 3.31 plain on
  # sequences it trained on, 3.10 against 3.27 held out. Here with a hundred times the anchors
  timeout 560 python bench/predecessor_head.py --device cuda --train-prompts 6144 --eval-prompts 80 --tokens 128 \
    --gen-batch 512 --steps 4000 --batch 512 --inner 1536 2>&1 | grep -v INFO | tee "$OUT/predecessor.txt" | tail -12 | log
  ;;
attach-bench)
  # (thirty-sixth session) split_bench beside the overhang's (services 0.64x / 0.58x in-process, both waits
  # 0.72x / 0.63x)
  timeout 300 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --waves 4 --rounds 3 --also-both-waits --json-out "$OUT/split_attach.json" 2>&1 | grep -E "^batch [0-9]+" | log
  ;;
mps-timeline)
  # (thirty-fourth session) under an MPS server of our own the services with both streams waiting on the device
  # went from 0.70x to 0.80x in-process at one stream, and stayed at 0.52x at eight, where the two-process
  # skeleton ran faster than one process (0.64 ms a step against 0.68; 0.90 without MPS). Where the rest goes:
  # both processes' work on one clock, the drafter's device waits on, at one and eight streams
  command -v nvidia-cuda-mps-control >/dev/null || { echo "mps: no nvidia-cuda-mps-control here" | log; exit 1; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/specsplit-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/specsplit-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "mps: the control daemon did not start" | log; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  (cd bench && timeout 140 python timeline.py --batch 1 --max-tokens 256 --skip 50 --steps 150 --drafter-device-waits \
    --out "$OUT/b1" 2>&1 | grep -v INFO | tail -14 | log)
  (cd bench && timeout 150 python timeline.py --batch 8 --max-tokens 1024 --skip 30 --steps 100 --drafter-device-waits \
    --out "$OUT/b8" 2>&1 | grep -v INFO | tail -14 | log)
  ;;
context-launch)
  # (thirty-third session) the DFlash drafter's graphed context forward writing every layer's k and v in one launch
  # (kernels.rope.CONTEXT_IN_ONE_LAUNCH; on since the thirty-fourth session measured 1.98x / 1.30x target-only against
  # 1.96x / 1.28x): 12 launches fewer a step for the 6-layer drafter. The kernel's GPU tests (against its reference;
  # the drafter's graphed forwards with it, against eager), then tokens/s of 15 drafts beside a drafter captured
  # with it off, one and eight streams
  timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fused_kernels.py tests/test_dflash_graphs.py \
    -k "context_kv or triton_paged_forwards" 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -8 | log
  timeout 300 python bench/draft_length.py --device cuda --dtype bfloat16 --batch 1 8 --waves 6 --drafts 15 \
    --also-context-apart --max-tokens 256 --json-out "$OUT/draft_length_context.json" 2>&1 | grep -v INFO \
    | tail -8 | log
  ;;
served-8b)
  # (twenty-ninth session) the goal is the 8B step at one stream within 1.15x its floor: step_bench's "step" is the
  # host's packing, a launch and a wait in series (4.65 ms, 1.21x), its replay 4.43 (1.15x); the engine launches
  # a decode step before reading the one before, so what it serves is between the two
  timeout 500 python bench/step_bench.py --target qwen3-8b --batch 1 8 --query 1 16 --repeats 50 --served 256 \
    --out "$OUT" 2>&1 | grep -v INFO | log
  ;;
fold-check)
  # (after the twenty-eighth session, not run yet) what that session changed after its device time was spent:
  # the bf16 graph test held to the float32 forward (it failed against its old bound with the folds), the
  # float16 layers keeping their norms' launches, the up rows' 64-bit offset; then served tokens/s with the
  # folds against without over three rounds (one round put in-process at eight streams at 0.92x, 0.25 s runs)
  timeout 240 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_linear.py tests/test_step_graphs.py \
    tests/test_dflash_graphs.py 2>&1 | grep -E "Error|error|assert|FAILED|passed|failed" | tail -20 | log
  timeout 330 python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 256 --batch 1 8 \
    --also-unfolded --rounds 3 --json-out "$OUT/split_fold3.json" 2>&1 | grep -v INFO | grep -E "unfolded" | log
  python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(b, {k: round(v, 3) if isinstance(v, float) else v \
    for k, v in d[b].items() if 'over' in k or 'differing' in k or k == 'rounds'}) for b in d if b.startswith('batch')]" \
    "$OUT/split_fold3.json" 2>&1 | log
  ;;
floor-batch)
  # (after the twenty-seventh session, not run yet) the 8B step kernel by kernel beyond one stream's decode:
  # eight streams' decode and a verify of 16 rows (both taking kernels/skinny_linear.py), and four streams'
  # verify (64 rows: cuBLAS), each against its floor with the narrow table, the engine's, and the kernel
  timeout 200 python bench/floor_profile.py --target qwen3-8b --batch 8 --query 1 --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E "replay|x  |a layer" | log
  timeout 200 python bench/floor_profile.py --target qwen3-8b --batch 1 --query 16 --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E "replay|x  |a layer" | log
  timeout 200 python bench/floor_profile.py --target qwen3-8b --batch 4 --query 16 --out "$OUT" 2>&1 | grep -v INFO \
    | grep -E "replay|x  |a layer" | log
  ;;
capture)
  # chained steps captured whole at 4, 8 and 16 streams against piecewise, side by side in one run (seventeenth
  # session, two runs: eight streams 1.05x target-only whole against 0.99x piecewise, captures left out), before
  # EngineConfig.chain_capture (2) changes
  python bench/split_bench.py --device cuda --dtype bfloat16 --drafter dflash --max-tokens 512 --batch 4 8 16 \
    --chain-capture 16 --also-uncaptured --json-out "$OUT/split_capture.json" 2>&1 | grep -v INFO | tail -2 | log
  ;;
train)
  # continue the shipped DFlash drafter for 7.2 minutes with a new seed and any extra train-drafter flags
  # (later ones win): the twenty-third session's recipe (the loss weights decaying as exp(-(k-1)/4): +0.02
  # tau where the same recipe at the default decay had stopped paying) on the twentieth session's (session
  # 15's, every chat prompt also sampled once, half the peak LR: +0.05 tau in its first run against +0.02
  # at 4e-4), evaluated in float32 beside its
  # --init in the same run; e.g. `train 27`, then `train 28 --init /var/tmp/ckpt/dflash-27`. The
  # checkpoint and its log come back under $OUT (shards under 16 MiB). Needs the call to carry
  # drafter_service/checkpoints (see tools/device_tree.sh). A checkpoint not shipped goes as a later --init,
  # carried alone beside .whl, e.g. `train 34 --init .ckpt/dflash-33`, carry [".ckpt/dflash-33", ".whl"] (the
  # twenty-fifth session's 8-layer one was kept there and did not outlive that session's machine: land a
  # checkpoint worth continuing, or train again)
  # On a card of 80 GB (an H100) the generator's 2,048 rows leave the pool 24 GiB where the H200's took 85: the
  # forty-first session's run saw a third of the data, each sequence 3.6 times, and its plain tau fell. There
  # 1,024 rows a generation batch halve the generator's cache and what is kept beside the pool (~49 GiB of pool
  # by the same arithmetic, not run yet); flags given after the seed still win
  seed=${2:?usage: bash tools/gpu_round.sh train SEED [train-drafter flags...]}
  shift 2
  gen_batch=2048
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
    gen_batch=1024
    echo "train: a card under 100 GB: --gen-batch $gen_batch" | log
  fi
  mkdir -p /var/tmp/ckpt
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m specsplit.cli train-drafter --kind dflash --device cuda \
    --init drafter_service/checkpoints/smollm2-135m-dflash --out /var/tmp/ckpt/dflash-$seed --minutes 7.2 \
    --pool-rounds 3 --gen-batch $gen_batch --gen-fraction 0.40 --pool-gb 90 --self-prompts 65536 --sampled-fraction 0.25 \
    --seq-len 256 --batch 32 --anchors 32 --lr 2e-4 --ce-weight 0.2 --kl-weight 1.0 --seed "$seed" --log-every 250 \
    --eval-tokens 128 --sampled-by-kind chat=1 --eval-dtype float32 --loss-decay 4 "$@" 2>&1 | grep -v INFO > /var/tmp/train.log
  cp /var/tmp/ckpt/dflash-$seed/* "$OUT/" 2>/dev/null
  cp /var/tmp/train.log "$OUT/train.log"
  grep -E "held-out|saved|pool [0-9]|prompts" /var/tmp/train.log | log
  ;;
*)
  echo "usage: bash tools/gpu_round.sh kernels|steps|services|profile|prefill|capture|chain|waits|waits-bench|timeline|probe-release|cross-gpu|tail|prepare|drafter-waits|drafter-waits-bench|serving|head|head-bench|overlap|sync|floor|skinny|skinny-step|floor-batch|eval|train SEED [flags]" >&2
  exit 2
  ;;
esac
