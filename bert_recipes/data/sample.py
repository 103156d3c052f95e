"""The embedded sample: a pretraining corpus and a classification task built from
the Python standard library's own documentation, so the demo and tests need no download.

Nothing is imported from the standard library's modules: docstrings are read with `ast`
from the `.py` files, and `pydoc_data.topics` (the language reference topics) is the only
data module loaded. Files are visited in sorted order and every split decision is a hash
of a file's relative path, so the same Python gives the same files on every machine.

Classification task: docstring -> which area of the standard library it documents.
The split is *by module*: all docstrings of one .py file land in one split, so near
duplicates (overloads, subclasses restating their parent) cannot leak across splits.
The validation and test modules are also kept out of the pretraining corpus.

Token classification task (named entities, BIO): the same docstrings' first paragraphs as words, each word tagged
NAME (a name in code: a call `f()`, a dotted name, snake_case, a ``literal`` in reST quotes) or LITERAL (a number,
True, False, None, a quoted string, which may span words), else O; the same split by module. Every tag can be told
from what an uncased WordPiece sees (a CamelCase class name, which only its capitals mark, is O).

Question answering task (SQuAD's layout): a cloze question on the same paragraphs, the sentence that holds the first
NAME with it replaced by "what", answered by that name's span; the same split by module.

Retrieval task (query, positive pairs): a docstring's first sentence (its summary line) as the query, the rest of the
docstring as the passage it should find; the same split by module, each split's passages its corpus.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sysconfig
from collections import Counter
from pathlib import Path

# label -> top-level stdlib packages/modules it covers (8 classes)
AREAS: dict[str, tuple[str, ...]] = {
    "asyncio": ("asyncio",),
    "email": ("email", "mailbox", "smtplib", "imaplib", "poplib", "mimetypes"),
    "xml_json": ("xml", "json", "xmlrpc", "plistlib"),
    "unittest": ("unittest", "doctest"),
    "http_urllib": ("http", "urllib", "wsgiref"),
    "concurrency": ("multiprocessing", "concurrent", "threading", "queue"),
    "tkinter": ("tkinter", "turtle"),
    "importlib": ("importlib", "pkgutil", "zipimport"),
}
LABELS = sorted(AREAS)
SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.15, "test": 0.15}
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "idlelib"}
MIN_DOC_CHARS = 30
MAX_DOC_CHARS = 2000
FORMAT_VERSION = 9   # bump when the build changes, so cached copies are rebuilt
NER_TAGS = ["O", "B-NAME", "I-NAME", "B-LITERAL", "I-LITERAL"]
NER_MAX_WORDS = 48
_NAME = re.compile(r"^(\w+\(\)|[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?|[a-z][a-z0-9]*(_[a-z0-9]+)+|_\w+)$")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _camel(word: str) -> bool:
    """A class's name: letters and digits, at least two capitals and a lower-case letter (HTTPConnection)."""
    return word.isalnum() and word[0].isupper() and sum(map(str.isupper, word)) >= 2 and any(map(str.islower, word))


def _ner_row(doc: str) -> dict | None:
    """A docstring's first paragraph as words with BIO tags (NER_TAGS): punctuation split off a word's ends, reST's
    ``...`` quotes and a quoted string's quotes kept as words of their own; None for a paragraph without entities."""
    row = _tagged(doc)
    return row if row and any(t != "O" for t in row["ner_tags"]) else None


def _tagged(doc: str) -> dict | None:
    """_ner_row's words and tags, entities or not; None under 4 words."""
    text = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
    words, tags, quote = [], [], None
    for raw in text.split(" ")[:NER_MAX_WORDS]:
        lead = re.match(r"^[(\[{\"'`]*", raw).group()
        tail = re.search(r"[)\]}.,;:!?\"'`]*$", raw[len(lead):]).group()
        core = raw[len(lead):len(raw) - len(tail)] if tail else raw[len(lead):]
        if core.endswith("(") and tail.startswith(")"):   # f() as one word
            core, tail = core + ")", tail[1:]
        for piece in filter(None, [*lead, core, *tail]):
            words.append(piece)
            if quote is not None:   # inside a quoted string: LITERAL until its closing quote
                tags.append("O" if piece == quote else "I-LITERAL" if tags[-1] != "O" else "B-LITERAL")
                if piece == quote:
                    quote = None
            elif piece in ("'", '"'):
                tags.append("O")
                quote = piece
            elif piece in ("True", "False", "None") or _NUMBER.match(piece):
                tags.append("B-LITERAL")
            elif piece == core and (_NAME.match(piece) or lead.endswith("``") and piece.isidentifier()):
                tags.append("B-NAME")
            else:
                tags.append("O")
    if quote is not None:   # an unclosed quote: its words are not a literal
        tags = [t if not t.endswith("LITERAL") or w in ("True", "False", "None") or _NUMBER.match(w) else "O"
                for w, t in zip(words, tags)]
    return {"tokens": words, "ner_tags": tags} if len(words) >= 4 else None


def _qa_row(doc: str, n: str) -> dict | None:
    """A cloze question on a docstring's first paragraph: the sentence that holds its first name in code (_ner_row's
    NAME, or a CamelCase class name: a span to find needs no capitals to be seen) with that name replaced by "what",
    answered by the name's span in the paragraph; None without one."""
    row = _tagged(doc)
    names = [w for w, t in zip(row["tokens"], row["ner_tags"]) if t == "B-NAME" or t == "O" and _camel(w)] if row else []
    if not names:
        return None
    context = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
    name = names[0]
    start = context.find(name)
    if start < 0:
        return None
    sentence_start = max(context.rfind(". ", 0, start) + 2, 0) if context.rfind(". ", 0, start) >= 0 else 0
    sentence_end = context.find(". ", start)
    sentence = context[sentence_start:sentence_end if sentence_end >= 0 else len(context)].rstrip(".")
    question = sentence.replace(name, "what", 1).strip() + "?"
    if not 4 <= len(question.split()) <= 14 or len(question) > 80:
        return None
    return {"id": f"qa{n}", "question": question, "context": context,
            "answers": {"text": [name], "answer_start": [start]}}


def _pair_row(doc: str, n: str) -> dict | None:
    """A docstring's first sentence (up to its first ". " or blank line: 3 to 24 words) as a query, the rest
    (whitespace joined, at least MIN_DOC_CHARS) as its positive passage; None where the docstring has no such parts."""
    text = re.sub(r"[ \t]+", " ", doc).strip()
    cut = min((i for i in (text.find(". "), text.find("\n\n"), text.find(".\n")) if i >= 0), default=-1)
    if cut < 0:
        return None
    query, rest = re.sub(r"\s+", " ", text[:cut + 1]).strip(), re.sub(r"\s+", " ", text[cut + 1:]).strip()
    if not 3 <= len(query.split()) <= 24 or len(rest) < MIN_DOC_CHARS:
        return None
    return {"id": f"r{n}", "query": query, "positive": rest}


def _derived_tasks(out: Path, examples: dict) -> tuple[dict, dict, dict]:
    """The tagging (ner/), question (qa/) and pair (retrieval/) files, from the classification docstrings' splits.
    -> their rows."""
    ner = {split: [row for row in map(_ner_row, (r["text"] for r in rows)) if row] for split, rows in examples.items()}
    qa = {split: [row for row in (_qa_row(r["text"], f"{split}-{n}") for n, r in enumerate(rows)) if row]
          for split, rows in examples.items()}
    pairs = {split: [row for row in (_pair_row(r["text"], f"{split}-{n}") for n, r in enumerate(rows)) if row]
             for split, rows in examples.items()}
    for kind, by_split in (("ner", ner), ("qa", qa), ("retrieval", pairs)):
        (out / kind).mkdir(parents=True, exist_ok=True)
        for split, rows in by_split.items():
            (out / kind / f"{split}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return ner, qa, pairs


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                doc = re.sub(r"\s+", " ", doc).strip()[:MAX_DOC_CHARS]
                if len(doc) >= MIN_DOC_CHARS:
                    docs.append(doc)
    return docs


def _area(rel: str) -> str | None:
    top = rel.split("/")[0].removesuffix(".py")
    for label, tops in AREAS.items():
        if top in tops:
            return label
    return None


def _hash(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _split_modules(modules: dict[str, list[str]]) -> dict[str, str]:
    """Assign each module of one area to a split, greedily by docstring count: largest
    module first (ties by hash), each to the split furthest below its target share.
    Deterministic, and the biggest files (tkinter/__init__.py) land in train."""
    counts = {s: 0 for s in SPLIT_FRACTIONS}
    total = sum(len(d) for d in modules.values())
    assignment = {}
    for rel in sorted(modules, key=lambda r: (-len(modules[r]), _hash(r))):
        split = min(SPLIT_FRACTIONS, key=lambda s: (counts[s] - SPLIT_FRACTIONS[s] * total) / SPLIT_FRACTIONS[s])
        assignment[rel] = split
        counts[split] += len(modules[rel])
    return assignment


def build_sample(out_dir: str | os.PathLike, stdlib_root: str | None = None) -> dict:
    """Write the sample under `out_dir` (idempotent) and return its manifest:

    out_dir/pretrain/{train,validation}.txt   one paragraph per line
    out_dir/pretrain/{reference,docstrings}.txt   train.txt's paragraphs by kind: the language reference, docstrings
    out_dir/classify/{train,validation,test}.jsonl   {"text": ..., "label": int, "area": str}
    out_dir/ner/{train,validation,test}.jsonl   {"tokens": [words], "ner_tags": [BIO tags, NER_TAGS]}
    out_dir/qa/{train,validation,test}.jsonl   {"id", "question", "context", "answers": {"text", "answer_start"}}
    out_dir/retrieval/{train,validation,test}.jsonl   {"id", "query", "positive"}
    out_dir/manifest.json   counts, label names, majority baseline, content hashes
    """
    out = Path(out_dir)
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format_version") == FORMAT_VERSION:
            return manifest
    root = Path(stdlib_root or sysconfig.get_paths()["stdlib"])

    by_area: dict[str, dict[str, list[str]]] = {label: {} for label in LABELS}
    other_docs: list[str] = []
    for path in _stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        docs = _docstrings(path)
        area = _area(rel)
        if area is None:
            other_docs += docs
        elif docs:
            by_area[area][rel] = docs

    seen: set[str] = set()   # exact duplicates are kept once, in the first split that has them
    examples = {s: [] for s in SPLIT_FRACTIONS}
    pretrain_docs = list(other_docs)
    for label in LABELS:
        assignment = _split_modules(by_area[label])
        for rel in sorted(by_area[label]):
            split = assignment[rel]
            for doc in by_area[label][rel]:
                if doc in seen:
                    continue
                seen.add(doc)
                examples[split].append({"text": doc, "label": LABELS.index(label), "area": label, "module": rel})
                if split == "train":
                    pretrain_docs.append(doc)

    from pydoc_data.topics import topics   # the language reference, ~465 KB of English
    paragraphs = [re.sub(r"\s+", " ", p).strip() for key in sorted(topics) for p in topics[key].split("\n\n")]
    reference = set(paragraphs)
    held_out = {r["text"] for s in ("validation", "test") for r in examples[s]}
    # a held-out docstring repeated elsewhere (an inherited or copied docstring) stays out too
    paragraphs = [p for p in paragraphs + pretrain_docs if len(p) >= MIN_DOC_CHARS and p not in held_out]
    # 1 paragraph in 50 (by hash) is held out for MLM validation
    pre_val = [p for p in paragraphs if int(_hash(p)[:8], 16) % 50 == 0]
    pre_train = [p for p in paragraphs if int(_hash(p)[:8], 16) % 50 != 0]

    (out / "pretrain").mkdir(parents=True, exist_ok=True)
    (out / "classify").mkdir(parents=True, exist_ok=True)
    ner, qa, pairs = _derived_tasks(out, examples)
    # the training paragraphs by kind, two sources for a data.mixture (recipes/tiny-mlm-modern.yaml)
    files = {"pretrain/train.txt": pre_train, "pretrain/validation.txt": pre_val,
             "pretrain/reference.txt": [p for p in pre_train if p in reference],
             "pretrain/docstrings.txt": [p for p in pre_train if p not in reference]}
    for name, lines in files.items():
        (out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    for split, rows in examples.items():
        (out / "classify" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    train_counts = Counter(r["label"] for r in examples["train"])
    majority = train_counts.most_common(1)[0][0]
    manifest = {
        "format_version": FORMAT_VERSION,
        "python_stdlib": str(root),
        "labels": LABELS,
        "areas": {k: list(v) for k, v in AREAS.items()},
        "pretrain_lines": {"train": len(pre_train), "validation": len(pre_val)},
        "pretrain_chars": sum(len(p) for p in pre_train),
        "classify_examples": {s: len(r) for s, r in examples.items()},
        "qa_examples": {s: len(r) for s, r in qa.items()},
        "retrieval_pairs": {s: len(r) for s, r in pairs.items()},
        "ner_tags": NER_TAGS,
        "ner_examples": {s: len(r) for s, r in ner.items()},
        "ner_tag_counts": {s: dict(sorted(Counter(t for r in rows for t in r["ner_tags"]).items()))
                           for s, rows in ner.items()},
        "classify_label_counts": {s: dict(sorted(Counter(LABELS[r["label"]] for r in rows).items()))
                                  for s, rows in examples.items()},
        "majority_label": LABELS[majority],
        "majority_baseline_accuracy": {s: sum(r["label"] == majority for r in rows) / max(len(rows), 1)
                                       for s, rows in examples.items()},
        "sha256": {name: _hash((out / name).read_text(encoding="utf-8"))
                   for name in [*files, *(f"{kind}/{s}.jsonl" for kind in ("classify", "ner", "qa", "retrieval")
                                  for s in examples)]},
    }
    tmp = manifest_path.with_suffix(".tmp")   # the manifest is written last: its presence means "complete"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_path)
    return manifest


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="data/sample")
    args = parser.parse_args()
    m = build_sample(args.out_dir)
    print(json.dumps({k: m[k] for k in ("pretrain_lines", "pretrain_chars", "classify_examples",
                                        "majority_label", "majority_baseline_accuracy")}, indent=2))
