"""The run's tokenizer: tokenizer.name_or_path's (or the model's), else a WordPiece tokenizer trained once on rank 0
from the training text and handed to every rank; what prepared data records of a tokenizer (tokenizer_identity).
No torch at import time."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..config import ConfigError, DataConfig, TokenizerConfig, first_line
from ..ranks import on_rank0
from .sources import data_cache, hub_unreachable, offline_note, texts
from .tokenizing import TOKENIZE_VERSION


def train_wordpiece(batches, vocab_size: int, lowercase: bool):
    """A BERT WordPiece tokenizer trained with the `tokenizers` library.

    Not bit-reproducible: the trainer breaks ties between equally frequent merges in hash
    order, so two trainings on the same text can differ slightly. The trained tokenizer is
    saved with the run (and every export), which is what makes a run reproducible."""
    from datasets import is_progress_bar_enabled
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    # its bar follows datasets' switch (logging.progress_bar: data.data_progress_bars); off a terminal it is hidden
    # but still prints an empty line per stage
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2,
                                        show_progress=is_progress_bar_enabled())
    tok.train_from_iterator(batches, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return BertTokenizerFast(tokenizer_object=tok, do_lower_case=lowercase, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def get_tokenizer(tok_cfg: TokenizerConfig, model_name_or_path: str | None, train_raw, data: DataConfig,
                  save_dir: Path, is_main: bool, broadcast=lambda obj: obj):
    """Load the configured tokenizer, or train one (on rank 0, once). A tokenizer already in save_dir
    (a resumed run) is reused, so resumes tokenize identically. A trained tokenizer reaches the other
    ranks as rank 0's files over `broadcast`, so nodes need not share a disk for it."""
    from transformers import AutoTokenizer

    name = tok_cfg.name_or_path or model_name_or_path
    if name:
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            from huggingface_hub import constants
            key = "tokenizer.name_or_path" if tok_cfg.name_or_path else "model.name_or_path"
            if hub_unreachable(err, constants.HF_HUB_OFFLINE):   # a local directory was checked in preflight
                raise ConfigError(
                    f"{key}={name}: the Hub cannot be reached and the tokenizer is not in the cache "
                    f"{constants.HF_HUB_CACHE} (huggingface_hub's, under HF_HOME); "
                    f"{offline_note(constants.HF_HUB_OFFLINE, ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'))}: on a node "
                    "that reaches the Hub, run make prepare RECIPE=<this recipe> OUT=DIR (it saves the tokenizer with "
                    "the data: then --data.cache_dir=DIR --tokenizer.name_or_path=DIR/tokenizer for packed MLM, "
                    "--data.source=prepared --data.prepared_dir=DIR for the rest), or point HF_HOME at shared "
                    "storage that holds the download, or give a local tokenizer directory") from None
            raise ConfigError(f"{key}={name}: cannot load a tokenizer from it ({first_line(err)}); give a directory with "
                              "tokenizer files (an export's model/ has them) or a Hub name") from None
    # Only rank 0 looks at the disk and decides. A trained tokenizer goes to a cache keyed by the
    # training data, outside output_dir: the run copies it in once it starts writing, so a run
    # refused later (too little data, a bad setting) leaves its output_dir untouched.
    def rank0_files():
        source = save_dir if (save_dir / "tokenizer.json").exists() else _trained_tokenizer_dir(train_raw, data, tok_cfg)
        if not (source / "tokenizer.json").exists():
            from ..disk import full_disk_is_one_line
            tokenizer = train_wordpiece(texts(train_raw, data), tok_cfg.vocab_size, tok_cfg.lowercase)
            tmp = source.with_name(source.name + f".tmp{os.getpid()}")
            needed = (len(tokenizer.backend_tokenizer.to_str()) * 2, "an estimate: twice its tokenizer.json")
            then = "nothing was trained and the output directory is untouched: free space there, then run again"
            try:
                with full_disk_is_one_line("the trained tokenizer", tmp, 0, needed, then):
                    tokenizer.save_pretrained(tmp)
            except Exception:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            try:
                os.replace(tmp, source)
            except OSError:   # another run trained the same one meanwhile: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
        return {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    files = on_rank0(is_main, broadcast, rank0_files)   # every rank: rank 0's tokenizer files
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)


def _trained_tokenizer_dir(train_raw, data: DataConfig, tok_cfg: TokenizerConfig) -> Path:
    key = json.dumps([train_raw._fingerprint, data.text_column, data.text_pair_column, tok_cfg.vocab_size,
                      tok_cfg.lowercase, TOKENIZE_VERSION])
    return data_cache(data) / "bert_recipes_tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def tokenizer_identity(name: str | None) -> str | None:
    """A tokenizer as prepared data records it: a Hub name as it is; a local directory by the content of
    its files (sha256:...), so the data stays usable where the directory sits elsewhere (another
    node's mount, the GPU machine, a moved checkout)."""
    if not name or not Path(name).expanduser().is_dir():
        return name
    digest = hashlib.sha256()
    for path in sorted(Path(name).expanduser().iterdir()):
        if path.is_file() and (path.name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return "sha256:" + digest.hexdigest()[:32]
