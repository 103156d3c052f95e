"""Sentence embeddings from an encoder: the pooling of its last hidden states (sentence-transformers' `Pooling` modes
mean, cls and lasttoken, the same sums), and the export's sentence-transformers files, written by sentence-transformers
itself so that `SentenceTransformer(<export>)` loads the folder as it would load its own (its layout changes between
its versions: modules.json names its module classes, and 6.x moved them)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

POOLING = ("mean", "cls", "lasttoken")   # sentence-transformers' names
SIMILARITY = ("cosine", "dot")           # sentence-transformers' SimilarityFunction values for them
ST_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")   # and 1_Pooling/


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[batch, tokens, hidden] -> [batch, hidden]: the mean over the attended tokens (accumulated in fp32 under
    half precision), the first attended token, or the last, on either padding side."""
    if mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        acc = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
        total = (hidden * mask).sum(dim=1, dtype=acc)
        return (total / torch.clamp(attention_mask.sum(dim=1, dtype=acc).unsqueeze(-1), min=1e-9)).to(hidden.dtype)
    if mode == "cls":
        first = attention_mask.to(torch.int).argmax(dim=1)
        return hidden[torch.arange(len(hidden), device=hidden.device), first]
    if mode == "lasttoken":
        seen, from_end = attention_mask.flip(1).max(1)
        last = hidden.shape[1] - 1 - torch.where(seen == 0, hidden.shape[1] - 1, from_end)
        masked = hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)   # a row with no token gives zeros
        return masked[torch.arange(len(hidden), device=hidden.device), last]
    raise ValueError(f"task.pooling={mode}: no such pooling; use one of {', '.join(POOLING)}")


def write_sentence_transformer(model_dir: Path, pooling: str, similarity: str = "cosine",
                               max_seq_length: int | None = None) -> list[str]:
    """Add sentence-transformers' own files to an exported encoder's folder (its weights, config and tokenizer
    stay the export's): the transformer module reading the folder itself, then the pooling; max_seq_length: where
    its encode truncates (the length the model trained and was evaluated at). -> the names added."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers.utils import logging as hf_logging
    model_dir = Path(model_dir)
    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report (BERT's pooler, which no pooling reads): not the user's news
    try:
        encoder = Transformer(str(model_dir))
    finally:
        hf_logging.set_verbosity(was)
    st = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)],
                             similarity_fn_name=similarity, device="cpu")
    if max_seq_length is not None:
        st.max_seq_length = max_seq_length
    with tempfile.TemporaryDirectory(dir=model_dir.parent) as scratch:
        st.save(scratch)
        added = [name for name in (*ST_FILES, "1_Pooling") if (Path(scratch) / name).exists()]
        for name in added:
            source, target = Path(scratch) / name, model_dir / name
            shutil.copytree(source, target, dirs_exist_ok=True) if source.is_dir() else shutil.copy2(source, target)
    return added
