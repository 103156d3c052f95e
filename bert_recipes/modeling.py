"""Model construction. The model knows nothing about parallelism: train.py hands it to
Accelerate, which applies whichever backend the launch config names."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertForMaskedLM, BertForSequenceClassification
from transformers.modeling_outputs import MaskedLMOutput, SequenceClassifierOutput

from .config import ConfigError, ModelConfig, TaskConfig, first_line


def masked_lm_loss(logits, labels):
    """Cross-entropy averaged over the labelled tokens, in fp32; 0, not NaN, for a batch in which no
    token was masked (a short sequence can draw none), so such a step is not taken for a divergence."""
    total = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum().clamp(min=1)


def per_sample_mlm_loss(logits, labels):
    """-> (summed loss, labelled tokens, correctly predicted tokens) of each sample, so an evaluation's
    means are over all tokens of all ranks. `logits`: (batch, seq, vocab), or one row per labelled
    token (the sparse head)."""
    import torch
    selected = labels != -100
    if logits.dim() == 2:
        rows = selected.nonzero()[:, 0]
        token_loss = F.cross_entropy(logits.float(), labels[selected], reduction="none")
        sums = torch.zeros(len(labels), device=logits.device).index_add_(0, rows, token_loss)
        hits = (logits.argmax(-1) == labels[selected]).float()
        correct = torch.zeros(len(labels), device=logits.device).index_add_(0, rows, hits)
    else:
        sums = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(1)
        correct = ((logits.argmax(-1) == labels) & selected).sum(1).float()
    return sums, selected.sum(1), correct


def slot_labels(labels, masked_positions):
    """The labels of the K position slots (data.MLMCollator): the chosen tokens' labels, then -100 for
    the unused slots (which point at position 0, possibly a chosen token: counted once, not twice)."""
    used = torch.arange(masked_positions.size(1), device=labels.device) < (labels != -100).sum(1, keepdim=True)
    return labels.gather(1, masked_positions).masked_fill(~used, -100)



def predictions(task, logits):
    """Class ids, or the value of a regression (num_labels 1), from a batch's logits."""
    return logits.squeeze(-1).float() if task.num_labels == 1 else logits.argmax(-1)


def batch_rows(task, logits, labels, masked_positions=None) -> dict:
    """One evaluation batch's per-sample rows (device tensors), the same for every engine: the MLM
    loss sum, labelled tokens and hits of each sample; or predictions and references.
    masked_positions: the static head's K slots (its logits have one row per slot)."""
    if task.kind == "mlm":
        if masked_positions is not None:
            labels = slot_labels(labels, masked_positions)
        sums, counts, correct = per_sample_mlm_loss(logits, labels)
        return {"loss_sums": sums, "token_counts": counts, "correct": correct}
    return {"preds": predictions(task, logits), "refs": labels}

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

    attention_path: str | None = None   # attention.use_path: how a batch's documents attend within themselves

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, masked_positions=None, document_ids=None, cu_seqlens=None,
                max_seqlen=None, sequence_starts=None, **kwargs):
        if document_ids is not None:   # a packed row of documents, or a batch run unpadded (bert_recipes/attention.py)
            kwargs.update(document_kwargs(self, document_ids, cu_seqlens, max_seqlen))
            attention_mask, position_ids = kwargs.pop("attention_mask", None), kwargs.pop("position_ids")
        hidden = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                           position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True,
                           **kwargs).last_hidden_state
        if labels is None:
            return MaskedLMOutput(logits=self.head(hidden))
        if masked_positions is not None and sequence_starts is not None:
            # unpadded (data.unpad): one row of every sequence; each sequence's K slots index that row, an unused
            # slot its own first token ([CLS], never a label): the padded path's tokens, loss and mean
            logits = self.head(hidden[0][masked_positions])           # (batch, K, vocab): an index tensor, no mask
            targets = labels[0][masked_positions]
            return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), targets.view(-1)),
                                  logits=logits)
        if masked_positions is not None:
            # Static shapes (data.max_predictions_per_seq): the collator gives K positions per
            # sequence, the masked ones first, then unused slots pointing at position 0, which may be
            # a masked token of a packed block: those slots are ignored here (-100), so every masked
            # token counts once. No boolean indexing: no host sync, and torch.compile sees the same
            # shapes every step. The loss is the one of the boolean path: the same tokens, the same mean.
            index = masked_positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
            logits = self.head(hidden.gather(1, index))                        # (batch, K, vocab)
            targets = slot_labels(labels, masked_positions)
            return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), targets.view(-1)),
                                  logits=logits)
        if self.sparse_head:
            selected = labels != -100
            logits = self.head(hidden[selected])
            return MaskedLMOutput(loss=masked_lm_loss(logits, labels[selected]), logits=logits)
        logits = self.head(hidden)
        return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), labels.view(-1)), logits=logits)

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        exported_as(save_directory, "BertForMaskedLM")


class RecipeBertForSequenceClassification(BertForSequenceClassification):
    """BertForSequenceClassification that also takes a batch run unpadded (data.unpad): one row holding every
    sequence's real tokens, each attending within itself with its own positions (bert_recipes/attention.py); the
    pooled output is each sequence's first token's, as the padded path pools. The weights, the padded path and the
    export are BertForSequenceClassification's."""
    attention_path: str | None = None

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                document_ids=None, cu_seqlens=None, max_seqlen=None, sequence_starts=None, **kwargs):
        if document_ids is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   position_ids=position_ids, labels=labels, **kwargs)
        extra = document_kwargs(self, document_ids, cu_seqlens, max_seqlen)
        hidden = self.bert(input_ids, token_type_ids=token_type_ids, return_dict=True, **extra).last_hidden_state
        pooled = self.bert.pooler.activation(self.bert.pooler.dense(hidden[0, sequence_starts]))
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = (F.mse_loss(logits.squeeze(-1).float(), labels.float()) if self.num_labels == 1
                    else F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1)))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        exported_as(save_directory, "BertForSequenceClassification")


def exported_as(save_directory, architecture: str) -> None:
    """An export's config.json names the plain transformers class it loads as (the recipe's subclasses change no
    weight)."""
    config_file = Path(save_directory) / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        config["architectures"] = [architecture]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def document_kwargs(model, document_ids, cu_seqlens, max_seqlen) -> dict:
    """BertModel's keyword arguments for a batch with document ids, by the model's attention path (the run's plan
    set it: attention.use_path); the mask path's additive mask in the embeddings' dtype (eager attention)."""
    from .attention import document_attention
    path = model.attention_path or "mask"
    dtype = model.bert.embeddings.word_embeddings.weight.dtype
    return document_attention(path, document_ids, model.config._attn_implementation, dtype, cu_seqlens, max_seqlen)


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


def load_pretrained(model_cfg: ModelConfig, task: TaskConfig, config):
    """The task's model from a checkpoint in any standard BERT layout: BertForPreTraining (MLM + NSP
    heads), BertForMaskedLM, BertModel (no head), BertForSequenceClassification. What the checkpoint
    lacks is initialised here and what the task does not use is dropped; both are reported in
    `model.loading_report`. A checkpoint that would leave the encoder itself random is refused, and
    so is a classifier for another label count unless model.reinit_head asks for a new one."""
    import contextlib
    import io

    from transformers import AutoModelForSequenceClassification
    name = model_cfg.name_or_path
    auto = (RecipeBertForMaskedLM if task.kind == "mlm" else RecipeBertForSequenceClassification
            if config.model_type == "bert" else AutoModelForSequenceClassification)
    try:
        with contextlib.redirect_stderr(io.StringIO()), _transformers_quiet():   # our own report instead
            model, info = auto.from_pretrained(name, config=config, trust_remote_code=model_cfg.trust_remote_code,
                                               attn_implementation=model_cfg.attn_implementation,
                                               output_loading_info=True, ignore_mismatched_sizes=model_cfg.reinit_head)
    except RuntimeError as err:
        if "mismatch" not in str(err):
            raise
        raise ConfigError(f"model.name_or_path={name} has a head whose shape does not fit this task (task.num_labels="
                          f"{task.num_labels}; a checkpoint fine-tuned for another label count): set "
                          "model.reinit_head=true to start a new classifier on its encoder") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.name_or_path={name}: cannot load its weights ({first_line(err)})") from None
    missing = set(info["missing_keys"]) | {k for k, *_ in info["mismatched_keys"]}
    encoder = sorted(k for k in missing if not k.startswith(("cls.", "classifier.", "bert.pooler.")))
    if encoder:
        raise ConfigError(f"model.name_or_path={name} has no weights for {len(encoder)} tensors of the BERT encoder "
                          f"(e.g. {encoder[0]}): training would start from random weights; give a BERT checkpoint "
                          "(BertForPreTraining, BertForMaskedLM, BertModel or BertForSequenceClassification)")
    loaded = len(model.state_dict()) - len(missing)
    report = f"[model] from {name}: {loaded} tensors loaded"
    if missing:
        report += f"; new here (no trained values in the checkpoint): {_grouped(missing)}"
    if info["unexpected_keys"]:
        report += f"; unused from the checkpoint (heads this task does not have): {_grouped(info['unexpected_keys'])}"
    model.loading_report = report
    return model


def _grouped(keys) -> str:
    """cls.predictions.transform.dense.weight, ... -> cls.predictions.*"""
    groups = sorted({".".join(k.split(".")[:2]) + (".*" if k.count(".") > 1 else "") for k in keys})
    return ", ".join(groups)


def _transformers_quiet():
    import contextlib

    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet():
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            hf_logging.set_verbosity(level)
    return quiet()


def build_model(model_cfg: ModelConfig, task: TaskConfig, tokenizer=None, config=None, packed_dropout: bool = False,
                attention_path: str | None = None):
    """BertForMaskedLM or BertForSequenceClassification, from a checkpoint or a fresh BertConfig
    (`config`, when given, instead of one derived from the tokenizer), with the recipe's attention
    (bert_recipes.dropout; packed_dropout: config.packed_dropout_here's answer for this run) and, for document masks
    or unpadded batches, the plan's attention path (attention.use_path)."""
    if config is None:
        config = model_config(model_cfg, task, len(tokenizer), tokenizer.pad_token_id)
    if model_cfg.name_or_path:
        model = load_pretrained(model_cfg, task, config)
        if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model.name_or_path="
                              f"{model_cfg.name_or_path} has vocab_size {model.config.vocab_size}: they do not belong "
                              "together; use the model's own tokenizer (leave tokenizer.name_or_path unset)")
    else:
        model = (RecipeBertForMaskedLM if task.kind == "mlm" else RecipeBertForSequenceClassification)(config)
    if task.kind == "mlm":
        model.sparse_head = model_cfg.sparse_mlm_head
    from .attention import use_path
    from .dropout import use_recipe_attention
    use_recipe_attention(model, packed_dropout)
    if attention_path is not None:
        if not hasattr(model, "attention_path"):
            raise ConfigError(f"data.document_mask and data.unpad need a BERT model; model.name_or_path="
                              f"{model_cfg.name_or_path} is a {model.config.model_type} model: set them false")
        use_path(model, attention_path)
    if model_cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

