#!/usr/bin/env bash
# The GPU checks of issue 16, in the order to run them when a GPU is at hand for about 15 minutes.
# Each step writes its results under OUT as they come and has its own time limit, so a cut keeps
# what finished:
#   1. make bench's essential set at BERT-base, sequence 128: train.py and the Trainer in bf16 and TF32,
#      and both at train.py's automatic micro batch (6 launches, about 5 minutes): bench.jsonl, bench.md;
#   2. the host waits of the step: 12 steps of train.py with logging.sync_audit (and torch's
#      set_sync_debug_mode("warn")) on the bench's prepared data: sync_audit.log, its metrics.json;
#   3. make gpu-smoke on the rows that matter most (DDP bf16 and fp16, ZeRO-2, FSDP2 in bf16).
#
#   OUT=gpu-results bash tools/gpu_session.sh        (PYTHON=python3 by default; offline: the sample only)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
$PY -m bert_recipes.sample data/sample >/dev/null

echo "[gpu-session] 1/3 bench, essential set" | tee -a "$OUT/session.log"
timeout 420 $PY tools/bench.py --size base --set essential --precisions bf16,no --repeats 1 --steps 40 --warmup 10 \
    --out "$OUT/bench-base" 2>&1 | tee -a "$OUT/session.log" | grep -E "^\[bench\]|^\|"

echo "[gpu-session] 2/3 host waits between log steps" | tee -a "$OUT/session.log"
timeout 150 $PY train.py --recipe recipes/tiny-mlm.yaml --run.output_dir="$OUT/sync-audit" --run.overwrite=true \
    --data.source=prepared --data.prepared_dir="$OUT/bench-base/data-base/mlm" --data.max_seq_length=128 \
    --model.hidden_size=768 --model.num_hidden_layers=12 --model.num_attention_heads=12 --model.intermediate_size=3072 \
    --model.max_position_embeddings=512 --tokenizer.vocab_size=30522 --train.mixed_precision=bf16 \
    --train.max_steps=12 --logging.log_every=4 --logging.sync_audit=true --train.eval_every=null \
    --checkpoint.save_every=null --checkpoint.export=false --logging.progress_bar=false > "$OUT/sync_audit.log" 2>&1
grep -E "host_syncs|\[train\]|synchroniz" "$OUT/sync_audit.log" | tail -20
$PY -c "import json,sys; m=json.load(open(sys.argv[1])); print('[gpu-session] sync audit:', m['final'].get('sync_audit'))" \
    "$OUT/sync-audit/metrics.json" 2>&1 | tee -a "$OUT/session.log"

echo "[gpu-session] 3/3 gpu-smoke (subset)" | tee -a "$OUT/session.log"
timeout 300 $PY tools/gpu_smoke.py --rows ddp,zero2,fsdp --precisions bf16 --out "$OUT/gpu_smoke.md" \
    --work "$OUT/gpu_smoke" 2>&1 | tee -a "$OUT/session.log" | tail -12
