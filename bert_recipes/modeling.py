"""What every architecture's classes share (bert_recipes/architectures/<name>.py imports it): the recipe's MLM
forward (RecipeMaskedLM: sparse head, static slots, documents apart) and its losses, a classifier's loss, the
export's class name in config.json, the document attention's arguments and the tokenizer's special ids (what a task
does with them: bert_recipes/tasks/<kind>.py). Building a model for an architecture is bert_recipes/models.py's, above the architectures."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import MaskedLMOutput


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
    """The labels of the K position slots (tasks/mlm.MLMCollator): the chosen tokens' labels, then -100 for
    the unused slots (which point at position 0, possibly a chosen token: counted once, not twice)."""
    used = torch.arange(masked_positions.size(1), device=labels.device) < (labels != -100).sum(1, keepdim=True)
    return labels.gather(1, masked_positions).masked_fill(~used, -100)


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


SPECIAL_IDS = ("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "mask_token_id")


def special_token_ids(tokenizer) -> dict:
    """The tokenizer's special ids (SPECIAL_IDS): pad, cls, sep and mask, and bos/eos where it has them, else cls/sep
    (a WordPiece tokenizer has none). An architecture's fresh config takes those its row names (special_ids)."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    return {"pad_token_id": tokenizer.pad_token_id, "cls_token_id": cls, "sep_token_id": sep,
            "bos_token_id": cls if bos is None else bos, "eos_token_id": sep if eos is None else eos,
            "mask_token_id": tokenizer.mask_token_id}
