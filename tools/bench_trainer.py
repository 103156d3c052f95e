"""make bench's Trainer side: transformers' Trainer on the same token ids, model config and settings as train.py's row,
timed by a callback; its rows run in a worker process of their own (python tools/bench_trainer.py SPEC), one after
the other, each result appended to the results file as it finishes."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_rows import LR, MODEL_KEYS, SEED, SIZES  # noqa: E402
from bench_runs import _run_watched, cut  # noqa: E402


def trainer_inputs(spec: dict):
    """The Trainer's model (the same config as ours, sdpa), its training split and its collator."""
    import torch
    from prepare import prepared_splits
    from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              DataCollatorForLanguageModeling, DataCollatorWithPadding)

    from bert_recipes.config import load_config
    size, data = SIZES[spec["size"]], Path(spec["data"][spec["workload"]])
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    train_set = prepared_splits(data, size["seq"])["train"]
    named = json.loads((data / "prepared.json").read_text())["label_names"] if spec["workload"] == "classify" else None
    labels = len(named or []) or load_config(REPO / "recipes/tiny-classify.yaml").task.num_labels
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=max(512, size["seq"]),
                        pad_token_id=tokenizer.pad_token_id, **{k: size[k] for k in MODEL_KEYS}, num_labels=labels)
    torch.manual_seed(SEED)
    mlm = spec["workload"] == "mlm"
    model = (BertForMaskedLM if mlm else BertForSequenceClassification)(config)
    model.config._attn_implementation = "sdpa"
    base = (DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15) if mlm
            else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if torch.cuda.is_available() else None))  # as ours
    return model, train_set, base

def run_trainer(spec: dict) -> dict:
    """transformers' Trainer on the same token ids, model config and settings; its steps timed by a
    callback from one step's end to the next (data loading included, as on our side), and its data
    wait from a step's end to the next step's beginning (the Trainer fetches the step's batches there)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    model, train_set, base = trainer_inputs(spec)
    counts = {"padded": [], "real": [], "shapes": set()}

    def collate(features):
        batch = base(features)
        counts["padded"].append(batch["input_ids"].numel())
        counts["real"].append(int(batch["attention_mask"].sum()))
        counts["shapes"].add(tuple(batch["input_ids"].shape))
        return batch
    marks, waits = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            marks.append(time.perf_counter())

        def on_step_begin(self, *args, **kwargs):
            waits.append(time.perf_counter() - marks[-1])

        def on_step_end(self, *args, **kwargs):
            marks.append(time.perf_counter())
    cuda, mlm = torch.cuda.is_available(), spec["workload"] == "mlm"
    micro = spec.get("micro") or SIZES[spec["size"]]["batch"]
    args = TrainingArguments(
        output_dir=spec["dir"], per_device_train_batch_size=micro, max_steps=spec["steps"], learning_rate=LR,
        gradient_accumulation_steps=spec.get("accum", 1), torch_compile=bool(spec.get("compile")),
        torch_compile_backend=spec.get("compile_backend") if spec.get("compile") else None,
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=1.0, bf16=spec["precision"] == "bf16", logging_steps=10 ** 9,
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=not cuda, seed=SEED, disable_tqdm=True,
        tf32=(cuda and spec["precision"] == "no" and torch.cuda.get_device_capability()[0] >= 8) or None,  # as ours
        train_sampling_strategy="group_by_length" if not mlm else "random",
        optim="adamw_torch_fused")                         # torch's fused AdamW: CUDA and CPU kernels
    Trainer(model=model, args=args, train_dataset=train_set, data_collator=collate, callbacks=[Clock()]).train()
    w, per_step = spec["warmup"], spec.get("accum", 1)   # collated micro batches per optimizer step
    batches = slice(w * per_step, (len(marks) - 1) * per_step)
    steps = len(marks) - 1 - w
    return {"seconds": marks[-1] - marks[w], "steps": steps, "micro_batch": micro,
            "sequences": steps * micro * per_step, "data_wait_s": sum(waits[w:]), "shapes": len(counts["shapes"]),
            "padded_tokens": sum(counts["padded"][batches]), "real_tokens": sum(counts["real"][batches])}

def worker(spec_path: str) -> None:
    """Trainer rows in a process of their own (a list of specs: run one after the other, each result
    appended to the results file as it finishes, the GPU's memory freed between them)."""
    import gc

    import torch
    specs = json.loads(Path(spec_path).read_text())
    for spec in specs:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        result = run_trainer(spec)
        result["peak_memory_mb"] = (torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available()
                                    else __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss / 1024)
        result["wall_s"] = time.time() - t0
        with open(spec["result"], "a") as f:
            f.write(json.dumps(result) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

def run_trainers(specs: list[dict], out: Path) -> list[dict]:
    """Trainer rows in one worker (one start-up for all); -> a result for each spec, in order (cut:
    the rows the worker did not finish within the sum of their limits)."""
    results_file = out / f"trainer-{os.getpid()}-{time.time_ns()}.jsonl"
    for spec in specs:
        spec["result"] = str(results_file)
    (out / "spec.json").write_text(json.dumps(specs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    limits = [s.get("limit_s") for s in specs]
    code, stdout, _, wall_s = _run_watched([sys.executable, __file__, str(out / "spec.json")], env,
                                           sum(limits) if all(limits) else None)
    done = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    if code not in (0, None):
        raise RuntimeError(f"{specs[len(done)]['name']} failed:\n{stdout[-3000:]}")
    return done + [cut(spec, stdout, wall_s) for spec in specs[len(done):]]


if __name__ == "__main__":   # the worker (run_trainers starts it)
    worker(sys.argv[1])
