#!/usr/bin/env bash
# End-to-end training throughput on a GPU, through the real CLI: BERT-base MLM dense vs 90%-sparse 16x16
# (static and dynamic, block-sparse kernels), same batch, same steps, one machine, one run.
#   bash scripts/gpu_e2e.sh [STEPS] [OUT_DIR] [OVERRIDES...]
#   bash scripts/gpu_e2e.sh 60 out trainer.kernels.dense_fallback=false   # kernel options are config (trainer.kernels.*)
#   COMPILE=reduce-overhead bash scripts/gpu_e2e.sh ...   # every run with trainer.compile=true in that mode
#   RUNS="dense static_b64_block" bash scripts/gpu_e2e.sh ...  # a subset of the runs
# Needs hydra-core/omegaconf importable and the Shakespeare corpus in $SPARSETRAIN_CACHE (or network).
set -uo pipefail
STEPS=${1:-60}
OUT=${2:-gpu_e2e}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$OUT"
common=(trainer=gpu "trainer.max_steps=$STEPS" trainer.batch_size=64 trainer.grad_accum=1 trainer.eval_every=0
        trainer.log_every=10 trainer.checkpoint_every=0 trainer.num_workers=0 logger=quiet data.seq_len=128
        optim.warmup_steps=10)
if [ -n "${COMPILE:-}" ]; then common+=(trainer.compile=true "trainer.compile_mode=$COMPILE"); fi
common+=("$@")
RUNS=${RUNS:-"dense static_b16_block static_b64_block static_b16_masked dynamic_b16_block"}
run() {  # NAME RECIPE [overrides...]
  local name=$1 recipe=$2; shift 2
  case " $RUNS " in *" $name "*) ;; *) return ;; esac
  echo "== $name"
  python3 -m sparsetrain.cli train recipe=$recipe "${common[@]}" "$@" "hydra.run.dir=$OUT/$name" 2>&1 \
    | grep -v "step/s" | tail -4
}
run dense            bert_dense
run static_b16_block bert_static
run static_b64_block bert_static sparsity.block=64
run static_b16_masked bert_static sparsity.format=masked
run dynamic_b16_block bert_phase1_dynamic sparsity.scheduler.num_updates=4
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted(out.iterdir()):
    s = d / "summary.json"
    if s.is_file():
        rows[d.name] = json.loads(s.read_text())
base = rows.get("dense", {}).get("tokens_per_s")
print(f"{'recipe':<22} {'tokens/s':>10} {'vs dense':>9} {'peak GB':>8} {'hook share':>11}")
for name, r in rows.items():
    peak = max((json.loads(l).get("peak_mem_gb", 0) for l in open(out / name / "metrics.jsonl")), default=0)
    tps = r.get("tokens_per_s") or 0
    ratio = f"{tps / base:.2f}x" if base else "-"
    hook = r.get("hook_share_non_update_steps")
    print(f"{name:<22} {tps:>10.0f} {ratio:>9} {peak:>8.2f} {hook if hook is None else f'{hook:.2%}':>11}")
PY
