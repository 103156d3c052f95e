"""Model construction. The model knows nothing about parallelism: train.py hands it to
Accelerate, which applies whichever backend the launch config names."""
from __future__ import annotations

import json
from pathlib import Path

import torch.nn.functional as F
from transformers import BertForMaskedLM
from transformers.modeling_outputs import MaskedLMOutput

from .config import ConfigError, ModelConfig, TaskConfig, first_line


def masked_lm_loss(logits, labels):
    """Cross-entropy averaged over the labelled tokens, in fp32; 0, not NaN, for a batch in which no
    token was masked (a short sequence can draw none), so such a step is not taken for a divergence."""
    total = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum().clamp(min=1)


def per_sample_mlm_loss(logits, labels):
    """-> (summed loss, labelled tokens) of each sample, so an evaluation's mean is over all tokens of
    all ranks. `logits`: (batch, seq, vocab), or one row per labelled token (the sparse head)."""
    import torch
    selected = labels != -100
    if logits.dim() == 2:
        token_loss = F.cross_entropy(logits.float(), labels[selected], reduction="none")
        sums = torch.zeros(len(labels), device=logits.device).index_add_(0, selected.nonzero()[:, 0], token_loss)
    else:
        sums = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(1)
    return sums, selected.sum(1)


class RecipeBertForMaskedLM(BertForMaskedLM):
    """BertForMaskedLM with two changes that leave the maths and the exported weights alone:

    - The decoder bias is registered once. Hugging Face registers the same Parameter twice
      (`cls.predictions.bias` and `cls.predictions.decoder.bias`), which FSDP2 rejects when the
      two names land in different shard groups. Here the decoder is bias-free and the head adds
      `cls.predictions.bias`; an export loads into a plain BertForMaskedLM, which re-ties them.
    - `sparse_head` (model.sparse_mlm_head): with labels, the prediction head runs on the masked
      positions only. The head (transform + vocab projection) is the largest matmul of a small
      BERT and ~85% of its rows are discarded by the loss; gathering the selected positions first
      gives the same loss and gradients at a fraction of the cost (as in NVIDIA's and cramming's
      BERT). Then `logits` holds one row per selected token, in row-major order of the labels.
    """
    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    sparse_head = True

    def __init__(self, config):
        super().__init__(config)
        self.cls.predictions.decoder.bias = None

    def head(self, hidden):
        predictions = self.cls.predictions
        return predictions.decoder(predictions.transform(hidden)) + predictions.bias

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        hidden = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                           position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True,
                           **kwargs).last_hidden_state
        if labels is None:
            return MaskedLMOutput(logits=self.head(hidden))
        if self.sparse_head:
            selected = labels != -100
            logits = self.head(hidden[selected])
            return MaskedLMOutput(loss=masked_lm_loss(logits, labels[selected]), logits=logits)
        logits = self.head(hidden)
        return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), labels.view(-1)), logits=logits)

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        config_file = Path(save_directory) / "config.json"
        if config_file.exists():   # exported as what it is: a BertForMaskedLM
            config = json.loads(config_file.read_text())
            config["architectures"] = ["BertForMaskedLM"]
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def model_config(model_cfg: ModelConfig, task: TaskConfig, vocab_size: int, pad_token_id: int | None):
    """The model's config: the checkpoint's (model.name_or_path) or a fresh BertConfig from the
    recipe's fields, with the recipe's dropout and the task's labels on top."""
    from transformers import AutoConfig, BertConfig

    overrides = {k: v for k, v in (("hidden_dropout_prob", model_cfg.hidden_dropout_prob),
                                   ("attention_probs_dropout_prob", model_cfg.attention_probs_dropout_prob))
                 if v is not None}
    if task.kind == "classification":
        overrides["num_labels"] = task.num_labels
        overrides["problem_type"] = "regression" if task.num_labels == 1 else "single_label_classification"
        if task.label_names:
            overrides["id2label"] = dict(enumerate(task.label_names))
            overrides["label2id"] = {n: i for i, n in enumerate(task.label_names)}
    if model_cfg.name_or_path:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code,
                                                **overrides)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path}: cannot load its config "
                              f"({first_line(err)}); give a Hugging Face model directory or a Hub name") from None
        if task.kind == "mlm" and config.model_type != "bert":
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path} is a {config.model_type} model; "
                             "mlm pretraining here builds BERT (model_type bert)")
        return config
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_hidden_layers, num_attention_heads=model_cfg.num_attention_heads,
        intermediate_size=model_cfg.intermediate_size, max_position_embeddings=model_cfg.max_position_embeddings,
        pad_token_id=pad_token_id, **overrides)
    config._attn_implementation = model_cfg.attn_implementation
    return config


def check_sequence_length(model_cfg: ModelConfig, task: TaskConfig, max_seq_length: int) -> None:
    """A pretrained model has position embeddings for so many tokens; longer sequences would index past them."""
    if model_cfg.name_or_path:
        limit = model_config(model_cfg, task, 0, None).max_position_embeddings
        if max_seq_length > limit:
            raise ConfigError(f"data.max_seq_length={max_seq_length} exceeds the max_position_embeddings={limit} of "
                              f"model.name_or_path={model_cfg.name_or_path}; use at most {limit}")


def build_model(model_cfg: ModelConfig, task: TaskConfig, tokenizer=None, config=None):
    """BertForMaskedLM or BertForSequenceClassification, from a checkpoint or a fresh BertConfig
    (`config`, when given, instead of one derived from the tokenizer)."""
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    if config is None:
        config = model_config(model_cfg, task, len(tokenizer), tokenizer.pad_token_id)
    if model_cfg.name_or_path:
        auto = RecipeBertForMaskedLM if task.kind == "mlm" else AutoModelForSequenceClassification
        try:
            model = auto.from_pretrained(model_cfg.name_or_path, config=config, trust_remote_code=model_cfg.trust_remote_code,
                                         attn_implementation=model_cfg.attn_implementation)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path}: cannot load its weights "
                              f"({first_line(err)})") from None
        if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model.name_or_path="
                              f"{model_cfg.name_or_path} has vocab_size {model.config.vocab_size}: they do not belong "
                              "together; use the model's own tokenizer (leave tokenizer.name_or_path unset)")
    else:
        model = (RecipeBertForMaskedLM if task.kind == "mlm" else BertForSequenceClassification)(config)
    if task.kind == "mlm":
        model.sparse_head = model_cfg.sparse_mlm_head
    if model_cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

