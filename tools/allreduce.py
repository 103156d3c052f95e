"""All-reduce bandwidth test, as a real multi-process job (NCCL on GPUs, gloo on CPU).

    torchrun --nproc_per_node 8 tools/allreduce.py                 # or: make allreduce NPROC=8
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tools/allreduce.py --max-bytes 64M

Reports, per message size, the time per all-reduce and the bandwidths as nccl-tests defines them:
algbw = bytes / time, busbw = algbw x 2(n-1)/n (the traffic each link carries in a ring, which is
comparable across process counts). The headline size (256 MiB by default) is checked against the
expected bus bandwidth of the link. A collective that does not finish within --timeout seconds is
reported with the debugging steps instead of hanging silently.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bert_recipes

# Expected all-reduce bus bandwidth (GB/s) that a healthy link reaches at large messages: about
# 60-80% of the link's theoretical unidirectional rate, as nccl-tests typically measure it.
EXPECTED_BUSBW_GBPS = {
    "pcie4": ("PCIe 4.0 x16", 20.0),
    "pcie5": ("PCIe 5.0 x16", 40.0),
    "nvlink3": ("NVLink 3 (A100)", 230.0),
    "nvlink4": ("NVLink 4 (H100/H200)", 360.0),
    "gloo-loopback": ("loopback gloo (CPU processes on one host)", 0.5),
    "network": ("between nodes (InfiniBand / Ethernet: compare with the NICs' rate)", 10.0),
}
HANG_HELP = """all-reduce did not finish within {timeout}s on rank {rank}: a hang, not a slow link.
Next steps:
  1. NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see which transport each rank picked
  2. check that every rank reaches the collective (a rank that crashed or skipped it hangs the rest)
  3. multi-node: NCCL_SOCKET_IFNAME=<interface> so all ranks use the same network; open main_process_port
  4. NCCL_P2P_DISABLE=1 to rule out broken peer-to-peer (then fix IOMMU/ACS or NCCL_P2P_LEVEL)
  5. NCCL_IB_DISABLE=1 to rule out InfiniBand, or NCCL_IB_HCA to pick the right adapter
  6. raise the timeout only once it is known to be slow, not stuck (InitProcessGroupKwargs(timeout=...))"""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def guess_link(gpu_name: str | None, multinode: bool) -> str:
    """The link a ring all-reduce is limited by: the network between nodes; NVLink only on SXM
    boards (PCIe cards and NVL pairs talk PCIe beyond their bridge); CPU processes use loopback."""
    if gpu_name is None:
        return "gloo-loopback"
    if multinode:
        return "network"
    pcie_card = "PCIe" in gpu_name or "PCIE" in gpu_name or "NVL" in gpu_name
    if "H100" in gpu_name or "H200" in gpu_name:
        return "pcie5" if pcie_card else "nvlink4"
    if "A100" in gpu_name:
        return "pcie4" if pcie_card else "nvlink3"
    return "pcie4"


def bus_factor(world: int) -> float:
    return 2 * (world - 1) / world


class Watchdog:
    """Reports and exits when one collective takes longer than `timeout` seconds."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self.deadline = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def arm(self):
        self.deadline = time.monotonic() + self.timeout

    def disarm(self):
        self.deadline = None

    def _run(self):
        while True:
            time.sleep(0.2)
            if self.deadline is not None and time.monotonic() > self.deadline:
                print(HANG_HELP.format(timeout=self.timeout, rank=self.rank), file=sys.stderr, flush=True)
                os._exit(3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default=None, help="default 1G on GPU, 64M on CPU")
    parser.add_argument("--headline", default="256M", help="the size checked against the link (capped at max)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--link", choices=sorted(EXPECTED_BUSBW_GBPS), default=None, help="default: guessed")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective counts as hung")
    parser.add_argument("--json-out", help="write the results as JSON (rank 0)")
    parser.add_argument("--simulate-hang-rank", type=int, default=None,
                        help="(testing the watchdog) this rank never joins the collectives")
    args = parser.parse_args()

    from bert_recipes.backends.plan import launch_plan_here
    cuda = launch_plan_here().on_gpu   # the same device decision as train.py's
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(args.timeout * 2, 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    multinode = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
    link = args.link or guess_link(torch.cuda.get_device_name(device) if cuda else None, multinode)
    max_bytes = parse_size(args.max_bytes or ("1G" if cuda else "64M"))
    sizes, size = [], parse_size(args.min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    headline = min(parse_size(args.headline), sizes[-1])
    watchdog = Watchdog(args.timeout, rank)
    if rank == args.simulate_hang_rank:
        time.sleep(args.timeout * 10)

    results = []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        watchdog.arm()
        for _ in range(args.warmup):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        sync()
        seconds = (time.perf_counter() - t0) / args.iters
        watchdog.disarm()
        # the slowest rank defines the collective's time
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = t.item()
        algbw = x.numel() * 4 / seconds / 1e9
        results.append({"bytes": x.numel() * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor(world)})

    if rank == 0:
        label, expected = EXPECTED_BUSBW_GBPS[link]
        print(f"all-reduce, {world} ranks, {backend}, float32, {args.iters} iterations per size")
        print(f"{'size':>10} {'time (us)':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in results:
            print(f"{fmt_bytes(r['bytes']):>10} {r['time_us']:>12.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f}")
        head = next(r for r in results if r["bytes"] >= headline)
        ok = head["busbw_gbps"] >= 0.6 * expected
        verdict = "pass" if ok else "slow: check topology, P2P, NCCL_P2P_DISABLE/NCCL_P2P_LEVEL"
        print(f"headline {fmt_bytes(head['bytes'])}: busbw {head['busbw_gbps']:.2f} GB/s vs expected ~{expected:g} GB/s "
              f"for {label} -> {verdict}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"world_size": world, "backend": backend, "link": link, "expected_busbw_gbps": expected,
                           "headline_bytes": head["bytes"], "verdict": verdict, "results": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
