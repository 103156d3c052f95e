"""make bench's rows: what is compared (train.py and the Trainer on each workload, each speed feature on and off,
the GPU session's two parts), at which size. A new bench row is one row(...) call in variants or gpu_rows
(docs/changing.md); tools/bench.py runs them."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bert_recipes.backends.plan import chosen_rows, first_row  # noqa: E402
from bert_recipes.config import ConfigError  # noqa: E402

SIZES = {   # model, vocabulary, sequence, micro batch
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256, vocab=1000,
                 seq=64, batch=16, auto_global=32),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab=8192,
                 seq=128, batch=16),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab=30522,
                 seq=128, batch=32),
    # BERT-base at 1,024 tokens: the GPU session's documents part (gpu-docs), where attention is a large share
    "base-1k": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab=30522,
                    seq=1024, batch=4),
}
MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
LR, SEED = 1e-4, 7
WINDOW = 10          # train.py rows log every WINDOW steps, as a user's run does (logging.log_every's default)
# The global batch of the automatic-micro-batch rows: BERT's phase-1 per-GPU share; a size may set its own
# (tiny, the CPU rehearsal's: 2 micro batches, the same accumulation path at an eighth of the work).
AUTO_GLOBAL = 256
EQUAL_WORK = ["data.max_predictions_per_seq=null", "model.sparse_mlm_head=false"]   # the Trainer's head and masking


def row(name: str, workload: str, side: str, precision: str, **more) -> dict:
    """One row: a fresh process each run. pair: the row it is compared with (a Trainer row, or the row a
    feature's 'off' is); extra: train.py overrides; micro_from: the Trainer takes the micro batch (and the
    accumulation to AUTO_GLOBAL) that this train.py row picked; process: Trainer rows with the same key
    share one worker; limit_s: the run is stopped (and recorded as cut) past this many seconds."""
    return {"name": name, "workload": workload, "side": side, "precision": precision, **more}

def auto_micro(cuda: bool, size: dict) -> list[str]:
    """train.py's automatic micro batch (GPUs); on CPU processes, which have no free-memory figure, the
    size's micro batch stands in (a rehearsal runs the same rows)."""
    return [f"train.global_batch_size={size.get('auto_global', AUTO_GLOBAL)}", "train.micro_batch_size=" + ("auto" if cuda else str(size["batch"]))]

def gpu_rows(part: str, cuda: bool, size: dict) -> list[dict]:
    """The GPU session's rows (tools/gpu_session.py), bf16, in the order to run them; the limits are the
    session's, sized for an H200 (docs/speed.md: "The GPU session")."""
    auto = auto_micro(cuda, size)
    if part == "gpu-must":   # the automatic micro batch, eager and compiled, against the Trainer at the same micro
        return [row("mlm: train.py, auto micro batch", "mlm", "ours", "bf16", extra=auto + ["logging.profile=true"],
                    pair="mlm: Trainer, same micro batch", limit_s=40),
                row("mlm: train.py + compile, auto micro batch", "mlm", "ours", "bf16", extra=auto + ["train.compile=true"],
                    pair="mlm: Trainer + compile, same micro batch", limit_s=75),
                row("mlm: Trainer, same micro batch", "mlm", "trainer", "bf16", micro_from="mlm: train.py, auto micro batch",
                    process="trainer-auto", limit_s=40),
                row("mlm: Trainer + compile, same micro batch", "mlm", "trainer", "bf16", compile=True,
                    micro_from="mlm: train.py, auto micro batch", process="trainer-auto", limit_s=50)]
    return [row("classify: train.py, step times", "classify", "ours", "bf16",
                extra=["data.group_by_length=true", "logging.step_times=true"], limit_s=35),
            # the fixed micro batch, last: ours, ours doing the Trainer's work (dense head, per-token masking)
            row("mlm: train.py", "mlm", "ours", "bf16", pair="mlm: Trainer", limit_s=20),
            row("mlm: train.py, dense head (equal work)", "mlm", "ours", "bf16", extra=EQUAL_WORK, pair="mlm: Trainer",
                limit_s=20),
            row("mlm: Trainer", "mlm", "trainer", "bf16", limit_s=20)]

def docs_rows(cuda: bool) -> list[dict]:
    """The GPU session's documents part (gpu-docs; the same rows at tiny size on CPU processes in its rehearsal):
    packed rows with their documents apart through varlen and through the block mask, against a document a row padded
    and unpadded (varlen), in bf16 without attention dropout (varlen takes none). On CPU processes every path is the
    mask (train.document_attention=auto): the rehearsal checks the flow, not a figure."""
    no_dropout = ["model.attention_probs_dropout_prob=0"]
    varlen = ["train.document_attention=varlen"] if cuda else []
    mask = ["train.document_attention=mask"] if cuda else []
    return [row("mlm: packed, documents apart (varlen)", "mlm-docs", "ours", "bf16", extra=no_dropout + varlen,
                pair="mlm: packed, documents apart (block mask)", limit_s=28),
            row("mlm: packed, documents apart (block mask)", "mlm-docs", "ours", "bf16", extra=no_dropout + mask,
                limit_s=28),
            row("mlm: a document a row, unpadded (varlen)", "mlm-unpacked", "ours", "bf16",
                extra=no_dropout + varlen + ["data.unpad=true", "data.length_bins=0"],
                pair="mlm: a document a row, padded", limit_s=28),
            row("mlm: a document a row, padded", "mlm-unpacked", "ours", "bf16", extra=no_dropout, limit_s=28)]


def modern_rows(cuda: bool) -> list[dict]:
    """The GPU session's ModernBERT part (gpu-modern): ModernBERT-base as recipes/modernbert-base-mlm.yaml trains it,
    StableAdamW, packed rows whose documents attend apart, attention output dropout 0.1, at the automatic micro batch,
    beside BERT-base on the same rows: sequences/s, MFU and the planner's peak against the measured one. Its
    22 layers and GeGLU width on the GPU; the rehearsal keeps the tiny size's shape (the flow, not a figure)."""
    shape = ["model.num_hidden_layers=22", "model.intermediate_size=1152"] if cuda else []
    modern = ["model.architecture=modernbert", "model.local_attention=128", "model.global_attn_every_n_layers=3",
              "model.global_rope_theta=10000", "model.local_rope_theta=10000", "model.attention_probs_dropout_prob=0",
              "model.attention_output_dropout=0.1", "optim.name=stable_adamw"]
    auto = auto_micro(cuda, {"batch": 4})
    return [row("mlm: ModernBERT-base, StableAdamW, documents apart", "mlm-docs", "ours", "bf16",
                extra=modern + shape + auto, pair="mlm: BERT-base, documents apart", limit_s=60),
            row("mlm: BERT-base, documents apart", "mlm-docs", "ours", "bf16",
                extra=["model.attention_probs_dropout_prob=0"] + auto, limit_s=40)]


def variants(precisions: list[str], offload: str | None, which: str = "all", size: dict | None = None) -> list[dict]:
    """What is run, in order. all: train.py and the Trainer at each precision, and each speed feature on
    and off; gpu-must / gpu-rest: the GPU session's two parts (gpu_rows; bf16)."""
    import torch
    cuda = torch.cuda.is_available()
    if which == "gpu-docs":
        return docs_rows(cuda)
    if which == "gpu-modern":
        return modern_rows(cuda)
    if which.startswith("gpu-"):
        return gpu_rows(which, cuda, size or SIZES["base"])
    rows = []
    for p in precisions:
        rows += [row("mlm: train.py", "mlm", "ours", p, pair="mlm: Trainer"), row("mlm: Trainer", "mlm", "trainer", p)]
    if cuda and "bf16" in precisions:   # the automatic micro batch; the Trainer runs at the one train.py picked
        rows += [row("mlm: train.py, auto micro batch", "mlm", "ours", "bf16", extra=auto_micro(True, {}),
                     pair="mlm: Trainer, same micro batch"),
                 row("mlm: Trainer, same micro batch", "mlm", "trainer", "bf16",
                     micro_from="mlm: train.py, auto micro batch")]
    for p in precisions:
        rows += [
            row("mlm: Trainer + compile", "mlm", "trainer", p, compile=True, pair="mlm: Trainer"),
            row("mlm: train.py + compile", "mlm", "ours", p, extra=["train.compile=true"], pair="mlm: train.py"),
            row("mlm: train.py, dense head (equal work)", "mlm", "ours", p, extra=EQUAL_WORK, pair="mlm: Trainer"),
            row("mlm: train.py, foreach AdamW", "mlm", "ours", p, extra=["optim.fused=false"], pair="mlm: train.py"),
            row("mlm: train.py, per-token masking", "mlm", "ours", p, extra=["data.max_predictions_per_seq=null"],
                pair="mlm: train.py"),
            row("classify: train.py", "classify", "ours", p, extra=["data.group_by_length=true"],
                pair="classify: Trainer"),
            row("classify: Trainer", "classify", "trainer", p),
            row("classify: train.py, no grouping", "classify", "ours", p, extra=["data.group_by_length=false"],
                pair="classify: train.py"),
            # no compute on padding (data.unpad) against the fair baseline, grouped batches; a packed row's documents
            # apart (data.document_mask) against plain packing. On CPUs both run a dense block-diagonal mask (the
            # bench's note): the figures say what the mask costs here, not what varlen saves on a GPU (gpu-docs)
            row("classify: train.py, unpadded", "classify", "ours", p, extra=["data.unpad=true", "data.length_bins=0"],
                pair="classify: train.py"),
            row("mlm: train.py, documents apart", "mlm-docs", "ours", p, pair="mlm: train.py"),
        ]
        if not cuda:   # model.dropout_impl=packed is a CPU opt-in (refused on GPUs)
            rows.append(row("mlm: train.py, packed dropout", "mlm", "ours", p, extra=["model.dropout_impl=packed"],
                            pair="mlm: train.py"))
    if offload:   # a row of the table that offloads the optimizer (offload_row)
        rows += [row(f"{offload}: DeepSpeed CPU Adam", "mlm", "ours", "no", backend=offload,
                     extra=["optim.cpu_adam=true"], pair=f"{offload}: torch AdamW"),
                 row(f"{offload}: torch AdamW", "mlm", "ours", "no", backend=offload, extra=["optim.cpu_adam=false"])]
    return rows

def offload_row(asked: str | None) -> str | None:
    """--offload's row: None without --offload; the table's first ZeRO-2 row offloading to the host for a bare
    --offload; else the named row, which must be a row of the table whose optimizer ZeRO offloads (ConfigError:
    one line)."""
    if asked is None:
        return None
    name = asked or first_row("deepspeed", 2, "cpu")
    if name is None:
        raise ConfigError("--offload: accelerate_configs/backends.tsv has no ZeRO-2 row offloading to the host: "
                          "name one with --offload ROW")
    if "," in name:
        raise ConfigError(f"--offload takes one row, got {name}")
    row, = chosen_rows(name, "--offload")   # a name that is no row: ConfigError
    if not row.plan.offloads_optimizer:
        raise ConfigError(f"--offload {name}: {row.config} does not offload the optimizer (its DeepSpeed JSON has no "
                          "offload_optimizer): name a row that does")
    return name


def row_nproc(row_: dict) -> int:
    """Backend rows: 2 CPU processes, or 1 GPU; the rest one process."""
    import torch
    return 2 if row_.get("backend") and not torch.cuda.is_available() else 1
