"""make bench's report: the runs summed up (median tokens/s and sequences/s, MFU in both conventions, data wait,
peak memory, padding, shapes, per-step times), the ratios of paired rows, bench.md / bench.json and the chart."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_rows import SIZES, WINDOW, row_nproc  # noqa: E402


def head_fraction(row_: dict, size: dict) -> float | None:
    """The share of positions the MLM head runs on: ours K = round(0.15 x seq) a sequence (0.15 on average
    with the per-token choice; all with the dense head); the Trainer's head is dense. None: no MLM head."""
    if not row_["workload"].startswith("mlm"):
        return None
    extra = row_.get("extra", [])
    if row_["side"] == "trainer" or "model.sparse_mlm_head=false" in extra:
        return 1.0
    return 0.15 if "data.max_predictions_per_seq=null" in extra else round(0.15 * size["seq"]) / size["seq"]

def mfu_of(row_: dict, size: dict, vocab: int, tokens_per_s: float, peak: float, head: float | None) -> float:
    """Model FLOPs per token (bert_recipes.throughput.flops_per_token with the given MLM head share) x tokens/s
    over one device's peak, per process."""
    from types import SimpleNamespace

    from bert_recipes.throughput import flops_per_token
    config = SimpleNamespace(hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
                             num_hidden_layers=size["num_hidden_layers"], vocab_size=vocab)
    return flops_per_token(config, size["seq"], head) * tokens_per_s / (peak * row_nproc(row_))

def summarize(state: dict) -> dict:
    """The table and the ratios of the runs finished so far (a cut run is listed apart)."""
    size, table = SIZES[state["size"]], []
    for r in state["rows"]:
        all_runs = state["runs"][r["name"] + "|" + r["precision"]]
        runs = [x for x in all_runs if not x.get("cut")]
        if not runs:
            if all_runs:
                table.append({**r, "cut": all_runs[-1]})
            continue
        table.append(summarize_row(r, runs, state, size))
    ratios = []
    for r in table:
        other = next((o for o in table if r.get("pair") and o["name"] == r["pair"] and o["precision"] == r["precision"]
                      and "cut" not in o), None)
        if other and "cut" not in r:
            ratios.append({"what": f"{r['name']} / {other['name']}", "precision": r["precision"],
                           "ratio": r["tokens_per_s"] / other["tokens_per_s"],
                           "sequences_ratio": r["sequences_per_s"] / other["sequences_per_s"]})
    return {k: v for k, v in state.items() if k != "rows"} | {"rows": table, "ratios": ratios}

def summarize_row(r: dict, runs: list[dict], state: dict, size: dict) -> dict:
    rates = [x["real_tokens"] / x["seconds"] for x in runs]   # useful tokens: padding does not count
    tokens_per_s = statistics.median(rates)
    sheet, measured = state["peaks"][r["precision"]]
    peak = sheet if sheet == sheet else measured   # the datasheet on GPUs; a CPU has none: the measured one
    last = runs[-1]
    times = last.get("step_times_ms") or []
    median_step = statistics.median(times) if times else None
    return {**{k: r.get(k) for k in ("name", "workload", "side", "precision", "pair")},
            "tokens_per_s": tokens_per_s, "rates": rates, "micro_batch": last.get("micro_batch"),
            "sequences_per_s": statistics.median(x["sequences"] * row_nproc(r) / x["seconds"] for x in runs),
            "mfu_anchors": mfu_of(r, size, state["vocab"], tokens_per_s, peak,
                                  1.0 if r["workload"].startswith("mlm") else None),
            "mfu_ours": mfu_of(r, size, state["vocab"], tokens_per_s, peak, head_fraction(r, size)),
            "mfu_measured_peak": mfu_of(r, size, state["vocab"], tokens_per_s, measured, head_fraction(r, size)),
            "data_wait": statistics.median(x["data_wait_s"] / x["seconds"] for x in runs),
            "peak_memory_mb": max(x["peak_memory_mb"] for x in runs), "predicted_peak_mb": last.get("predicted_peak_mb"),
            "padding": 1 - last["real_tokens"] / last["padded_tokens"], "shapes": last.get("shapes"),
            "step_ms_median": median_step, "step_ms_max": max(times) if times else None,
            "step_max_over_median": max(times) / median_step if times else None,
            "matmul_peak": measured, "datasheet_peak": sheet, "wall_s": last.get("wall_s"),
            "launch_s": last["wall_s"] - last["train_s"] if last.get("train_s") and last.get("wall_s") else None}

def write_outputs(result: dict, out: Path, chart_too: bool = True) -> str:
    text = render(result)
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    profiles = [(r["name"], runs[-1]["profile"]) for r in result["rows"] if "cut" not in r
                for runs in [result["runs"][r["name"] + "|" + r["precision"]]] if runs[-1].get("profile")]
    if profiles:   # train.py --profile's table of a row that profiled its warmup steps (logging.profile)
        (out / "profile.md").write_text("".join(f"## {name}\n\n```\n{table}\n```\n\n" for name, table in profiles))
    if chart_too and any("cut" not in r for r in result["rows"]):
        chart(result, out / "bench.png")
    return text

def render_quality(report: dict | None, ratios: list[dict]) -> list[str]:
    """The quality table (tools/quality.py) beside the speed ratio: a faster loop that learns less is not faster."""
    if not report:
        return []
    from quality import render
    speed = next((r for r in ratios if r["what"] == "mlm: train.py / mlm: Trainer"), None)
    lines = ["", f"## Quality against the Trainer: seeds {report['seeds']}, {report['mlm']['steps']} MLM steps "
             f"from the same initial weights on the same micro batches, then {report['classify']['steps']} "
             "fine-tuning steps from make demo's model (tools/quality.py)", ""]
    if speed:
        lines += [f"MLM tokens/s ratio (train.py / Trainer) in this run: **{speed['ratio']:.2f}x** ({speed['precision']})", ""]
    return lines + render(report)

def _pct(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.1%}"

def render(result: dict) -> str:
    m = result["model"]
    lines = [f"# make bench: {result['size']} (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
             f"{result['vocab']}, sequence {result['seq']}, micro batch {result['batch']} unless the row says), "
             f"{result['device']}, {result['date']}", "",
             f"{result['steps']} steps per MLM run and {result['classify_steps']} per fine-tuning run; train.py logs every "
             f"{WINDOW} steps and the first {result['warmup']} are not timed; median of {result['repeats']} alternating "
             "runs per row.", "",
             "| row | precision | micro batch | tokens/s | sequences/s | MFU, anchors' convention | MFU, ours | "
             "data-wait | peak memory MB (planner) | padding | shapes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "cut" in r:
            what = "failed" if r["cut"].get("failed") else f"cut at its limit of {r['cut']['limit_s']} s"
            lines.append(f"| {r['name']} | {r['precision']} | | | | | | | | | | {what}: "
                         f"{' / '.join(r['cut']['last_lines'][-2:])[:160]} |")
            continue
        planned = r.get("predicted_peak_mb")
        planned = f" ({planned:.0f})" if planned is not None and planned == planned else ""
        lines.append(f"| {r['name']} | {r['precision']} | {r['micro_batch']} | {r['tokens_per_s']:.0f} | "
                     f"{r['sequences_per_s']:.1f} | {_pct(r['mfu_anchors'])} | {_pct(r['mfu_ours'])} | "
                     f"{r['data_wait']:.1%} | {r['peak_memory_mb']:.0f}{planned} | {r['padding']:.0%} | "
                     f"{r['shapes'] if r['shapes'] is not None else 'n/a'} |")
    lines += ["", "| ratio | precision | tokens/s | sequences/s |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['precision']} | **{r['ratio']:.2f}x** | {r['sequences_ratio']:.2f}x |"
              for r in result["ratios"]]
    steps = [r for r in result["rows"] if "cut" not in r and r.get("step_ms_median")]
    if steps:
        lines += ["", "| per-step times after the warmup (logging.step_times) | median ms | max ms | max / median |",
                  "|---|---|---|---|"]
        lines += [f"| {r['name']} ({r['precision']}) | {r['step_ms_median']:.1f} | {r['step_ms_max']:.1f} | "
                  f"{r['step_max_over_median']:.2f} |" for r in steps]
    peaks_line = "; ".join(f"{p}: {m / 1e12:.2f} TFLOP/s measured" + (f", {d / 1e12:.0f} datasheet" if d == d else "")
                           for p, (d, m) in result["peaks"].items())
    lines += ["", "tokens/s counts the real tokens (`padding` is the share of the positions fed to the model that "
              "were padding; `shapes`, the distinct batch shapes). MFU is model FLOPs per token x tokens/s over one "
              "device's peak: the datasheet's on GPUs, the matmul peak measured in this run on CPUs. The anchors' "
              "convention counts 6N + 12 L d s FLOPs a token with the dense MLM head (BERT's papers, NVIDIA's and "
              "MosaicML's figures) whatever the code runs; ours counts what the row computes: the head on the "
              f"K = round(0.15 x sequence) predicted positions for train.py's default. Peaks: {peaks_line}. "
              "data-wait: the share of the timed steps spent waiting for batches (the Trainer: from a step's end to "
              "the next step's beginning). Peak memory: torch.cuda.max_memory_allocated on GPUs (and the memory "
              "planner's prediction for train.py), the process tree's resident memory on CPUs.", "",
              "One packed MLM micro batch of the sequence length on one CPU core (median): collating it (the "
              "collate_fn alone), and fetching its rows from the memory-mapped data:", "",
              "| work | " + " | ".join(f"{b} sequences, ms" for b in next(iter(result["collate_ms"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(result["collate_ms"].values())))]
    lines += [f"| collate: {name} | " + " | ".join(f"{ms:.2f}" for ms in by_batch.values()) + " |"
              for name, by_batch in result["collate_ms"].items()]
    lines += [f"| fetch 256 rows: {name} | {ms:.2f} | |" for name, ms in result.get("fetch_ms", {}).items()]
    if any("documents apart" in r["name"] or "unpadded" in r["name"] for r in result["rows"]):
        lines += ["", "Documents apart (data.document_mask: a packed row's documents attend within themselves) and unpadded "
                  "batches (data.unpad: one row of real tokens): " + (
                      "on this GPU through the plan's path (varlen under bf16, or the row's train.document_attention)."
                      if "CPU" not in str(result["device"]) else
                      "on CPUs both run a dense block-diagonal mask: SDPA computes every pair of positions and masks "
                      "the pairs across documents, so their tokens/s say what the mask costs here, not what varlen's "
                      "skipping of those pairs and of padding saves on a GPU (tools/gpu_session.py, part docs). The "
                      "padding share and the shapes are the same on either.")]
    lines += render_quality(result.get("quality"), result["ratios"])
    lines += render_accuracy(result.get("accuracy"))
    for precision, table in (result.get("profiles") or {}).items():
        lines += ["", f"## Where train.py's MLM step spends its time ({precision}): train.py --profile, steps 3-5",
                  "", "```", table or "(no profile table in the log)", "```"]
    return "\n".join(lines)

def render_accuracy(acc: dict | None) -> list[str]:
    if not acc:
        return []
    lines = ["", f"## Fine-tuning with and without data.group_by_length: the sample task, {acc['steps']} steps "
             f"from a tiny model pretrained {acc['pretrain_steps']} steps", "",
             "| batches | eval accuracy per seed | mean | padding | wall s (mean) |", "|---|---|---|---|---|"]
    for name, runs in acc["runs"].items():
        values = [r["accuracy"] for r in runs]
        lines.append(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.mean(values):.3f} | "
                     f"{statistics.mean(r['padding'] for r in runs):.0%} | "
                     f"{statistics.mean(r['wall_s'] for r in runs):.0f} |")
    base = acc["runs"]["grouped"][0]["baseline"]
    return lines + (["", f"Majority-class baseline: {base:.3f}."] if base else [])

def chart(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if "cut" not in r]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.8), 4.5))
    labels = [f"{r['name']}\n({r['precision']})" for r in rows]
    colors = ["#d62728" if r["side"] == "trainer" else "#1f77b4" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"train.py (blue) vs transformers Trainer (red): {result['size']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
