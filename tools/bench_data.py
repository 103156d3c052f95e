"""make bench-data: preparing an MLM corpus as a token store of its files (make prepare STORE=1: datatrove reads them)
and as a run makes its own on first use (make prepare: datasets reads the text into its cache, datatrove tokenizes its
rows), side by side in one run, on a corpus generated from the sample (never committed): time, tokens/s a worker
against the tokenizer alone, disk bytes a token, peak resident memory, a run's start-up from each, and the training
sampler's memory at 10M sequences.

    python tools/bench_data.py --size 256M                 # both paths
    python tools/bench_data.py --size 4G --paths store      # the store of the files alone
    make bench-data SIZE=1G

Each measured command runs in a process of its own under a small wrapper that reports the peak resident memory of
every process it waited for (the preparation's workers included). The figures go to stdout as a table and to
<out>/bench-data.json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENIZER = "tests/data/wordpiece-1000"   # the suite's small WordPiece tokenizer (make test builds it)
SEQ = 128
WRAP = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "code = subprocess.run(sys.argv[1:]).returncode; "
        "print(json.dumps({'code': code, 'seconds': time.perf_counter() - t, "
        "'peak_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}), file=sys.stderr)")


def measured(cmd: list[str], log: Path) -> dict:
    """`cmd` in a process of its own: its exit code, wall seconds and peak resident MB (its largest process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-c", WRAP, *cmd], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.PIPE, text=True)
    result = json.loads(done.stderr.strip().splitlines()[-1])
    if result["code"]:
        raise SystemExit(f"[bench-data] {' '.join(cmd[:4])} ... failed (exit {result['code']}): see {log}")
    return result


def corpus(out: Path, size: str, parts: int) -> list[Path]:
    """The sample's text reshuffled to `size` (tools/prepare.py --make-corpus), cut into `parts` files by lines."""
    from prepare import make_corpus
    files = [out / f"part-{i:02d}.txt" for i in range(parts)]
    if all(f.exists() for f in files):
        return files
    whole = out / "all.txt"
    make_corpus(whole, size, REPO / "data/sample")
    lines = whole.read_text().splitlines(keepends=True)
    for i, f in enumerate(files):
        f.write_text("".join(lines[len(lines) * i // parts:len(lines) * (i + 1) // parts]))
    whole.unlink()
    return files


def tokenizer_alone(path: Path) -> float:
    """Tokens a second of the tokenizer alone on one core, over one file's lines (batches of 1,000)."""
    code = ("import sys, time; from tokenizers import Tokenizer; tok = Tokenizer.from_file(sys.argv[1]); "
            "lines = [l for l in open(sys.argv[2]).read().splitlines() if l.strip()]; t = time.perf_counter(); "
            "n = sum(len(e.ids) for i in range(0, len(lines), 1000) for e in tok.encode_batch(lines[i:i + 1000])); "
            "print(n / (time.perf_counter() - t))")
    done = subprocess.run([sys.executable, "-c", code, f"{TOKENIZER}/tokenizer.json", str(path)], capture_output=True,
                          text=True, env={**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                          check=True, cwd=REPO)
    return float(done.stdout)


def size_of(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths if p.exists() for f in ([p] if p.is_file() else p.rglob("*"))
               if f.is_file())


def startup(args: list[str], out: Path, log: Path) -> float:
    """Seconds from a run's start to its end after one step (no evaluation, no export)."""
    return measured([sys.executable, "train.py", "--recipe", "recipes/tiny-mlm.yaml", *args, "--train.max_steps=1",
                     "--train.eval_final=false", "--checkpoint.export=false", "--logging.progress_bar=false",
                     f"--run.output_dir={out}", "--run.overwrite=true"], log)["seconds"]


def sampler_memory(n: int = 10_000_000) -> dict:
    """Peak bytes of an epoch's order over n sequences: a seeded shuffle's list, and the store's PermutedOrder."""
    import tracemalloc

    import torch

    from bert_recipes.data.batching import PermutedOrder
    tracemalloc.start()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    shuffle = tracemalloc.get_traced_memory()[1]
    del order
    tracemalloc.reset_peak()
    for _, _ in zip(range(1_000_000), PermutedOrder(n, 0)):
        pass
    permuted = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"sequences": n, "shuffle_list_mb": shuffle / 2 ** 20, "permuted_order_mb": permuted / 2 ** 20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M", help="of the generated corpus: 256M, 1G, 4G ...")
    parser.add_argument("--paths", default="store,run", help="which preparations: store (of the files), run (a run's own)")
    parser.add_argument("--workers", type=int, default=2, help="processes of each preparation")
    parser.add_argument("--parts", type=int, default=8, help="files the corpus is cut into (one datatrove task each)")
    parser.add_argument("--out", default="data/bench-data", help="scratch: the corpus, the stores, the logs")
    args = parser.parse_args(argv)
    out = (REPO / args.out / args.size).resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = corpus(out / "corpus", args.size, args.parts)
    text_bytes = sum(f.stat().st_size for f in files)
    given = ["--data.source=files", f"--data.train_files=[{','.join(map(str, files))}]",
             f"--tokenizer.name_or_path={TOKENIZER}", f"--data.max_seq_length={SEQ}"]
    report = {"date": time.strftime("%Y-%m-%d"), "host": f"{os.uname().nodename}, {os.cpu_count()} cores",
              "size": args.size, "text_bytes": text_bytes, "workers": args.workers,
              "tokenizer_alone_tokens_per_s": tokenizer_alone(files[0]), "paths": {}}
    for path in args.paths.split(","):
        where = out / path
        if path == "store":
            run = measured([sys.executable, "tools/prepare.py", "--recipe", "recipes/tiny-mlm.yaml", "--out",
                            str(where), "--store", "--workers", str(args.workers), *given], out / "store.log")
            meta = json.loads((where / "store.json").read_text())
            tokens, disk = meta["tokens"], size_of(where / "tokens")
            start = startup(["--data.source=store", f"--data.store_dir={where}", f"--data.max_seq_length={SEQ}"],
                            out / "run-store", out / "run-store.log")
        elif path == "run":   # as a run makes its own on first use: datasets reads the text, datatrove tokenizes
            run = measured([sys.executable, "tools/prepare.py", "--recipe", "recipes/tiny-mlm.yaml", "--out",
                            str(where), "--workers", str(args.workers), *given], out / "run.log")
            metas = [json.loads(m.read_text()) for m in where.glob("bert_recipes_stores/*/store.json")]
            tokens, disk = sum(m["tokens"] for m in metas), size_of(where)
            start = startup([f"--data.cache_dir={where}", *given], out / "run-run", out / "run-run.log")
        else:
            raise SystemExit(f"[bench-data] --paths: {path} is not store or run")
        report["paths"][path] = {"seconds": run["seconds"], "peak_mb": run["peak_mb"], "tokens": tokens,
                                 "disk_bytes": disk, "bytes_per_token": disk / tokens,
                                 "tokens_per_s_per_worker": tokens / run["seconds"] / args.workers,
                                 "run_seconds_one_step": start}
    report["sampler"] = sampler_memory()
    (out / "bench-data.json").write_text(json.dumps(report, indent=1))
    print(f"# make bench-data: {args.size} of generated text ({text_bytes / 1e9:.2f} GB, {args.parts} files), "
          f"{args.workers} workers, {report['host']}, {report['date']}\n")
    print("| path | time | tokens/s a worker | tokens | disk, bytes a token | peak resident MB | a run's start to "
          "one step |")
    print("|---|---|---|---|---|---|---|")
    for path, r in report["paths"].items():
        print(f"| {path} | {r['seconds']:.0f} s | {r['tokens_per_s_per_worker'] / 1e6:.2f}M | {r['tokens'] / 1e6:.1f}M "
              f"| {r['disk_bytes'] / 1e9:.2f} GB, {r['bytes_per_token']:.2f} | {r['peak_mb']:.0f} | "
              f"{r['run_seconds_one_step']:.1f} s |")
    s = report["sampler"]
    print(f"\nThe tokenizer alone: {report['tokenizer_alone_tokens_per_s'] / 1e6:.2f}M tokens/s on one core. An "
          f"epoch's order over {s['sequences']:,} sequences: {s['shuffle_list_mb']:.0f} MB as a shuffle's list, "
          f"{s['permuted_order_mb']:.1f} MB as the store's PermutedOrder. Figures in {out / 'bench-data.json'}.")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "tools"))
    raise SystemExit(main())
