#!/bin/bash
# Issue 42's GPU runs (docs/benchmarks.md, "GRPO recipes on SmolLM2 math (cuda)" and "GRPO long run on SmolLM2
# math (cuda)"): the five presets (default, GRPO, Dr. GRPO, DAPO, GSPO: run_configs/smollm2_135m_math*.toml)
# 100 steps each at the same seed, second seeds, and a 400-step long run of the best preset.
#
#   bash scripts/gpu/research_compare.sh start      # launch COMPARE on the machine's GPUs (setsid: runs outlive the call)
#   bash scripts/gpu/research_compare.sh wait [S]   # up to S s (420): relaunch with --resume any run that died before
#                                                   # its end; then evaluate finished runs' exports and pack
#   bash scripts/gpu/research_compare.sh long [P]   # the long run: preset P (default: the best of the comparison under
#                                                   # $RUNS) for LONG_STEPS steps alone on GPU LONG_GPU
#   bash scripts/gpu/research_compare.sh pack       # tables + raw results -> $OUT (always 3 files)
#
# A run is PRESET or PRESET@SEED (seed 0 if none) and writes $RUNS/PRESET_sSEED (run-N/ and latest); the long run
# $RUNS/long_PRESET. PRESET "calculator" is the tool task (CALC_ARGS on the default config, evaluated every 10
# steps on 200 held-out problems, as the earlier 40-step run), "calcnobonus" the same without the format bonus.
# "partial" is the default preset with partial rollouts (PARTIAL_ARGS, default partial_args.sh's as in long_tail.sh):
# beside "default" at the same seed it is issue 39's math pair (learning not hurt: held-out accuracy at step 100).
# Run i of COMPARE goes to GPU_LIST[i mod G] (default: every GPU nvidia-smi lists), so runs share a GPU when there
# are more runs than GPUs; the first run on each GPU starts at once, the next STAGGER s later (vLLM
# profiles its GPU's free memory at start). Every comparison run gets the same overrides: seed, STEPS, evaluation
# every EVAL_EVERY steps (held-out split + word_problems, before step 0 and after the last), GPU_MEM of its GPU for
# vLLM, micro-batches of MICRO rows, a checkpoint every CKPT steps (a run that dies resumes from it), and
# job.export (<run>/hf). The long run is the preset as shipped (its own GPU memory share and micro-batches: it has
# the GPU alone) with the same evaluation and checkpoint interval.
# A finished run's export is scored by `python -m torchtitan_rl.evaluate --run-dir RUN --model RUN/hf` (the
# run's settings: its held-out split and word_problems) -> $RUNS/eval_NAME.json; the table says whether that
# equals the loop's final evaluation.
# $OUT gets table.md (research_table.py's tables), benchmarks.md (docs/benchmarks.md with the sections of this
# machine's runs replaced) and research.tgz (every run's metrics.jsonl, samples.jsonl, config.toml, log tail and
# evaluator report). The tables of several leases: their research.tgz unpacked side by side, then
# `research_table.py --runs LEASE1 LEASE2 --write-benchmarks docs/benchmarks.md` (docs/gpu.md, "Issue 42").
set -u
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/tmp/research}
COMPARE=${COMPARE:-"default grpo drgrpo dapo gspo default@1 grpo@1 dapo@1"}
STEPS=${STEPS:-100}
EVAL_EVERY=${EVAL_EVERY:-25}
CKPT=${CKPT:-25}
GPU_MEM=${GPU_MEM:-0.15}
MICRO=${MICRO:-32}
STAGGER=${STAGGER:-30}
LONG_STEPS=${LONG_STEPS:-400}
LONG_GPU=${LONG_GPU:-0}
MAX_RESTARTS=${MAX_RESTARTS:-2}
CALC_ARGS=${CALC_ARGS:-"--grpo.task calculator --task.max_turns 3 --generator.sampling.max_tokens 128 --eval.max_tokens 128 --eval.num_prompts 200 --eval.every_n_steps 10"}
source scripts/gpu/partial_args.sh
PARTIAL_ARGS=${PARTIAL_ARGS:-$PARTIAL_ON_ARGS}
config() {
  case $1 in default|calculator|calcnobonus|partial) echo run_configs/smollm2_135m_math.toml ;;
             *) echo "run_configs/smollm2_135m_math_$1.toml" ;; esac
}
extra() {  # the tool-task runs (docs/benchmarks.md, "Multi-turn tool task"): the calculator, with and without
  # the format bonus; and the default preset with partial rollouts
  case $1 in calculator) echo "$CALC_ARGS" ;; calcnobonus) echo "$CALC_ARGS --task.format_reward_weight 0" ;;
             partial) echo "$PARTIAL_ARGS" ;; esac
}
ngpus() { n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$n" -gt 0 ] && echo "$n" || echo 1; }
folder() { local seed=0; [[ $1 == *@* ]] && seed=${1#*@}; echo "${1%@*}_s$seed"; }
alive() { [ -f "$RUNS/$1.pid" ] && kill -0 "$(cat "$RUNS/$1.pid")" 2>/dev/null; }
finished() { [ -f "$RUNS/$1/latest/hf/model.safetensors" ]; }

# launch NAME GPU [--resume]: NAME's arguments are in $RUNS/NAME.args (written once, at its first launch).
launch() {
  local name=$1 gpu=$2; shift 2
  echo "$(date -u +%FT%TZ) launch $name on GPU $gpu $*" | tee -a "$RUNS/$name.log"
  # shellcheck disable=SC2046
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup python3 -m \
    torchtitan_rl.simple_grpo $(cat "$RUNS/$name.args") "$@" >> "$RUNS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUNS/$name.pid"
  echo "$gpu" > "$RUNS/$name.gpu"
}

evaluate_export() {  # NAME: the standalone evaluator on the run's export, with the run's settings
  local name=$1
  [ -f "$RUNS/eval_$name.json" ] && return 0
  if ! CUDA_VISIBLE_DEVICES=$(cat "$RUNS/$name.gpu") python3 -m torchtitan_rl.evaluate --run-dir "$RUNS/$name" \
       --model "$RUNS/$name/latest/hf" --out "$RUNS/eval_$name.json" >> "$RUNS/$name.eval.log" 2>&1; then
    echo "== $name: the evaluator failed: $(tail -n 1 "$RUNS/$name.eval.log")"
  fi
}

pack() {
  [ -n "${OUT:-}" ] || { python3 scripts/gpu/research_table.py --runs "$RUNS"; return; }
  cp docs/benchmarks.md "$OUT/benchmarks.md"
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd,)
  python3 scripts/gpu/research_table.py --runs "$RUNS" --write-benchmarks "$OUT/benchmarks.md" \
    --machine "${machine:-?} (device tool; torch 2.11, vLLM 0.26)" > "$OUT/table.md"
  cat "$OUT/table.md"
  local staged; staged=$(mktemp -d)
  for dir in "$RUNS"/*/; do
    name=$(basename "$dir"); run="$dir/latest"; [ -d "$run" ] || continue
    mkdir -p "$staged/$name"
    cp "$run/metrics.jsonl" "$run/config.toml" "$staged/$name/" 2>/dev/null
    [ -f "$run/samples.jsonl" ] && cp "$run/samples.jsonl" "$staged/$name/"
    [ -f "$RUNS/eval_$name.json" ] && cp "$RUNS/eval_$name.json" "$staged/$name/evaluate.json"
    tail -c 4000 "$RUNS/$name.log" 2>/dev/null | tr '\r' '\n' | tail -n 30 > "$staged/$name/log_tail.txt"
  done
  tar czf "$OUT/research.tgz" -C "$staged" . && rm -rf "$staged"
  ls -la "$OUT"
}

case ${1:-pack} in
  start)
    python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct || exit 1
    mkdir -p "$RUNS"
    read -r -a gpus <<< "${GPU_LIST:-$(seq -s ' ' 0 $(( $(ngpus) - 1 )))}"; G=${#gpus[@]}; i=0
    for run in $COMPARE; do
      name=$(folder "$run"); preset=${run%@*}; seed=0; [[ $run == *@* ]] && seed=${run#*@}
      [ -f "$RUNS/$name.args" ] && { echo "== $name: already launched (wait resumes it)"; i=$((i + 1)); continue; }
      echo "--config $(config "$preset") --job.output_dir $RUNS/$name --job.seed $seed --trainer.steps $STEPS" \
           "--eval.every_n_steps $EVAL_EVERY --generator.gpu_memory_utilization $GPU_MEM" \
           "--trainer.micro_batch_size $MICRO --trainer.checkpoint.enable --trainer.checkpoint.interval $CKPT" \
           "--trainer.checkpoint.keep_latest 1 --job.export --metrics.samples_per_eval 8 $(extra "$preset")" \
           > "$RUNS/$name.args"
      [ $i -gt 0 ] && [ $((i % G)) -eq 0 ] && sleep "$STAGGER"  # a second run on a GPU: after the first's engine
      launch "$name" "${gpus[$((i % G))]}"
      i=$((i + 1))
    done
    ;;
  long)
    preset=${2:-$(python3 scripts/gpu/research_table.py --runs "$RUNS" --best)}
    [ -f "$(config "$preset")" ] || { echo "long: no preset '$preset' (finish the comparison, or name one)" >&2; exit 2; }
    python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct || exit 1
    mkdir -p "$RUNS"; name=long_$preset
    echo "--config $(config "$preset") --job.output_dir $RUNS/$name --trainer.steps $LONG_STEPS" \
         "--eval.every_n_steps $EVAL_EVERY --trainer.checkpoint.enable --trainer.checkpoint.interval $CKPT" \
         "--trainer.checkpoint.keep_latest 1 --job.export --metrics.samples_per_eval 8" > "$RUNS/$name.args"
    alive "$name" || launch "$name" "$LONG_GPU"
    ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-420} ))  # + up to ~2 min of evaluators and the pack: one call under 10 min
    while :; do
      pending=0
      for args in "$RUNS"/*.args; do
        [ -f "$args" ] || continue  # none launched
        name=$(basename "$args" .args)
        if alive "$name"; then pending=1
        elif ! finished "$name"; then
          restarts=$(grep -c ' launch .*--resume' "$RUNS/$name.log" 2>/dev/null)
          if [ "${restarts:-0}" -lt "$MAX_RESTARTS" ]; then
            echo "== $name died before its end: $(tr '\r' '\n' < "$RUNS/$name.log" | grep -v '^\s*$' | tail -n 1)"
            launch "$name" "$(cat "$RUNS/$name.gpu")" --resume; pending=1
          fi
        fi
      done
      [ $pending -eq 0 ] || [ "$(date +%s)" -ge "$deadline" ] && break
      sleep 15
    done
    for args in "$RUNS"/*.args; do
      [ -f "$args" ] || continue
      name=$(basename "$args" .args)
      if finished "$name" && ! alive "$name"; then evaluate_export "$name" & fi
    done
    wait  # the evaluators, each on its run's GPU
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
    pack
    ;;
  pack) pack ;;
  *) echo "usage: $0 start|wait [SECONDS]|long [PRESET]|pack" >&2; exit 2 ;;
esac
