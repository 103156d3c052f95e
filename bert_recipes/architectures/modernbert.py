"""ModernBERT (model.architecture: modernbert): RoPE, GeGLU, pre-norm layers without biases, and local
(sliding-window) attention in every layer but each global_attn_every_n_layers-th. transformers' own
ModernBertForMaskedLM and ModernBertForSequenceClassification, so an export loads with AutoModelForMaskedLM as it is.
Here: its config from the recipe's fields, its training classes (the forward is modeling.RecipeMaskedLM's), and its
terms for the memory planner and the MFU.

transformers 5.24's ModernBERT has no unpadded path of its own (one mask per layer type through the generic attention
interface): documents attend apart through bert_recipes/attention.py's paths, the local layers with their window."""
from __future__ import annotations

import math

import torch
from transformers import ModernBertForMaskedLM, ModernBertForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput

from ..modeling import ExportedAs, RecipeMaskedLM, classification_loss, document_kwargs

HEAD_PREFIXES = ("head.", "decoder.", "classifier.", "qa_outputs.")   # what a task may start anew; the rest is the encoder
EMBEDDING_ENTRIES = 2                                    # token embeddings, their LayerNorm (no bias)
LAYOUTS = "ModernBertForMaskedLM, ModernBertModel or ModernBertForSequenceClassification"
FRESH = {"local_attention": 128, "global_attn_every_n_layers": 3, "global_rope_theta": 160_000.0,
         "local_rope_theta": 10_000.0}                   # a fresh model's, where the recipe leaves a field unset
LAYER_TYPE = {"global_rope_theta": "full_attention", "local_rope_theta": "sliding_attention"}


# A tiny model of this architecture that runs every kind of its layers: the recipe fields the tests give it beside
# their own size (tests/test_attention.py): layer 0 global, layer 1 local with a reach of 4 tokens (local_attention 8).
TINY = {"local_attention": 8, "global_attn_every_n_layers": 2}
# ... and the config values they set on it: its initialisation (std 0.02, its output projections / sqrt(2 x layers))
# leaves a tiny model's logits ~1e-4 from what attention adds; 0.2 makes the tests' controls' differences large
TINY_CONFIG = {"initializer_range": 0.2}


def fresh_config(model_cfg, vocab_size: int, special: dict):
    """A ModernBertConfig from the recipe's fields, with the tokenizer's special ids its row names (ModernBERT's
    defaults, 50281-50283, lie past a small vocabulary) and attention dropout 0 unless the recipe sets it (ModernBERT
    trains without dropout)."""
    from transformers import ModernBertConfig
    every = model_cfg.global_attn_every_n_layers or FRESH["global_attn_every_n_layers"]
    config = ModernBertConfig(
        vocab_size=vocab_size, hidden_size=model_cfg.hidden_size, num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads, intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings, global_attn_every_n_layers=every,
        local_attention=FRESH["local_attention"], **special,
        rope_parameters={LAYER_TYPE[k]: {"rope_type": "default", "rope_theta": FRESH[k]} for k in LAYER_TYPE})
    return config


def dropouts(config) -> tuple[float, float, float | None]:
    """A checkpoint config's (hidden, attention, attention output) dropout, as the planner counts their masks: its
    MLP's, its attention's (0 in a fresh one) and its attention output's where it has its own (None: the attention's)."""
    return config.mlp_dropout, config.attention_dropout, getattr(config, "attention_output_dropout", None)


def with_recipe_fields(config, model_cfg):
    """A config, fresh or a checkpoint's, with the recipe's fields that set its values on top: the attention dropouts,
    the local window, which layers are global, and each layer type's RoPE base."""
    if model_cfg.attention_probs_dropout_prob is not None:
        config.attention_dropout = model_cfg.attention_probs_dropout_prob
    if model_cfg.attention_output_dropout is not None:   # ModernBertEncoding.__init__ sets each layer's out_drop
        config.attention_output_dropout = model_cfg.attention_output_dropout
    if model_cfg.local_attention is not None:
        config.local_attention = model_cfg.local_attention
    if model_cfg.global_attn_every_n_layers is not None:
        every = model_cfg.global_attn_every_n_layers
        config.layer_types = ["full_attention" if i % every == 0 else "sliding_attention"
                              for i in range(config.num_hidden_layers)]
    for key, layer_type in LAYER_TYPE.items():
        if getattr(model_cfg, key) is not None:
            config.rope_parameters[layer_type]["rope_theta"] = float(getattr(model_cfg, key))
    return config


class ModernBertEncoding:
    """ModernBERT's encoder as RecipeMaskedLM and the classifier call it. It takes no token_type_ids (it has no
    segment embeddings). Documents (ids, cu_seqlens, max_seqlen) become positions within each document (RoPE) and
    the run's attention path's arguments; on the mask path one mask per layer type, the local one also within the
    window (transformers' rule: |i - j| <= local_attention // 2)."""

    def __init__(self, config, *args, **kwargs):
        """transformers' layers drop the attention's output at config.attention_dropout, the probabilities' rate; a
        config with attention_output_dropout (model.attention_output_dropout) drops it at that rate instead."""
        super().__init__(config, *args, **kwargs)
        rate = getattr(config, "attention_output_dropout", None)
        if rate is not None:
            for layer in self.model.layers:
                layer.attn.out_drop = torch.nn.Dropout(rate) if rate > 0 else torch.nn.Identity()

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, documents, **kwargs):
        if documents is not None:
            extra = document_kwargs(self, *documents, window=self.config.sliding_window)
            position_ids = extra.pop("position_ids")
            attention_mask = {"full_attention": extra.pop("attention_mask", None),
                              "sliding_attention": extra.pop("local_mask", None)}
            kwargs.update(extra)
        return self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          inputs_embeds=inputs_embeds, **kwargs).last_hidden_state


class RecipeModernBertForMaskedLM(ExportedAs, ModernBertEncoding, RecipeMaskedLM, ModernBertForMaskedLM):
    """ModernBertForMaskedLM with RecipeMaskedLM's forward (the sparse and the static-K head, documents); the weights
    and the export are ModernBertForMaskedLM's."""
    exported_class = "ModernBertForMaskedLM"

    def predict(self, hidden):
        return self.decoder(self.head(hidden))


class RecipeModernBertForSequenceClassification(ExportedAs, ModernBertEncoding, ModernBertForSequenceClassification):
    """ModernBertForSequenceClassification that drops token_type_ids and also takes a batch run unpadded
    (data.unpad): one row of every sequence's real tokens; the pooled output is each sequence's first token
    (classifier_pooling cls) or the mean of its tokens (mean), as the padded path pools."""
    attention_path: str | None = None
    exported_class = "ModernBertForSequenceClassification"

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                document_ids=None, cu_seqlens=None, max_seqlen=None, sequence_starts=None, **kwargs):
        if document_ids is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   labels=labels, **kwargs)
        hidden = self.encode(input_ids, None, None, None, None, (document_ids, cu_seqlens, max_seqlen))[0]
        if self.config.classifier_pooling == "mean":   # each sequence's mean: sums and counts by index, no host read
            sums = hidden.new_zeros(len(sequence_starts), hidden.size(-1)).index_add_(0, document_ids[0], hidden)
            counts = hidden.new_zeros(len(sequence_starts)).index_add_(0, document_ids[0],
                                                                        torch.ones_like(hidden[:, 0]))
            pooled = sums / counts.unsqueeze(-1)
        else:
            pooled = hidden[sequence_starts]
        logits = self.classifier(self.drop(self.head(pooled)))
        loss = classification_loss(logits, labels, self.num_labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


MASKED_LM, SEQUENCE_CLASSIFICATION = RecipeModernBertForMaskedLM, RecipeModernBertForSequenceClassification


# ----------------------------------------------------------------------------- the planner's and the MFU's terms
def shape(shape_class, config, num_labels):
    local = tuple(t == "sliding_attention" for t in config.layer_types)
    return shape_class(config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                       config.intermediate_size, config.max_position_embeddings, 0, num_labels, "modernbert",
                       local, config.sliding_window)


def layer_parameters(s) -> list[tuple[int, str]]:
    """One ModernBertEncoderLayer's parameters, (numel, kind), in Hugging Face's order (layer 0 has no attn_norm:
    the embeddings' norm precedes it): attn_norm, Wqkv, Wo, mlp_norm, Wi (GeGLU: 2 x intermediate), Wo. No biases."""
    h, i = s.hidden, s.intermediate
    return [(h, "norm"), (3 * h * h, "weight"), (h * h, "weight"), (h, "norm"), (2 * i * h, "weight"), (i * h, "weight")]


def parameters(s) -> list[tuple[int, str]]:
    """Every parameter, (numel, kind), in Hugging Face's order, the tied decoder once (activations.Shape)."""
    h, v = s.hidden, s.vocab
    out = [(v * h, "embedding"), (h, "norm")]
    out += layer_parameters(s)[1:] + (s.layers - 1) * layer_parameters(s) + [(h, "norm")]   # ... final_norm
    out += [(h * h, "weight"), (h, "norm")]                                                 # head: dense, norm
    out += [(v, "vocab_bias")] if s.num_labels is None else [(s.num_labels * h, "weight"), (s.num_labels, "bias")]
    return out


def flops_per_token(config, seq_len: int, mlm_fraction: float | None) -> float:
    """Training FLOPs per input token of ModernBERT (forward + backward = 3 x forward).

    Per layer and token, forward: 2 x (4h^2 attention projections + 3 h i GeGLU: Wi is h x 2i, Wo i x h) plus the
    attention itself, 2 x 2 k h, where k is the keys a query sees: s in a global layer, at most local_attention + 1
    in a local one (the window's useful work; a dense mask computes all s). MLM head on the predicted share of
    tokens: 2 x (h^2 + h V). Embedding lookups and RoPE's elementwise products are not counted."""
    h, i, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    projections = 2 * (4 * h * h + 3 * h * i)
    keys = [min(seq_len, 2 * config.sliding_window + 1) if t == "sliding_attention" else seq_len
            for t in config.layer_types]
    head = 2 * (h * h + h * vocab) * mlm_fraction if mlm_fraction else 0.0
    return 3.0 * (sum(projections + 4 * k * h for k in keys) + head)


def activation_bytes(shape, work, precision: str, device: str, checkpointing: bool) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of one micro batch of ModernBERT (activations.activation_bytes'
    parts and precisions), op by op, measured against saved_tensors_hooks on CPU (tests/test_memory.py).

    A layer saves its pre-norms' inputs and statistics (layer 0 has no attention norm), Wqkv's input and output
    (the values are a view of it), the rotated queries and keys, the attention kernel's own (activations'
    attention_bytes, less the values), Wi's input and its 2 x intermediate output (GeGLU's GELU input and gate are
    views of it), GELU's output and the gated product (Wo's input). A local layer, and every layer of a padded
    batch, hands sdpa a bool (b, 1, s, s) mask (not saved), which the fused kernel saves as an additive copy in the
    query's dtype on every call. RoPE's cos and sin: once a forward per layer type (not with checkpointing)."""
    from ..activations import attention_bytes, attention_kernel, head_bytes
    b, s, a, h, i = work.batch, work.seq, shape.heads, shape.hidden, shape.intermediate
    tokens, B, Bi, scores = b * s, b * s * h, b * s * i, b * a * s * s
    autocast, half = precision == "autocast", precision == "half"
    e = 2 if half else 4
    lin = 2 if autocast else e
    res = 4 if autocast else e
    stat = 4 if (device == "cuda" or not half) else 2
    p_h = work.hidden_dropout > 0

    def mask(elements: int, of_bytes: int, module: bool = True) -> int:
        return elements * (1 if device == "cuda" or (work.packed_dropout(device) and module) else of_bytes)

    embeddings = tokens * 8 + B * res + 2 * tokens * stat
    kernel = attention_kernel(work, device)
    attention, context = attention_bytes(work, device, kernel, B, scores, lin, autocast, mask)   # BERT's kernels
    if work.attn_implementation == "eager":   # q, k^T, v copied for the matmuls, the fp32 softmax (RoPE saves no q)
        p_a = work.attention_dropout > 0      # cast to the values' dtype; with dropout its mask and the dropped probs
        attention = 3 * B * lin + scores * 4 + (mask(scores, lin, module=False) + scores * lin if p_a
                                                else scores * lin if lin != 4 else 0)
    elif kernel == "fused":                   # the rotated q and k, and the values, a view of Wqkv's whole output
        attention += 2 * B * lin
    if (work.attention_dropout if work.output_dropout is None else work.output_dropout) > 0:   # after Wo: its mask
        attention += mask(B, lin)

    def layer(index: int, local: bool) -> int:
        norms = (B * res + 2 * tokens * stat) * (1 if index == 0 else 2)
        masked = local or work.padded
        dense_mask = tokens * (math.ceil(s / 8) * 8 if device == "cuda" else s) * lin if masked and kernel == "fused" \
            else 0
        return (norms + B * lin + attention + context + dense_mask                # Wqkv in; attention
                + B * lin + 2 * Bi * lin + Bi * lin + Bi * lin)                    # Wi in, out; GELU out; product

    per_layer = [layer(n, local) for n, local in enumerate(shape.local)]
    shared = 0 if checkpointing else len(set(shape.local)) * 2 * s * (h // a) * res   # RoPE cos, sin a layer type
    head = head_bytes(shape, work, device, B, tokens, lin, res, stat, autocast, e, p_h, mask) \
        if shape.num_labels is None else _classifier_bytes(shape, work, device, B, lin, stat, autocast, e)
    final_norm = B * res + 2 * tokens * stat
    layers = (shape.layers * B * res if checkpointing else sum(per_layer)) + shared
    return {"embeddings": embeddings, "per_layer": max(per_layer), "layers": layers + final_norm, "head": head,
            "total": embeddings + layers + final_norm + head, "recompute": max(per_layer) if checkpointing else 0}


def _classifier_bytes(shape, work, device, B, lin, stat, autocast, e) -> int:
    """The classifier's saved bytes: the head's dense input (the first token's hidden state: a view, the whole
    output, unless autocast saves its 16-bit copy; a token classifier's: every token's), GELU input, LayerNorm input
    and statistics, the classifier's input, and the loss's inputs, a sequence's or every token's."""
    b, h, c = (work.batch * work.seq if shape.per_token else work.batch), shape.hidden, shape.num_labels
    ln_in = 4 if (autocast and device == "cuda") else lin   # CUDA autocast runs LayerNorm in fp32
    head = (b * h * 2) if autocast else B * e   # the head's dense input: its 16-bit copy, or the whole output
    head += b * h * lin + b * h * ln_in + 2 * b * stat + b * h * lin            # GELU in, LayerNorm in, classifier in
    head += (b * 4 * 2) if c == 1 else (b * c * 4 + b * 8)
    return head + 4
