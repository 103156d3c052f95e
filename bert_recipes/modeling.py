"""Model construction. The model knows nothing about parallelism: train.py hands it to
Accelerate, which applies whichever backend the launch config names."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import MaskedLMOutput

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

class RecipeMaskedLM:
    """The forward of every recipe MLM class (an architecture's file mixes it into transformers' class and gives
    `encode`, the encoder's last hidden state, and `predict`, the prediction head with the vocab projection). Its
    changes leave the maths and the exported weights alone:

    - `sparse_head` (model.sparse_mlm_head): with labels, the prediction head runs on the masked
      positions only. The head (transform + vocab projection) is the largest matmul of a small
      encoder and ~85% of its rows are discarded by the loss; gathering the selected positions first
      gives the same loss and gradients at a fraction of the cost (as in NVIDIA's, cramming's and ModernBERT's
      sparse prediction). Then `logits` holds one row per selected token, in row-major order of the labels.
    - `masked_positions` (data.max_predictions_per_seq): K slots a sequence, static shapes, no host read.
    - `document_ids` (data.document_mask, data.unpad): documents attend within themselves (bert_recipes/attention.py).
    """
    sparse_head = True
    attention_path: str | None = None   # attention.use_path: how a batch's documents attend within themselves

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, masked_positions=None, document_ids=None, cu_seqlens=None,
                max_seqlen=None, sequence_starts=None, **kwargs):
        documents = (document_ids, cu_seqlens, max_seqlen) if document_ids is not None else None
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, documents,
                             **kwargs)
        if labels is None:
            return MaskedLMOutput(logits=self.predict(hidden))
        if masked_positions is not None and sequence_starts is not None:
            # unpadded (data.unpad): one row of every sequence; each sequence's K slots index that row, an unused
            # slot its own first token ([CLS], never a label): the padded path's tokens, loss and mean
            logits = self.predict(hidden[0][masked_positions])           # (batch, K, vocab): an index tensor, no mask
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
            logits = self.predict(hidden.gather(1, index))                        # (batch, K, vocab)
            targets = slot_labels(labels, masked_positions)
            return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), targets.view(-1)),
                                  logits=logits)
        if self.sparse_head:
            selected = labels != -100
            logits = self.predict(hidden[selected])
            return MaskedLMOutput(loss=masked_lm_loss(logits, labels[selected]), logits=logits)
        logits = self.predict(hidden)
        return MaskedLMOutput(loss=masked_lm_loss(logits.view(-1, logits.size(-1)), labels.view(-1)), logits=logits)


def classification_loss(logits, labels, num_labels: int):
    """A classifier's loss, in fp32: MSE for a regression (num_labels 1), else cross-entropy."""
    if num_labels == 1:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.view(-1, num_labels).float(), labels.view(-1))


class ExportedAs:
    """save_pretrained whose config.json names the plain transformers class the export loads as (`exported_class`):
    a recipe class changes no weight, and a reader of the export needs none of this package."""
    exported_class = ""

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        exported_as(save_directory, self.exported_class)


def exported_as(save_directory, architecture: str) -> None:
    """An export's config.json names the plain transformers class it loads as (the recipe's subclasses change no
    weight)."""
    config_file = Path(save_directory) / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        config["architectures"] = [architecture]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def document_kwargs(model, document_ids, cu_seqlens, max_seqlen, window: int | None = None) -> dict:
    """The encoder's keyword arguments for a batch with document ids, by the model's attention path (the run's plan
    set it: attention.use_path); the mask path's additive mask in the embeddings' dtype (eager attention); window:
    a local-attention layer's reach (ModernBERT), for the mask path's second mask."""
    from .attention import document_attention
    path = model.attention_path or "mask"
    dtype = model.get_input_embeddings().weight.dtype
    return document_attention(path, document_ids, model.config._attn_implementation, dtype, cu_seqlens, max_seqlen,
                              window)


def special_token_ids(tokenizer) -> dict:
    """The tokenizer's pad, cls and sep ids, and bos/eos as cls/sep (ModernBERT's config wants all five: its
    defaults, 50281-50283, lie past a small vocabulary)."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    return {"pad_token_id": tokenizer.pad_token_id, "cls_token_id": cls, "sep_token_id": sep, "bos_token_id": cls,
            "eos_token_id": sep}


def model_config(model_cfg: ModelConfig, task: TaskConfig, vocab_size: int, pad_token_id: int | None,
                 special: dict | None = None):
    """The model's config: the checkpoint's (model.name_or_path) or a fresh one of model.architecture from the
    recipe's fields (bert_recipes/architectures/), with the recipe's fields that a checkpoint's config takes
    (dropout, ModernBERT's window and RoPE) and the task's labels on top. special: the tokenizer's special ids
    (special_token_ids; else every one is pad_token_id: what the planner's shapes need)."""
    from transformers import AutoConfig

    from .architectures import ARCHITECTURES, module, of_model_type
    arch = module(model_cfg.architecture)
    labels = {}
    if task.kind == "classification":
        labels["num_labels"] = task.num_labels
        labels["problem_type"] = "regression" if task.num_labels == 1 else "single_label_classification"
        if task.label_names:
            labels["id2label"] = dict(enumerate(task.label_names))
            labels["label2id"] = {n: i for i, n in enumerate(task.label_names)}
    if model_cfg.name_or_path:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code,
                                                **labels)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path}: cannot load its config "
                              f"({first_line(err)}); give a Hugging Face model directory or a Hub name") from None
        built_here = of_model_type(config.model_type)
        named = model_cfg.architecture or built_here or "bert"   # None (no config.validate resolved it): the checkpoint's
        if built_here != named and (task.kind == "mlm" or built_here is not None):
            fix = (f"set model.architecture={built_here}" if built_here else
                   f"mlm pretraining here builds {', '.join(ARCHITECTURES)}")
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path} is a {config.model_type} model and "
                              f"model.architecture={named}: {fix}")
        # a classifier from another model type (roberta, ...): BERT's dropout fields, which such configs share
        return module(built_here).with_recipe_fields(config, model_cfg)
    special = special or dict.fromkeys(("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id",
                                        "eos_token_id"), pad_token_id)
    config = arch.with_recipe_fields(arch.fresh_config(model_cfg, vocab_size, special), model_cfg)
    for key, value in labels.items():
        setattr(config, key, value)
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
    """The task's model from a checkpoint in any standard layout of its architecture: for BERT BertForPreTraining (MLM
    + NSP heads), BertForMaskedLM, BertModel (no head), BertForSequenceClassification. What the checkpoint
    lacks is initialised here and what the task does not use is dropped; both are reported in
    `model.loading_report`. A checkpoint that would leave the encoder itself random is refused, and
    so is a classifier for another label count unless model.reinit_head asks for a new one."""
    import contextlib
    import io

    from transformers import AutoModelForSequenceClassification

    from .architectures import ARCHITECTURES, module, of_model_type
    name, built_here = model_cfg.name_or_path, of_model_type(config.model_type)
    arch = module(built_here or "bert")
    auto = (arch.MASKED_LM if task.kind == "mlm" else arch.SEQUENCE_CLASSIFICATION if built_here
            else AutoModelForSequenceClassification)
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
    encoder = sorted(k for k in missing if not k.startswith(arch.HEAD_PREFIXES))
    if encoder:
        title = ARCHITECTURES[built_here or "bert"].title
        raise ConfigError(f"model.name_or_path={name} has no weights for {len(encoder)} tensors of the {title} "
                          f"encoder (e.g. {encoder[0]}): training would start from random weights; give a {title} "
                          f"checkpoint ({arch.LAYOUTS})")
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
    """The architecture's (model.architecture) masked LM or sequence classifier, from a checkpoint or a fresh config
    (`config`, when given, instead of one derived from the tokenizer), with the recipe's attention
    (bert_recipes.dropout; packed_dropout: config.packed_dropout_here's answer for this run) and, for document masks
    or unpadded batches, the plan's attention path (attention.use_path)."""
    if config is None:
        config = model_config(model_cfg, task, len(tokenizer), tokenizer.pad_token_id, special_token_ids(tokenizer))
    if model_cfg.name_or_path:
        model = load_pretrained(model_cfg, task, config)
        if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model.name_or_path="
                              f"{model_cfg.name_or_path} has vocab_size {model.config.vocab_size}: they do not belong "
                              "together; use the model's own tokenizer (leave tokenizer.name_or_path unset)")
    else:
        from .architectures import module
        arch = module(model_cfg.architecture)
        model = (arch.MASKED_LM if task.kind == "mlm" else arch.SEQUENCE_CLASSIFICATION)(config)
    if task.kind == "mlm":
        model.sparse_head = model_cfg.sparse_mlm_head
    from .attention import use_path
    from .dropout import use_recipe_attention
    use_recipe_attention(model, packed_dropout)
    if attention_path is not None:
        if not hasattr(model, "attention_path"):
            raise ConfigError(f"data.document_mask and data.unpad need a BERT or ModernBERT model; model.name_or_path="
                              f"{model_cfg.name_or_path} is a {model.config.model_type} model: set them false")
        use_path(model, attention_path)
    if model_cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

