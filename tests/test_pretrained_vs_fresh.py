"""tools/pretrained_vs_fresh.py: a twin recipe fine-tuned from a pretrained export, from a fresh model of its shape and
tokenizer, and (the positive control) from the export's weights shuffled within each tensor, on the same seed; its
report holds each start's score. Which start wins is a measurement (docs/config.md), not asserted here; what each
start is, is. Bad input is one line, and nothing is written."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_in_process, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import pretrained_vs_fresh as tool  # noqa: E402 (tools/pretrained_vs_fresh.py)

SHORT = ["--train.epochs=null", "--train.max_steps=3", "--train.eval_every=null", "--data.max_eval_samples=32"]


def test_each_start_is_what_it_says(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    pretrain = tmp_path / "pretrain"
    run_in_process(tiny_args(pretrain, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2, "model.max_position_embeddings": 128}))
    export, out = pretrain / "model", tmp_path / "pvf"
    assert tool.main(["--recipes", "tiny-ner", "--seeds", "1", "--control", "permuted", "--from", str(export),
                      "--sample-dir", str(sample_dir), "--out", str(out), "--", *SHORT]) == 0
    report = json.loads((out / "pvf.json").read_text())
    row = report["recipes"]["tiny-ner"]
    assert row["metric"] == "f1" and set(row["scores"]) == {"pretrained", "fresh", "permuted"}
    assert all(len(v) == 1 and 0 <= v[0] <= 1 for v in row["scores"].values()) and set(row["ahead"]) == {
        "pretrained over fresh", "permuted over fresh", "pretrained over permuted"}
    assert f"[pvf] tiny-ner: f1: pretrained {row['scores']['pretrained'][0]:.4f}" in capsys.readouterr().out
    configs = {name: json.loads((out / f"tiny-ner/{name}-1/metrics.json").read_text())["config"]
               for name in ("pretrained", "fresh", "permuted")}
    assert all(config["run/seed"] == 1 for config in configs.values())
    assert configs["pretrained"]["model/name_or_path"] == str(export)
    assert configs["permuted"]["model/name_or_path"] == str(out / "permuted")
    shape, fresh = json.loads((export / "config.json").read_text()), configs["fresh"]
    assert fresh["model/name_or_path"] == "None" and fresh["tokenizer/name_or_path"] == str(export)
    assert all(fresh[f"model/{key}"] == shape[key] for key in ("hidden_size", "num_hidden_layers",
                                                              "num_attention_heads", "intermediate_size"))
    ours, shuffled = load_file(export / "model.safetensors"), load_file(out / "permuted/model.safetensors")
    assert set(ours) == set(shuffled)
    for name, t in ours.items():   # the same values, in another order
        assert torch.equal(t.flatten().sort().values, shuffled[name].flatten().sort().values), name
    big = max(ours, key=lambda n: ours[n].numel())
    assert not torch.equal(ours[big], shuffled[big])


@pytest.mark.parametrize("argv, said", [
    (["--recipes", "tiny-mlm"],
     "--recipes tiny-mlm: not a twin (one of tiny-classify, tiny-ner, tiny-squad, tiny-retrieval)"),
    (["--from", "/nonexistent/model"], "--from /nonexistent/model: no exported model there"),
], ids=["not-a-twin", "no-export"])
def test_bad_input_is_one_line_and_writes_nothing(argv, said, tmp_path, capsys):
    out = tmp_path / "pvf"
    assert tool.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and err.count("\n") == 1
    assert not out.exists()
