"""BERT (model.architecture: bert, the default): its config from the recipe's fields, its training classes, and its
terms for the memory planner (its parameters and its activations, op by op, for Hugging Face's BertLayer) and the
MFU."""
from __future__ import annotations

import math

from transformers import BertForMaskedLM, BertForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput

from ..modeling import ExportedAs, RecipeMaskedLM, classification_loss, document_kwargs

HEAD_PREFIXES = ("cls.", "classifier.", "bert.pooler.", "qa_outputs.")  # what a task may start anew; the rest is the encoder
EMBEDDING_ENTRIES = 5                                     # word, position, token-type embeddings, LayerNorm w and b


# A tiny model of this architecture that runs every kind of its layers: the recipe fields the tests give it beside
# their own size (tests/test_attention.py); dropout off, so paths compare exactly.
TINY = {"hidden_dropout_prob": 0.0}
TINY_CONFIG: dict = {}   # ... and the config values they set on it: none


def fresh_config(model_cfg, vocab_size: int, special: dict):
    """A BertConfig from the recipe's fields (special: the tokenizer's ids its row names, the pad id)."""
    from transformers import BertConfig
    return BertConfig(vocab_size=vocab_size, hidden_size=model_cfg.hidden_size,
                      num_hidden_layers=model_cfg.num_hidden_layers, num_attention_heads=model_cfg.num_attention_heads,
                      intermediate_size=model_cfg.intermediate_size,
                      max_position_embeddings=model_cfg.max_position_embeddings,
                      **special)


def dropouts(config) -> tuple[float, float, float | None]:
    """A checkpoint config's (hidden, attention, attention output) dropout, as the planner counts their masks (BERT's
    attention output drops at the hidden rate, inside its hidden-dropout terms: None)."""
    return config.hidden_dropout_prob, config.attention_probs_dropout_prob, None


def overrides(model_cfg) -> dict:
    """The recipe's fields that set a config's values, fresh or a checkpoint's (None: the config's own)."""
    return {k: v for k, v in (("hidden_dropout_prob", model_cfg.hidden_dropout_prob),
                              ("attention_probs_dropout_prob", model_cfg.attention_probs_dropout_prob))
            if v is not None}


class BertEncoding:
    """BERT's encoder as RecipeMaskedLM and the classifier call it: documents (ids, cu_seqlens, max_seqlen) become
    positions within each document and the run's attention path's arguments."""

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, documents, **kwargs):
        if documents is not None:   # a packed row of documents, or a batch run unpadded (bert_recipes/attention.py)
            kwargs.update(document_kwargs(self, *documents))
            attention_mask, position_ids = kwargs.pop("attention_mask", None), kwargs.pop("position_ids")
        return self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True,
                         **kwargs).last_hidden_state


class RecipeBertForMaskedLM(ExportedAs, BertEncoding, RecipeMaskedLM, BertForMaskedLM):
    """BertForMaskedLM with RecipeMaskedLM's forward, and one change that leaves the maths and the exported weights
    alone: the decoder bias is registered once. Hugging Face registers the same Parameter twice
    (`cls.predictions.bias` and `cls.predictions.decoder.bias`), which FSDP2 rejects when the two names land in
    different shard groups. Here the decoder is bias-free and the head adds `cls.predictions.bias`; an export loads
    into a plain BertForMaskedLM, which re-ties them."""
    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    exported_class = "BertForMaskedLM"

    def __init__(self, config):
        super().__init__(config)
        self.cls.predictions.decoder.bias = None

    def predict(self, hidden):
        predictions = self.cls.predictions
        return predictions.decoder(predictions.transform(hidden)) + predictions.bias


class RecipeBertForSequenceClassification(ExportedAs, BertEncoding, BertForSequenceClassification):
    """BertForSequenceClassification that also takes a batch run unpadded (data.unpad): one row holding every
    sequence's real tokens, each attending within itself with its own positions (bert_recipes/attention.py); the
    pooled output is each sequence's first token's, as the padded path pools. The weights, the padded path and the
    export are BertForSequenceClassification's."""
    attention_path: str | None = None
    exported_class = "BertForSequenceClassification"

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                document_ids=None, cu_seqlens=None, max_seqlen=None, sequence_starts=None, **kwargs):
        if document_ids is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   position_ids=position_ids, labels=labels, **kwargs)
        hidden = self.encode(input_ids, None, token_type_ids, None, None, (document_ids, cu_seqlens, max_seqlen))
        pooled = self.bert.pooler.activation(self.bert.pooler.dense(hidden[0, sequence_starts]))
        logits = self.classifier(self.dropout(pooled))
        loss = classification_loss(logits, labels, self.num_labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


MASKED_LM, SEQUENCE_CLASSIFICATION = RecipeBertForMaskedLM, RecipeBertForSequenceClassification



LAYOUTS = "BertForPreTraining, BertForMaskedLM, BertModel or BertForSequenceClassification"


def with_recipe_fields(config, model_cfg):
    """A config, fresh or a checkpoint's, with the recipe's fields that set its values on top."""
    for key, value in overrides(model_cfg).items():
        setattr(config, key, value)
    return config


# ----------------------------------------------------------------------------- the planner's and the MFU's terms
def shape(shape_class, config, num_labels):
    return shape_class(config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                       config.intermediate_size, config.max_position_embeddings, config.type_vocab_size, num_labels)


def layer_parameters(s) -> list[tuple[int, str]]:
    """One BertLayer's parameters, (numel, kind), in Hugging Face's order."""
    h, i = s.hidden, s.intermediate
    attention = [(h * h, "weight"), (h, "bias")] * 4                     # Q, K, V, output projection
    mlp = [(h * i, "weight"), (i, "bias"), (i * h, "weight"), (h, "bias")]
    return attention + [(h, "norm"), (h, "norm")] + mlp + [(h, "norm"), (h, "norm")]


def parameters(s) -> list[tuple[int, str]]:
    """Every parameter, (numel, kind), in Hugging Face's order, the tied decoder once (activations.Shape)."""
    h, v = s.hidden, s.vocab
    out = [(v * h, "embedding"), (s.max_positions * h, "embedding"), (s.type_vocab * h, "embedding"),
           (h, "norm"), (h, "norm")]
    out += s.layers * layer_parameters(s)
    if s.num_labels is None:   # the vocab bias, transform, its LayerNorm
        out += [(v, "vocab_bias"), (h * h, "weight"), (h, "bias"), (h, "norm"), (h, "norm")]
    elif s.per_token:          # the classifier alone (BertForTokenClassification has no pooler)
        out += [(s.num_labels * h, "weight"), (s.num_labels, "bias")]
    else:                      # pooler, classifier
        out += [(h * h, "weight"), (h, "bias"), (s.num_labels * h, "weight"), (s.num_labels, "bias")]
    return out


def activation_bytes(shape, work, precision: str, device: str, checkpointing: bool) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of one micro batch of Hugging Face's BERT
    (activations.activation_bytes' parts and precisions), op by op, measured against saved_tensors_hooks on CPU
    (tests/test_memory.py): the embeddings, each BertLayer (its attention through activations.attention_bytes), and
    the MLM head or the pooler and classifier (activations.head_bytes)."""
    from ..activations import attention_bytes, attention_kernel, head_bytes
    b, s, a, i = work.batch, work.seq, shape.heads, shape.intermediate
    tokens, B, Bi, scores = b * s, b * s * shape.hidden, b * s * i, b * a * s * s
    autocast, half = precision == "autocast", precision == "half"
    e = 2 if half else 4                    # the model's dtype
    lin = 2 if autocast else e              # linear inputs and outputs
    res = 4 if autocast else e              # residual stream and LayerNorm inputs (fp32 + 16-bit -> fp32)
    stat = 4 if (device == "cuda" or not half) else 2   # LayerNorm mean and rstd
    p_h = work.hidden_dropout > 0
    packed = work.packed_dropout(device)

    def mask(elements: int, of_bytes: int, module: bool = True) -> int:
        """A dropout mask: bool on CUDA and packed (dropout modules), torch's on CPU in the input's dtype."""
        return elements * (1 if device == "cuda" or (packed and module) else of_bytes)

    # --- embeddings: input_ids and token_type_ids (int64) for the lookups, LayerNorm, dropout. A token classifier's
    # batches carry no token types (tasks/token_classification.py): BERT looks up its buffer's first s, one row
    types = s * 8 if shape.per_token else tokens * 8
    embeddings = tokens * 8 + types + B * res + 2 * tokens * stat + (mask(B, res) if p_h else 0)

    # --- one encoder layer
    kernel = attention_kernel(work, device)
    qkv_in = (3 if autocast else 1) * B * lin           # autocast casts the input once per linear
    attention, context = attention_bytes(work, device, kernel, B, scores, lin, autocast, mask)
    layer = (qkv_in + attention + context
             + (mask(B, lin) if p_h else 0)
             + B * res + 2 * tokens * stat              # LayerNorm 1
             + B * lin                                  # -> intermediate
             + Bi * lin + Bi * lin                      # GELU input, its output -> output projection
             + (mask(B, lin) if p_h else 0)
             + B * res + 2 * tokens * stat)             # LayerNorm 2
    # With padding, HF passes one bool (b, 1, s, s) mask; a fused sdpa converts it on every call into
    # an additive mask in the query's dtype and saves that copy (the math path adds it and saves nothing).
    if work.padded and kernel == "fused":
        layer += b * s * (math.ceil(s / 8) * 8 if device == "cuda" else s) * lin

    # --- head
    head = head_bytes(shape, work, device, B, tokens, lin, res, stat, autocast, e, p_h, mask)

    layers = shape.layers * (B * res if checkpointing else layer)
    if checkpointing and work.padded:   # the checkpoints also keep HF's mask, an input of every layer
        layers += b * s * s * (1 if work.attn_implementation == "sdpa" else e)
    return {"embeddings": embeddings, "per_layer": layer, "layers": layers, "head": head,
            "total": embeddings + layers + head, "recompute": layer if checkpointing else 0}


def flops_per_token(config, seq_len: int, mlm_fraction: float | None) -> float:
    """Training FLOPs per input token of BERT (forward + backward = 3 x forward).

    Per layer and token, forward: 2 x (4h^2 attention projections + 2 h i MLP) plus the attention
    itself, 2 x 2 s h (QK^T and AV). MLM head on the predicted share of tokens: 2 x (h^2 + h V);
    a sequence-classification head is negligible. Embedding lookups are not FLOPs."""
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    per_layer = 2 * (4 * h * h + 2 * h * i) + 4 * seq_len * h
    head = 2 * (h * h + h * vocab) * mlm_fraction if mlm_fraction else 0.0
    return 3.0 * (layers * per_layer + head)
