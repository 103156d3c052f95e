"""The contrastive loss of retrieval, and its step over a whole global batch (GradCache).

`in_batch_loss`: sentence-transformers' MultipleNegativesRankingLoss (its default: query to document, one softmax):
each query's cosine similarity to every candidate (every positive of the batch, then every hard negative) times the
scale (1 / temperature), cross-entropy towards its own positive, the mean over the queries.

`cached_step`: the loss over every micro batch of a step on every rank at once, and its gradient, in the memory of one
micro batch (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup";
sentence-transformers' CachedMultipleNegativesRankingLoss with gather_across_devices=True does the same):
1. each micro batch embedded without a graph, the random state before it kept;
2. the embeddings of every rank gathered; the loss over the global batch, and its gradient with respect to each
   embedding (every rank computes the same loss; each keeps its own rows' gradients);
3. each micro batch embedded again from its kept random state (the same dropout), and the kept gradients pushed
   through it: backward(sum(embedding * gradient)).
So the loss, and the parameters' gradient summed over the ranks, are those of one forward over the global batch,
whatever the process count and the accumulation. The caller's backward averages over ranks and micro batches (DDP,
DeepSpeed, Accelerate's accumulation); `scale_back` undoes that average. The replay's forward and backward of each
micro batch run inside the caller's `around(i)`, where an engine decides whether that micro batch syncs the gradient
(DDP's no_sync, Accelerate's accumulate): the engine's step belongs after the last one. The kept random state is
the CPU's and that of each GPU the micro batch's inputs are on (dropout's generators)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F


def in_batch_loss(queries: torch.Tensor, documents: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """queries [n, h]; documents: the positives [n, h], then any hard negatives [n, h] each (row i is query i's)."""
    candidates = torch.cat(list(documents), dim=0)
    scores = F.normalize(queries.float(), p=2, dim=1) @ F.normalize(candidates.float(), p=2, dim=1).T * scale
    return F.cross_entropy(scores, torch.arange(len(queries), device=queries.device))


@contextmanager
def replayed(state: dict, tensors: Sequence[torch.Tensor] = ()):
    """Run the block from a kept random state, or keep the state it starts from when `state` is empty: the CPU's and
    that of each GPU the `tensors` live on (torch.utils.checkpoint's device states, as activation checkpointing and
    sentence-transformers' RandContext keep them): dropout draws the same masks the second time."""
    from torch.utils.checkpoint import get_device_states, set_device_states
    if state:
        torch.set_rng_state(state["cpu"])
        set_device_states(state["devices"], state["states"])
    else:
        state["cpu"] = torch.get_rng_state()
        state["devices"], state["states"] = get_device_states(*tensors)
    yield


def cached_step(embed: Callable[[Any], torch.Tensor], micro_batches: Sequence[Any], scale: float,
                backward: Callable[[torch.Tensor], None], gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                rank: int = 0, scale_back: float = 1.0, around: Callable[[int], Any] | None = None,
                columns: int | None = None) -> torch.Tensor:
    """micro_batches: this rank's micro batches of the step, each a list of columns' model inputs (the queries, the
    positives, then any hard negatives), embed(inputs) -> [rows, h]; or, with `columns`, each one inputs dict whose
    embedding holds that many equal blocks of rows, the columns in that order (one forward a micro batch). gather:
    every rank's rows of a tensor in rank order (all_gather), None on one process; `rank` places this rank's rows in
    it. backward(tensor): the caller's backward of one micro batch (the engine's, averaging as it does); scale_back:
    the divisor that backward applies (its accumulation steps) x the ranks its gradient is averaged over; around(i):
    the context of micro batch i's replay and backward. -> the global batch's loss (detached), the same on every
    rank."""
    def embedded(batch) -> list[torch.Tensor]:
        return list(embed(batch).chunk(columns)) if columns else [embed(inputs) for inputs in batch]

    def tensors(batch) -> list[torch.Tensor]:
        return [t for inputs in ([batch] if columns else batch) for t in inputs.values() if isinstance(t, torch.Tensor)]

    states, parts = [], []
    for batch in micro_batches:
        state: dict = {}
        with torch.no_grad(), replayed(state, tensors(batch)):
            parts.append(embedded(batch))
        states.append(state)
    local = [torch.cat(column) for column in zip(*parts)]
    everyone = [gather(c) for c in local] if gather else local
    leaves = [c.detach().float().requires_grad_() for c in everyone]   # the kept gradients in fp32
    loss = in_batch_loss(leaves[0], leaves[1:], scale)
    loss.backward()
    start = rank * len(local[0])
    grads = [leaf.grad[start:start + len(local[0])] for leaf in leaves]
    at = 0
    for i, (batch, state) in enumerate(zip(micro_batches, states)):
        rows = len(parts[i][0])
        with (around(i) if around else nullcontext()):
            with replayed(state):
                surrogate = sum((e.float() * g[at:at + rows]).sum() for e, g in zip(embedded(batch), grads))
            backward(surrogate * scale_back)
        at += rows
    return loss.detach()


def accelerate_step(step, batches, scale: float, negatives: str) -> torch.Tensor:
    """The forward and backward of one optimizer step of retrieval under an Accelerate engine (train.py's step, for a
    kind whose row has sentence_embeddings; it clips, steps and schedules after this as for any kind): `step` the
    engine's AccelerateStep, `batches` this rank's micro batches (tasks/retrieval.py's collator: every column's texts
    in one batch, `columns` their count). negatives global: one cached_step over the step's `accum` micro batches
    and every rank's; micro: one a micro batch, over that micro batch of every rank (its loss the mean of theirs).
    Each micro batch's replay and backward run in Accelerate's accumulate, so the gradient syncs on the last one and
    DeepSpeed steps there, inside its backward. -> the step's loss (detached)."""
    a, model = step.accelerator, step.model
    world, rank = a.num_processes, a.process_index
    micro = [next(batches) for _ in range(step.accum)]
    columns = micro[0]["columns"].numel()

    def embed(batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    gather = a.gather if world > 1 else None
    if negatives == "global":
        return cached_step(embed, micro, scale, a.backward, gather, rank, scale_back=step.accum * world,
                           around=lambda i: a.accumulate(model), columns=columns)
    losses = [cached_step(embed, [batch], scale, a.backward, gather, rank, scale_back=world,
                          around=lambda i: a.accumulate(model), columns=columns) for batch in micro]
    return torch.stack(losses).mean()
