"""The real user's path: the Hub reachable from training targets, checkpoints in every standard BERT
layout, GLUE, exports you can ship, and pretraining as the BERT papers do it."""
from __future__ import annotations

import os
import subprocess

from conftest import REPO


# ----------------------------------------------------------------------------- online by default
def _env_of_target(*make_args) -> dict:
    """The environment a Make target's training command really gets: the launcher is replaced by `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    out = subprocess.run(["make", "-s", *make_args, "PY=true", "LAUNCH=sh -c env --"], cwd=REPO, env=clean,
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_training_targets_reach_the_hub_and_the_demo_and_tests_stay_offline():
    for target in ("zero3", "ddp"):
        env = _env_of_target(target, "RECIPE=recipes/bert-base-glue-sst2.yaml")
        assert "HF_HUB_OFFLINE" not in env and "HF_DATASETS_OFFLINE" not in env, target
        assert env["PET_SIGNALS_TO_HANDLE"].endswith("SIGUSR1")
    for target in ("demo", "test"):
        commands = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout
        runs = [line for line in commands.replace("\\\n", " ").splitlines() if "train.py" in line or "pytest" in line]
        assert runs and all("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1" in line for line in runs), commands


# ----------------------------------------------------------------------------- checkpoint layouts
import pytest  # noqa: E402
import torch  # noqa: E402

from bert_recipes.config import ConfigError, load_config  # noqa: E402
from conftest import launch, run_in_process, tiny_args  # noqa: E402

LAYOUTS = ["BertForPreTraining", "BertForMaskedLM", "BertModel", "BertForSequenceClassification"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, shared_tokenizer):
    """One tiny checkpoint per standard layout (random weights, 2 layers, the shared tokenizer beside it)."""
    import shutil

    import transformers
    root = tmp_path_factory.mktemp("layouts")
    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    for name in LAYOUTS + ["three_labels"]:
        torch.manual_seed(0)
        cls = getattr(transformers, "BertForSequenceClassification" if name == "three_labels" else name)
        model = cls(transformers.BertConfig(**{**config.to_dict(), "num_labels": 3 if name == "three_labels" else 2}))
        model.save_pretrained(root / name)
        shutil.copytree(shared_tokenizer, root / name, dirs_exist_ok=True)
    return root


def _build(path, kind, **extra):
    from bert_recipes.models import build_model, model_config
    cfg = load_config(None, [f"model.name_or_path={path}", f"task.kind={kind}"] + [f"{k}={v}" for k, v in extra.items()])
    return build_model(cfg.model, cfg.task, config=model_config(cfg.model, cfg.task, 1000, 0))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mlm", "classification"])
def test_every_standard_layout_starts_a_run_with_its_encoder(layout, kind, layouts):
    """The encoder comes from the checkpoint exactly; what the task's head lacks is new and named,
    what the checkpoint has beyond it (NSP head, MLM head, pooler) is named as unused."""
    from safetensors.torch import load_file
    model = _build(layouts / layout, kind)
    saved = {k.removeprefix("bert."): v for k, v in load_file(layouts / layout / "model.safetensors").items()}
    encoder = {k: v for k, v in model.state_dict().items() if k.startswith(("bert.embeddings.", "bert.encoder."))}
    assert encoder and all(torch.equal(v, saved[k.removeprefix("bert.")]) for k, v in encoder.items())
    report = model.loading_report
    if kind == "mlm" and layout in ("BertModel", "BertForSequenceClassification"):
        assert "new here (no trained values in the checkpoint): cls.predictions.*" in report
    if kind == "classification" and layout != "BertForSequenceClassification":
        assert "classifier.bias, classifier.weight" in report.split("new here")[1]
    if layout == "BertForPreTraining":
        assert "cls.seq_relationship.*" in report.split("unused from the checkpoint")[1]
    if kind == "mlm" and layout == "BertForPreTraining":   # the MLM head and tied decoder come along
        assert "new here" not in report
        assert torch.equal(model.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)


def test_a_classifier_for_another_label_count_is_refused_or_reinitialised(layouts):
    with pytest.raises(ConfigError, match="set model.reinit_head=true"):
        _build(layouts / "three_labels", "classification")
    model = _build(layouts / "three_labels", "classification", **{"model.reinit_head": "true"})
    assert model.classifier.out_features == 2 and "new here (no trained values in the checkpoint): classifier" \
        in model.loading_report


def test_a_checkpoint_without_an_encoder_is_refused(layouts, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    shutil.copytree(layouts / "BertModel", tmp_path / "renamed")
    weights = load_file(tmp_path / "renamed/model.safetensors")
    save_file({f"other.{k}": v for k, v in weights.items()}, tmp_path / "renamed/model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="training would start from random weights"):
        _build(tmp_path / "renamed", "mlm")


def test_fine_tuning_from_a_bert_for_pretraining_checkpoint_under_ddp(layouts, tmp_path, sample_dir, datasets_cache):
    """A checkpoint in BertForPreTraining's layout (MLM + NSP heads and a pooler, as bert-base-uncased
    ships) fine-tunes under 2-process DDP: the heads this task has no use for are named as unused, and
    a sentence-pair task that one word decides is learnt (64 validation pairs, about half of each
    label: accuracy 0.9 is over 5 standard deviations above chance, so the bar does not depend on the
    host or the seed; learning the sample task itself is the demo's and `make bench`'s job)."""
    from conftest import write_pairs
    train, val = write_pairs(tmp_path / "train.jsonl", 256, 0), write_pairs(tmp_path / "val.jsonl", 64, 1)
    metrics = launch(2, tiny_args(tmp_path / "cls", sample_dir, datasets_cache, task="classification", **{
        "model.name_or_path": layouts / "BertForPreTraining", "task.num_labels": 2, "data.source": "files",
        "data.train_files": f"[{train}]", "data.validation_files": f"[{val}]", "data.text_column": "a",
        "data.text_pair_column": "b", "data.max_eval_samples": "null", "train.max_steps": 40}))
    final = metrics["final"]
    assert final["num_processes"] == 2 and final["distributed_type"] == "DistributedType.MULTI_CPU"
    assert final["eval_samples"] == final["eval_dataset_size"] == 64
    assert final["accuracy"] >= 0.9, final
    log = (tmp_path / "cls.log").read_text()
    assert "unused from the checkpoint (heads this task does not have): cls.predictions.*, cls.seq_relationship.*" \
        in log


# ----------------------------------------------------------------------------- exports you can ship
# (a DeepSpeed bf16 export holds the fp32 master weights: tests/test_speed.py, with the DeepSpeed JSON rows)


# ----------------------------------------------------------------------------- GLUE
def test_make_glue_runs_the_nine_tasks_and_writes_the_table_and_the_submission(tmp_path, sample_dir, datasets_cache,
                                                                               shared_tokenizer):
    """tools/glue.py (make glue) over a local dataset directory in GLUE's shape: nine fine-tunes from
    one model, MNLI evaluated matched and mismatched, the GLUE average, and the test predictions as
    GLUE's submission files (index and label, label names where GLUE wants them)."""
    import json
    import shutil
    import sys

    from transformers import BertConfig, BertForMaskedLM

    from glue_shaped import build_glue_like
    data = build_glue_like(tmp_path / "glue", sample_dir)
    model = tmp_path / "model"
    BertForMaskedLM(BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(model)
    shutil.copytree(shared_tokenizer, model, dirs_exist_ok=True)
    out = tmp_path / "results"
    shrink = ["--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.epochs=2", "--train.eval_every=3",
              "--data.max_seq_length=32", "--train.mixed_precision=no", "--data.num_workers=0",
              "--logging.trackers=[]", "--logging.progress_bar=false", "--logging.plot=false",
              "--checkpoint.save_every=null", f"--data.cache_dir={datasets_cache}"]
    proc = subprocess.run([sys.executable, "tools/glue.py", "--model", str(model), "--data", str(data),
                           "--launcher", "python", "--out", str(out), "--", *shrink], cwd=REPO, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "glue_results.json").read_text())
    assert [row["task"] for row in result["tasks"]] == ["CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI",
                                                        "RTE", "WNLI"]
    assert all(row["status"] == "ok" for row in result["tasks"])
    mnli = next(row for row in result["tasks"] if row["task"] == "MNLI")
    assert set(mnli["metrics"]) == {"matched acc.", "mismatched acc."}
    assert 0 <= result["glue_score"] <= 100 and result["glue_score_without_wnli"] is not None
    assert round(result["published_glue_score"], 2) == 75.47   # the published numbers, averaged the same way
    table = (out / "glue_results.md").read_text()
    assert "| MNLI | mismatched acc. |" in table and "**GLUE score" in table
    assert result["submission"] == sorted(["CoLA.tsv", "SST-2.tsv", "MRPC.tsv", "STS-B.tsv", "QQP.tsv", "MNLI-m.tsv",
                                           "MNLI-mm.tsv", "QNLI.tsv", "RTE.tsv", "WNLI.tsv"])
    mnli_m = (out / "submission/MNLI-m.tsv").read_text().splitlines()
    assert mnli_m[0] == "index\tprediction" and len(mnli_m) == 1 + 16
    assert [line.split("\t")[0] for line in mnli_m[1:]] == [str(1000 + i) for i in range(16)]
    assert {line.split("\t")[1] for line in mnli_m[1:]} <= {"entailment", "neutral", "contradiction"}
    assert {line.split("\t")[1] for line in (out / "submission/RTE.tsv").read_text().splitlines()[1:]} <= \
        {"entailment", "not_entailment"}
    assert {line.split("\t")[1] for line in (out / "submission/CoLA.tsv").read_text().splitlines()[1:]} <= {"0", "1"}
    assert all(0 <= float(line.split("\t")[1]) <= 5
               for line in (out / "submission/STS-B.tsv").read_text().splitlines()[1:])
    mnli_run = json.loads((out / "mnli/metrics.json").read_text())["final"]
    assert mnli_run["validation_mismatched/eval_samples"] == 24
    if "best" in json.loads((out / "cola/checkpoints/step_00000006/train_state.json").read_text()):
        assert (out / "cola/checkpoints/best/train_state.json").exists()   # kept apart from the rotation


# ----------------------------------------------------------------------------- pretraining as the papers do it
def test_whole_word_masking_masks_words_together_at_the_rate(sample_dir, shared_tokenizer):
    """Every word (a token and the "##" pieces after it) is predicted whole or not at all; 15% of the
    tokens are chosen (never more); 80% of them become [MASK], 10% a random token, 10% stay; and the
    masking is a pure function of (seed, epoch, example)."""
    from transformers import AutoTokenizer

    from bert_recipes.tasks.mlm import MLMCollator
    tok = AutoTokenizer.from_pretrained(shared_tokenizer)
    lines = [l for l in (sample_dir / "pretrain/train.txt").read_text().splitlines() if len(l) > 80][:400]
    examples = [{**tok(l, truncation=True, max_length=64, return_special_tokens_mask=True), "idx": i}
                for i, l in enumerate(lines)]
    collate = MLMCollator(tok, 0.15, seed=3, whole_word=True)
    batch = collate(examples)
    original = tok.pad([{k: v for k, v in e.items() if k != "idx"} for e in examples], return_tensors="pt",
                       pad_to_multiple_of=8)
    ids, special = original["input_ids"], original["special_tokens_mask"].bool() | (original["attention_mask"] == 0)
    chosen = batch["labels"] != -100
    continuation = torch.tensor([t.startswith("##") for t in tok.convert_ids_to_tokens(list(range(len(tok))))])
    split_words = 0
    for row in range(len(examples)):
        valid = ~special[row]
        starts = valid & ~(continuation[ids[row]] & torch.cat([torch.tensor([False]), valid[:-1]]))
        word = torch.cumsum(starts, 0)
        for w in word[valid].unique():
            members = chosen[row][valid & (word == w)]
            split_words += bool(members.any()) and not bool(members.all())
        assert int(chosen[row].sum()) <= max(1, round(int(valid.sum()) * 0.15))
    assert split_words == 0
    rate = chosen.sum().item() / (~special).sum().item()
    assert 0.13 < rate <= 0.15, rate
    inputs, labels = batch["input_ids"][chosen], batch["labels"][chosen]
    masked = (inputs == tok.mask_token_id).float().mean().item()
    kept = (inputs == labels).float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.03, (masked, kept)
    assert torch.equal(collate(examples)["input_ids"], batch["input_ids"])   # same (seed, epoch, example)
    collate.epoch = 1
    assert not torch.equal(collate(examples)["labels"], batch["labels"])   # a new epoch, new words


def test_mlm_evaluation_reports_accuracy(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "data.whole_word_masking": True}))
    assert 0 < metrics["mlm_accuracy"] < 1 and metrics["eval_loss"] > 0


def _lamb_reference(params, grads, lr, betas, eps, wd, adapt):
    """Algorithm 2 of You et al. (2020) written out in numpy, phi = identity: per tensor,
    m, v Adam moments with bias correction; u = m_hat / (sqrt(v_hat) + eps) + wd x;
    x <- x - lr * (||x|| / ||u||) * u where adapt (the ratio 1 when a norm is 0), else x - lr * u."""
    import numpy as np
    b1, b2 = betas
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    out = []
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps) + wd[i] * p
            w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(u)
            ratio = w_norm / u_norm if adapt[i] and w_norm > 0 and u_norm > 0 else 1.0
            params[i] = p - lr * ratio * u
        out.append([p.copy() for p in params])
    return out


@pytest.mark.parametrize("rule", ["decayed", "all"])
def test_lamb_follows_the_published_update_rule_step_by_step(rule):
    """decayed (the default: apex's FusedLAMB, NVIDIA's BERT) applies the trust ratio only where weight
    decay does; all, everywhere. tests/test_references.py checks the same against timm's Lamb."""
    import numpy as np

    from bert_recipes.optim import Lamb
    rng = np.random.default_rng(0)
    shapes = [(8, 4), (4,), (3, 3), (5,)]
    start = [rng.normal(size=s).astype(np.float64) for s in shapes]
    start[1][:] = 0.0   # a zero tensor: trust ratio 1
    grads = [[rng.normal(size=s) for s in shapes] for _ in range(6)]
    wd = [0.01, 0.0, 0.01, 0.0]
    tensors = [torch.nn.Parameter(torch.tensor(p)) for p in start]
    optimizer = Lamb([{"params": [tensors[0], tensors[2]], "weight_decay": 0.01},
                      {"params": [tensors[1], tensors[3]], "weight_decay": 0.0}], lr=0.02, betas=(0.9, 0.999),
                     eps=1e-6, trust_ratio=rule)
    adapt = [True, rule == "all", True, rule == "all"]
    expected = _lamb_reference([p.copy() for p in start], grads, 0.02, (0.9, 0.999), 1e-6, wd, adapt)
    for step, step_grads in enumerate(grads):
        for p, g in zip(tensors, step_grads):
            p.grad = torch.tensor(g)
        optimizer.step()
        for p, e in zip(tensors, expected[step]):
            # 1e-7, not float64's 1e-12: torch's fused Adam kernel (the moments and m_hat / (sqrt(v_hat) + eps))
            # takes its step count and scalars in float32 whatever the parameters' dtype
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-7, atol=1e-9)


def test_a_lamb_checkpoint_from_before_the_rule_key_resumes_with_one_line_on_the_rule(
        tmp_path, sample_dir, datasets_cache, shared_tokenizer, capfd):
    """A LAMB checkpoint saved under the old rule (its config has no optim.lamb_trust_ratio, as before
    2026-12-03, and was trained with the ratio on every tensor) resumes under the default with one line
    that says the rule changed, not a generic `None -> 'decayed'`; the run records the rule it follows."""
    import yaml

    from bert_recipes.checkpoint import CONFIG_FILE, complete_checkpoints, write_manifest
    out = tmp_path / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "optim.name": "lamb",
        "checkpoint.save_every": 4, "checkpoint.export": False})
    run_in_process(args + ["optim.lamb_trust_ratio=all", "train.halt_at_step=4"])
    checkpoint = complete_checkpoints(out)[-1]
    saved = yaml.safe_load((checkpoint / CONFIG_FILE).read_text())
    assert saved["optim"].pop("lamb_trust_ratio") == "all"
    (checkpoint / CONFIG_FILE).write_text(yaml.safe_dump(saved, sort_keys=False))
    write_manifest(checkpoint)   # as the old run wrote it
    capfd.readouterr()
    metrics = run_in_process(args + ["checkpoint.resume=auto"])
    log = capfd.readouterr().out
    lines = [line for line in log.splitlines() if line.startswith("[resume]") and "trust ratio" in line]
    assert len(lines) == 1 and "every tensor" in lines[0] and "--optim.lamb_trust_ratio=all" in lines[0], log
    assert "lamb_trust_ratio: None" not in log and "the config differs" not in log, log
    assert metrics["steps"] == 8
    assert yaml.safe_load((complete_checkpoints(out)[-1] / CONFIG_FILE).read_text())["optim"]["lamb_trust_ratio"] \
        == "decayed"


def test_lamb_with_polynomial_decay_trains_and_is_refused_where_shards_break_it(tmp_path, sample_dir, datasets_cache,
                                                                               shared_tokenizer):
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.optim import lr_factor
    assert lr_factor(0, 2, 10, "polynomial", 0.0, 0.5) == 0.5                       # warmup
    assert lr_factor(6, 2, 10, "polynomial", 0.0, 0.5) == pytest.approx(0.5 ** 0.5)   # (1 - 4/8) ** 0.5
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 24, "optim.name": "lamb", "optim.lr": 5e-2,
        "optim.decay": "polynomial", "optim.poly_power": 0.5}))
    assert metrics["last_train_loss"] < metrics["first_train_loss"] - 0.3, metrics
    cfg = load_config(REPO / "recipes/bert-large-mlm.yaml")
    for plan in (LaunchPlan(deepspeed=True, ds_config={"zero_optimization": {"stage": 2}}), LaunchPlan(fsdp=True)):
        with pytest.raises(ConfigError, match="optim.name=lamb needs whole parameter tensors"):
            check_consistency(cfg, plan, 8, 32, has_cuda=False)
    check_consistency(cfg, LaunchPlan(), 8, 32, has_cuda=False)   # DDP


def test_prepared_data_is_what_tokenizing_gives_and_every_rank_maps_it(tmp_path, sample_dir, datasets_cache,
                                                                        shared_tokenizer):
    """make prepare writes the tokenized splits (MLM a line a row: packed MLM has its token stores, tests/test_store.py)
    once; a 2-process DDP run then memory-maps them (no tokenizing) and trains; the prepared rows are the ones
    tokenizing on the fly gives; a recipe whose settings differ from the prepared ones is refused."""
    import json
    import sys

    from bert_recipes.config import validate
    from bert_recipes.data import prepare_data
    from datasets import DatasetDict
    args = tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer,
                                                                        "data.packing": False})
    prepared = tmp_path / "prepared"
    proc = subprocess.run([sys.executable, "tools/prepare.py", "--recipe", str(REPO / "recipes/tiny-mlm.yaml"),
                           "--out", str(prepared), *[f"--{a}" for a in args]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((prepared / "prepared.json").read_text())
    assert meta["splits"]["train"] > 1000 and meta["peak_rss_mb"]["main"] > 0
    cfg = load_config(REPO / "recipes/tiny-mlm.yaml", args)
    validate(cfg)
    _, fresh, _, _ = prepare_data(cfg.data, cfg.task, cfg.tokenizer, cfg.model.name_or_path, cfg.run.seed,
                                  tmp_path / "fresh", True, lambda: None)
    mapped = DatasetDict.load_from_disk(str(prepared / "data"))
    assert len(mapped["train"]) == len(fresh["train"]) and mapped["train"][:50] == fresh["train"][:50]
    use = args + ["data.source=prepared", f"data.prepared_dir={prepared}"]
    metrics = launch(2, ["run.output_dir=" + str(tmp_path / "from_prepared")] + use[1:])
    assert metrics["final"]["num_processes"] == 2 and metrics["final"]["steps"] == 24
    log = (tmp_path / "from_prepared.log").read_text()
    assert "tokenizing:" not in log and "Generating train split" not in log   # datasets' bars: nothing read or mapped
    with pytest.raises(ConfigError, match=r"was prepared with other settings \(data.max_seq_length: prepared 32, "
                                          r"this run 64\)"):
        run_in_process(use + ["data.max_seq_length=64", f"run.output_dir={tmp_path / 'refused'}"])
