"""Phases that chain (checkpoint.init_from, bert_recipes/phases.py): a run starts from another run's checkpoint with
its weights (and with checkpoint.init_optimizer its optimizer's state), its own schedule, data position and
generators from step 0. Checked against the run that starts from the same weights by model.name_or_path (the export):
equal losses and weights, bit for bit; the optimizer's state carried over changes the steps after the first (the
control); a phase halted and resumed resumes itself, bit-exact; a RoPE model's positions grow, BERT's stay the
checkpoint's (one line); each bad value one line. The shipped tiny phase recipes chain as shipped
(test_the_tiny_modernbert_phase_recipes_chain); every shipped recipe's first steps on each ZeRO stage:
tests/test_recipes.py."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import assert_same_weights, refused_in_process, run_in_process, tiny_args

# ModernBERT (no dropout: a run from an export and one from a checkpoint draw nothing that could differ)
MODERN = {"model.architecture": "modernbert", "model.local_attention": 16, "model.global_attn_every_n_layers": 2,
          "model.global_rope_theta": 10000, "logging.log_every": 1}


def args(out: Path, sample_dir, datasets_cache, **extra) -> list[str]:
    return tiny_args(out, sample_dir, datasets_cache, **{**MODERN, **extra})


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads((out / "metrics.json").read_text())["history"]["train"]]


def test_a_phase_starts_from_a_checkpoint_as_from_its_export(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                             capsys):
    """Phase 1 (12 steps) -> phase 2 from its run directory (the latest checkpoint, step 12), a new optimizer state:
    the losses and weights of the same phase 2 started from phase 1's export (model.name_or_path), bit for bit; the
    tokenizer is phase 1's without being named. With checkpoint.init_optimizer the first step's loss is the same and
    the later ones differ (AdamW's moments carried over). That phase, halted at step 4 and resumed with the same
    command, resumes itself: the uninterrupted phase's losses and weights, bit for bit."""
    one = tmp_path / "phase1"
    run_in_process(args(one, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer,
                                                             "checkpoint.save_every": 6, "train.max_steps": 12}))
    capsys.readouterr()
    phase2 = {"train.max_steps": 8, "optim.warmup_steps": 0, "optim.lr": 1e-3}
    run_in_process(args(tmp_path / "from-ckpt", sample_dir, datasets_cache, **phase2,
                        **{"checkpoint.init_from": one}))
    said = capsys.readouterr().out
    assert f"[init] tokenizer.name_or_path={one / 'tokenizer'}: the tokenizer the checkpoint was trained with" in said
    assert (f"[init] from {one / 'checkpoints/step_00000012'} (step 12 of {one}): the weights (a new optimizer state: "
            "checkpoint.init_optimizer=false); the step, this recipe's lr schedule, the data position and the random "
            "generators start anew") in said
    run_in_process(args(tmp_path / "from-export", sample_dir, datasets_cache, **phase2,
                        **{"model.name_or_path": one / "model", "tokenizer.name_or_path": one / "tokenizer"}))
    assert losses(tmp_path / "from-ckpt") == losses(tmp_path / "from-export")
    assert_same_weights(tmp_path / "from-ckpt/model/model.safetensors", tmp_path / "from-export/model/model.safetensors",
                        0.0)
    saved = json.loads((tmp_path / "from-ckpt/metrics.json").read_text())["config"]["checkpoint/init_from"]
    assert saved == str(one / "checkpoints/step_00000012")   # the run's config names the checkpoint itself

    carried = {**phase2, "checkpoint.init_from": one, "checkpoint.init_optimizer": True}
    run_in_process(args(tmp_path / "carried", sample_dir, datasets_cache, **carried))
    assert "the weights and the optimizer's state (checkpoint.init_optimizer)" in capsys.readouterr().out
    fresh, moments = losses(tmp_path / "from-ckpt"), losses(tmp_path / "carried")
    assert moments[0] == fresh[0] and all(a != b for a, b in zip(moments[1:], fresh[1:]))

    run_in_process(args(tmp_path / "split", sample_dir, datasets_cache, **carried, **{"train.halt_at_step": 4}))
    capsys.readouterr()
    run_in_process(args(tmp_path / "split", sample_dir, datasets_cache, **carried, **{"checkpoint.resume": "auto"}))
    out = capsys.readouterr().out
    assert "[resume] from" in out and "[init] from" not in out
    assert losses(tmp_path / "split") == moments
    assert_same_weights(tmp_path / "carried/model/model.safetensors", tmp_path / "split/model/model.safetensors", 0.0)


def test_a_rope_model_grows_its_context_and_bert_keeps_its_positions(tmp_path, sample_dir, datasets_cache,
                                                                      shared_tokenizer, capsys):
    """A ModernBERT phase at twice the sequence, max_position_embeddings and the global RoPE base starts from a
    shorter one's checkpoint (RoPE has no weight of that shape) and trains; BERT's learned positions are a weight of
    that shape: the same change is one line, nothing written."""
    short = {"tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 4}
    run_in_process(args(tmp_path / "short", sample_dir, datasets_cache, **short))
    longer = {"data.max_seq_length": 64, "model.max_position_embeddings": 128, "model.global_rope_theta": 160000,
              "train.max_steps": 4, "checkpoint.init_from": tmp_path / "short"}
    result = run_in_process(args(tmp_path / "long", sample_dir, datasets_cache, **longer))
    assert result["steps"] == 4 and "[init] from" in capsys.readouterr().out
    bert = {"tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 4}
    run_in_process(tiny_args(tmp_path / "bert", sample_dir, datasets_cache, **bert))
    argv = [f"--{a}" for a in tiny_args(tmp_path / "bert-long", sample_dir, datasets_cache, **{
        "data.max_seq_length": 64, "model.max_position_embeddings": 128, "checkpoint.init_from": tmp_path / "bert"})]
    line = refused_in_process(argv, tmp_path, capsys)
    assert (f"checkpoint.init_from: {tmp_path / 'bert/checkpoints/step_00000004'} holds a model of another shape than "
            "this run's (model.max_position_embeddings: 64 in the checkpoint, 128 now)") in line


def test_bad_phase_settings_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    cases = [({"checkpoint.init_optimizer": True}, "checkpoint.init_optimizer=true needs checkpoint.init_from"),
             ({"checkpoint.init_from": empty}, f"checkpoint.init_from={empty} holds no complete checkpoint"),
             ({"checkpoint.init_from": empty, "model.name_or_path": empty},
              f"checkpoint.init_from={empty} and model.name_or_path={empty} both give the weights")]
    for extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path / "run", capsys)
    source = tmp_path / "source"
    run_in_process(tiny_args(source, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer,
                                                                     "train.max_steps": 2}))
    argv = [f"--{a}" for a in tiny_args(source, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "checkpoint.init_from": source, "run.overwrite": True})]
    assert f"checkpoint.init_from={source} is inside this run's run.output_dir={source}" in refused_in_process(
        argv, source, capsys)


def test_phases_chain_on_2_processes_and_under_the_pipeline(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """DDP on 2 processes: phase 2 from phase 1's checkpoint equals phase 2 from its export, bit for bit (real
    processes, the same layout). The pipeline engine (2 stages, BERT) starts a phase from its own checkpoint: its
    first loss is nearer phase 1's last than a new model's first."""
    from conftest import launch
    base = {"tokenizer.name_or_path": shared_tokenizer}
    one = launch(2, args(tmp_path / "ddp1", sample_dir, datasets_cache, **base, **{"train.max_steps": 8}))
    assert one["final"]["num_processes"] == 2 and one["final"]["backend"]["name"] == "ddp"
    phase2 = {"train.max_steps": 6, "optim.warmup_steps": 0}
    two = launch(2, args(tmp_path / "ddp2", sample_dir, datasets_cache, **phase2,
                         **{"checkpoint.init_from": tmp_path / "ddp1"}))
    assert two["final"]["num_processes"] == 2 and two["final"]["backend"]["name"] == "ddp"
    assert "[init] from" in (tmp_path / "ddp2.log").read_text()
    launch(2, args(tmp_path / "export2", sample_dir, datasets_cache, **phase2, **{
        "model.name_or_path": tmp_path / "ddp1/model", "tokenizer.name_or_path": tmp_path / "ddp1/tokenizer"}))
    assert losses(tmp_path / "ddp2") == losses(tmp_path / "export2")

    bert = {**base, "model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}
    first = launch(2, tiny_args(tmp_path / "pipe1", sample_dir, datasets_cache, **bert), backend="pipeline")
    assert first["final"]["num_processes"] == 2 and first["final"]["backend"]["name"] == "pipeline"
    second = launch(2, tiny_args(tmp_path / "pipe2", sample_dir, datasets_cache, **bert, **{
        "checkpoint.init_from": tmp_path / "pipe1", "checkpoint.init_optimizer": True, "train.max_steps": 4}),
        backend="pipeline")
    assert second["final"]["num_processes"] == 2 and second["final"]["backend"]["name"] == "pipeline"
    assert second["final"]["steps"] == 4 and "[init] from" in (tmp_path / "pipe2.log").read_text()
    new, trained = losses(tmp_path / "pipe1")[0], losses(tmp_path / "pipe1")[-1]   # a new model's, phase 1's end
    assert trained < new - 0.5 and losses(tmp_path / "pipe2")[0] < (new + trained) / 2   # nearer phase 1's end


def test_a_phase_takes_the_weights_of_any_backend_and_process_count(tmp_path, sample_dir, datasets_cache,
                                                                    shared_tokenizer, capsys):
    """Phase 1 under DDP on 1 process -> phase 2 under ZeRO-2 on 2 (real processes): the weights alone, read whole
    from the DDP checkpoint, give phase 2 the losses of the same phase started from phase 1's export, bit for bit.
    The same start with checkpoint.init_optimizer is one line (the optimizer's state stays under the backend that
    saved it), nothing written."""
    from conftest import launch, refused_launched
    one = tmp_path / "ddp1"
    run_in_process(args(one, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer,
                                                             "train.max_steps": 8}))
    phase2 = {"train.max_steps": 6, "optim.warmup_steps": 0}
    two = launch(2, args(tmp_path / "zero2", sample_dir, datasets_cache, **phase2, **{"checkpoint.init_from": one}),
                 backend="zero2")
    assert two["final"]["num_processes"] == 2 and two["final"]["backend"]["name"] == "zero2"
    log = (tmp_path / "zero2.log").read_text()
    assert (f"[init] {one / 'checkpoints/step_00000008'} was saved by 1 processes under ddp: its full weights are read "
            "and this run's zero2 lays them out on its 2") in log and "[init] from" in log
    launch(2, args(tmp_path / "export", sample_dir, datasets_cache, **phase2, **{
        "model.name_or_path": one / "model", "tokenizer.name_or_path": one / "tokenizer"}), backend="zero2")
    assert losses(tmp_path / "zero2") == losses(tmp_path / "export")
    error = refused_launched(args(tmp_path / "carried", sample_dir, datasets_cache, **phase2, **{
        "checkpoint.init_from": one, "checkpoint.init_optimizer": True}), tmp_path, "zero2")
    assert ("was saved by 1 processes under ddp (1 data-parallel replicas) and this run has 1 under zero2 (1 "
            "data-parallel replicas): an optimizer's state is carried over only under the backend that saved it; drop "
            "checkpoint.init_optimizer (the weights alone start under any backend and process count) or start under "
            "ddp") in error, error


def test_the_tiny_modernbert_phase_recipes_chain(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """recipes/tiny-modernbert-{mlm,context,decay}.yaml as shipped, cut to a few steps and pointed at each other's
    directories here: each phase starts from the one before and says what it carried over; the context phase runs
    at 256 tokens with the global RoPE base 160,000, the decay phase's lr falls to 0 at its last step."""
    import yaml
    repo = Path(__file__).resolve().parent.parent
    common = [f"data.sample_dir={sample_dir}", f"data.cache_dir={datasets_cache}", "logging.trackers=[]",
              "logging.progress_bar=false", "logging.plot=false", "data.max_eval_samples=32", "logging.log_every=1",
              "train.eval_every=null"]
    mlm, context, decay = (tmp_path / name for name in ("mlm", "context", "decay"))
    run_in_process([f"run.output_dir={mlm}", f"tokenizer.name_or_path={shared_tokenizer}", "train.max_steps=6",
                    "data.max_train_samples=800", *common], recipe=str(repo / "recipes/tiny-modernbert-mlm.yaml"))
    capsys.readouterr()
    run_in_process([f"run.output_dir={context}", f"checkpoint.init_from={mlm}", "train.max_steps=4",
                    "data.max_train_samples=200", *common], recipe=str(repo / "recipes/tiny-modernbert-context.yaml"))
    said = capsys.readouterr().out
    assert f"[init] from {mlm / 'checkpoints/step_00000006'} (step 6 of {mlm}): the weights and the optimizer's state" \
        in said and f"[init] tokenizer.name_or_path={mlm / 'tokenizer'}" in said
    config = yaml.safe_load((context / "config.yaml").read_text())
    assert config["data"]["max_seq_length"] == 256 and config["model"]["global_rope_theta"] == 160000
    sources = yaml.safe_load((repo / "recipes/tiny-modernbert-decay.yaml").read_text())["data"]["mixture"]
    for source in sources:
        source["files"] = [str(sample_dir / Path(f).relative_to("data/sample")) for f in source["files"]]
    result = run_in_process([f"run.output_dir={decay}", f"checkpoint.init_from={context}", "train.max_steps=4",
                             "data.max_train_samples=200", f"data.mixture={json.dumps(sources)}", *common],
                            recipe=str(repo / "recipes/tiny-modernbert-decay.yaml"))
    assert result["steps"] == 4 and f"[init] from {context / 'checkpoints/step_00000004'}" in capsys.readouterr().out
    lrs = [r["lr"] for r in json.loads((decay / "metrics.json").read_text())["history"]["train"]]
    assert lrs[0] < 1e-3 and lrs == sorted(lrs, reverse=True)
