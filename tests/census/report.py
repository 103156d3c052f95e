"""Where the suite's processes go: python tests/census/report.py [census.tsv] (see sitecustomize.py here).
Prints the processes by kind (count, CPU seconds and wall seconds of those that ended normally) and the
tests that start the most processes."""
import collections
import sys


def kind(argv: str) -> str:
    if "accelerate launch" in argv or "torchrun" in argv or "bert_recipes.launch" in argv:
        return "launcher"
    if "train.py" in argv or "fsdp_cpu_harness" in argv:
        return "rank (train.py)"
    if "tools/" in argv:
        return "tool " + argv.split("tools/")[1].split()[0]
    if "cpuinfo" in argv:
        return "py-cpuinfo (DeepSpeed's op builders)"
    return "other: " + (argv.split()[0][-40:] if argv else "?")


def main(path: str = "/tmp/suite-census.tsv") -> None:
    started, ended = {}, {}
    for line in open(path):
        parts = line.rstrip("\n").split("\t")
        if parts[0] == "S":
            started[parts[1]] = (float(parts[2]), parts[4], parts[5] if len(parts) > 5 else "")
        elif parts[0] == "E":
            ended[parts[1]] = (float(parts[2]), float(parts[3]))
    count, cpu, wall = collections.Counter(), collections.Counter(), collections.Counter()
    per_test = collections.defaultdict(collections.Counter)
    for pid, (t0, argv, test) in started.items():
        k = kind(argv)
        count[k] += 1
        per_test[test][k] += 1
        if pid in ended:
            cpu[k] += ended[pid][1]
            wall[k] += ended[pid][0] - t0
    print(f"{len(started)} processes, {len(ended)} ended normally (CPU and wall seconds count only those)")
    for k, n in count.most_common():
        print(f"{n:6d} {cpu[k]:9.1f} cpu-s {wall[k]:9.1f} wall-s  {k}")
    print("\ntests starting the most processes:")
    for test, kinds in sorted(per_test.items(), key=lambda kv: -sum(kv[1].values()))[:25]:
        print(f"{sum(kinds.values()):4d}  {test or '(the session: setup, pytest, background builds)'}  {dict(kinds)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
