"""The model a run trains, built for its architecture (model.architecture: bert_recipes/architectures/<name>.py,
the row of its table): its config (fresh from the recipe's fields, or a checkpoint's with them on top), the
checkpoint's weights where model.name_or_path names one, the attention and dropout paths the plan chose. The model
knows nothing about parallelism: train.py hands it to an engine, which applies the backend the launch config names."""
from __future__ import annotations

from .config import ConfigError, ModelConfig, TaskConfig, first_line
from .modeling import SPECIAL_IDS, special_token_ids
from .tasks import kind_of


def model_config(model_cfg: ModelConfig, task: TaskConfig, vocab_size: int, pad_token_id: int | None,
                 special: dict | None = None):
    """The model's config: the checkpoint's (model.name_or_path) or a fresh one of model.architecture from the
    recipe's fields (bert_recipes/architectures/), with the recipe's fields that a checkpoint's config takes
    (dropout, ModernBERT's window and RoPE) and the task's labels on top. special: the tokenizer's special ids
    (special_token_ids; else every one is pad_token_id: what the planner's shapes need)."""
    from transformers import AutoConfig

    from .architectures import ARCHITECTURES, module, of_model_type
    arch = module(model_cfg.architecture)
    labels = kind_of(task.kind).config_fields(task)
    if model_cfg.name_or_path:
        try:
            config = AutoConfig.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code,
                                                **labels)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path}: cannot load its config "
                              f"({first_line(err)}); give a Hugging Face model directory or a Hub name") from None
        built_here = of_model_type(config.model_type)
        named = model_cfg.architecture or built_here or "bert"   # None (no config.validate resolved it): the checkpoint's
        if built_here != named and (kind_of(task.kind).head(None) is None or built_here is not None):
            fix = (f"set model.architecture={built_here}" if built_here else
                   f"task.kind={task.kind} here builds {', '.join(ARCHITECTURES)}")
            raise ConfigError(f"model.name_or_path={model_cfg.name_or_path} is a {config.model_type} model and "
                              f"model.architecture={named}: {fix}")
        for key, value in labels.items():   # from_pretrained sets only the keys its config class knows
            setattr(config, key, value)
        # a classifier from another model type (roberta, ...): BERT's dropout fields, which such configs share
        return module(built_here).with_recipe_fields(config, model_cfg)
    special = special or dict.fromkeys(SPECIAL_IDS, pad_token_id)
    taken = {key: special[key] for key in ARCHITECTURES[model_cfg.architecture or "bert"].special_ids}
    config = arch.with_recipe_fields(arch.fresh_config(model_cfg, vocab_size, taken), model_cfg)
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

    from .architectures import ARCHITECTURES, module, of_model_type
    name, built_here = model_cfg.name_or_path, of_model_type(config.model_type)
    arch = module(built_here or "bert")
    auto = kind_of(task.kind).head(arch if built_here else None)   # model_config refused a kind with none
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
        model = kind_of(task.kind).head(module(model_cfg.architecture))(config)
    if hasattr(model, "sparse_head"):   # the recipe's masked-LM forward (modeling.RecipeMaskedLM)
        model.sparse_head = model_cfg.sparse_mlm_head
    from .attention import use_path
    from .dropout import use_recipe_attention
    use_recipe_attention(model, packed_dropout)
    if attention_path is not None:
        if not hasattr(model, "attention_path"):
            raise ConfigError(f"data.document_mask and data.unpad need this package's BERT or ModernBERT classes, and "
                              f"task.kind={task.kind} on model.name_or_path={model_cfg.name_or_path} builds "
                              f"{type(model).__name__} ({model.config.model_type}): set them false")
        use_path(model, attention_path)
    if model_cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())

