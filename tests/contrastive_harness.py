"""tests/test_contrastive.py's two-process half: each rank holds its half of a batch of pairs (rows in rank order),
runs bert_recipes.contrastive.cached_step with the embeddings gathered across ranks and a backward that averages
the gradient over the ranks and the micro batches as DDP and Accelerate's accumulation do; rank 0 writes the loss
and the averaged gradient, which must be one forward's over the whole batch on one process.

    torchrun --nproc_per_node 2 tests/contrastive_harness.py MODEL_DIR TEXTS_JSON MICRO OUT_PT"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bert_recipes.contrastive import cached_step   # noqa: E402
from test_contrastive import SCALE, embedder, micro_batches   # noqa: E402


def main(model_dir: str, texts_json: str, micro: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"[harness] rank {rank} of {world} processes, backend {dist.get_backend()}", flush=True)
    columns = json.loads(Path(texts_json).read_text())
    rows = len(columns[0]) // world
    mine = [c[rank * rows:(rank + 1) * rows] for c in columns]
    model, embed, tokenize = embedder(model_dir)
    batches = micro_batches(tokenize, mine, int(micro))

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def backward(surrogate):   # DDP's average over the ranks, Accelerate's over the micro batches
        (surrogate / len(batches)).backward()

    # no dropout here (the model's is 0): the replay is tested on one process, where a reference exists
    loss = cached_step(embed, batches, SCALE, backward, gather, rank, scale_back=len(batches) * world)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}   # not the unused pooler
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
