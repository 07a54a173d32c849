"""RESULTS.md from results.json: the paper-style table, retention, the probe, the sweep."""

from __future__ import annotations

import math
import statistics

from rl_tasks import TASK_NAMES


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def pct(values: list[float]) -> str:
    """Mean ± sd over seeds, in percent."""
    m, s = _mean_sd(values)
    return f"{100 * m:.1f} ± {100 * s:.1f}" if len(values) > 1 else f"{100 * m:.1f}"


def _scores(results: dict, model: str, task: str) -> list[float]:
    per_seed = results["scores"].get(model, {}).get(task, {})
    return [per_seed[str(s)] for s in results["plan"]["seeds"] if str(s) in per_seed]


def _avg_per_seed(results: dict, model: str) -> list[float]:
    out = []
    for s in results["plan"]["seeds"]:
        row = [results["scores"].get(model, {}).get(t, {}).get(str(s)) for t in TASK_NAMES]
        if all(v is not None for v in row):
            out.append(statistics.fmean(row))
    return out


MIN_GAIN = 0.05
"""An agent "clearly improved" its task when it gained at least this over the base."""


def retention(results: dict, model: str) -> dict[str, dict[str, list[float]]]:
    """Per task and seed: score / specialist's score, and (score - base) / (specialist - base),
    the share of the RL gain kept, only where the specialist gained at least MIN_GAIN (a
    smaller gain would make the ratio noise)."""
    out: dict[str, dict[str, list[float]]] = {}
    for t in TASK_NAMES:
        ratio, gain = [], []
        for s in map(str, results["plan"]["seeds"]):
            m = results["scores"].get(model, {}).get(t, {}).get(s)
            spec = results["scores"].get(f"agent-{t}", {}).get(t, {}).get(s)
            base = results["scores"].get("base", {}).get(t, {}).get(s)
            if m is None or spec is None or base is None:
                continue
            if spec > 0:
                ratio.append(m / spec)
            if spec - base >= MIN_GAIN:
                gain.append((m - base) / (spec - base))
        out[t] = {"score_ratio": ratio, "gain_kept": gain}
    return out


def probe_summary(results: dict) -> dict:
    """Per task over seeds: density, unique share, rho, lambda; and the overlap shares."""
    seeds = [str(s) for s in results["plan"]["seeds"] if str(s) in results["probe"]]
    out: dict = {}
    for i, t in enumerate(TASK_NAMES):
        rows = [results["probe"][s]["report"]["tasks"][i] for s in seeds]
        hist = [[h / max(1, r["changed"]) for h in r["histogram"]] for r in rows]
        out[t] = {
            "density": [r["density"] for r in rows],
            "unique_share": [r["unique"] / max(1, r["changed"]) for r in rows],
            "rho": [float(r["rho"]) for r in rows],
            "lambda_ram_plus": [r["lambda"]["ram_plus"] for r in rows],
            "lambda_ram_plus_soft": [r["lambda"]["ram_plus_soft"] for r in rows],
            "overlap_share": [statistics.fmean(h[k] for h in hist) for k in range(len(hist[0]))],
        }
    return out


def sparsity_sentence(summary: dict) -> str:
    """A plain statement of what the probe measured, whatever it is."""
    dens = {t: statistics.fmean(v["density"]) for t, v in summary.items()}
    uniq = {t: statistics.fmean(v["unique_share"]) for t, v in summary.items()}
    lo, hi = min(dens.values()), max(dens.values())
    sparse = "sparse" if hi < 0.5 else ("dense" if lo > 0.5 else "mixed: some sparse, some dense")
    spread = hi / lo if lo > 0 else math.inf
    hetero = spread >= 1.5 or (max(uniq.values()) - min(uniq.values())) >= 0.15
    parts = ", ".join(f"{t} {100 * dens[t]:.1f}%" for t in dens)
    uparts = ", ".join(f"{t} {100 * uniq[t]:.1f}%" for t in uniq)
    return (
        f"Measured: the task vectors are {sparse} (density {parts}; the paper reports 3.2%, "
        f"46.2% and 54.3% for its 7B agents) and "
        f"{'heterogeneous' if hetero else 'not strongly heterogeneous'} "
        f"(densities differ {spread:.1f}x between tasks; unique share of each task's changes: "
        f"{uparts}; the paper: 6.3%, 40.8%, 47.5%)."
    )


def write_results_md(results: dict, path: str) -> None:
    seeds = results["plan"]["seeds"]
    main = results["main_methods"]
    agents = [f"agent-{t}" for t in TASK_NAMES]
    n = len(seeds)
    cell = "mean ± sd over seeds" if n > 1 else "one seed"
    lines = [
        "# RL agents merged: does RAM keep what each agent learned?",
        "",
        f"Made by `{results['command']}` in {results['wall_s'] / 60:.1f} min "
        f"on {results['machine']['cpus']} CPU cores "
        f"(load average at the end {_load(results)}).",
        "",
        _setup(results),
        "",
        "## Summary (generated from the numbers below)",
        "",
        *_summary(results),
        "",
        f"## Scores (% of held-out prompts solved, greedy; {cell}, seeds {list(seeds)})",
        "",
        "| model | " + " | ".join(TASK_NAMES) + " | avg | avg - RAM+ avg, same seed |",
        "|---|" + "---:|" * (len(TASK_NAMES) + 2),
    ]
    ref = _avg_per_seed(results, "ram_plus")
    best = {
        t: max(main, key=lambda m, t=t: statistics.fmean(_scores(results, m, t) or [-1]))
        for t in TASK_NAMES
    }
    best["avg"] = max(main, key=lambda m: statistics.fmean(_avg_per_seed(results, m) or [-1]))
    for model in ["base", *agents, *main]:
        cells = []
        for t in TASK_NAMES:
            c = pct(_scores(results, model, t))
            if model in agents and model == f"agent-{t}":
                c = f"*{c}*"
            if best.get(t) == model:
                c = f"**{c}**"
            cells.append(c)
        per_seed = _avg_per_seed(results, model)
        avg = pct(per_seed)
        cells.append(f"**{avg}**" if best["avg"] == model else avg)
        paired = [m - r for m, r in zip(per_seed, ref, strict=False)]
        cells.append(pct(paired) if len(paired) == len(ref) and ref else "")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "*Italic*: an agent on its own task. **Bold**: the best merge in the column. The last "
        "column pairs each model with RAM+ of the same seed (same base, same agents), which "
        "removes the spread that comes from the base.",
        "",
        "## Retention of the specialists",
        "",
        "Per task, a merge's score divided by the specialist's score on that task (score kept), "
        "and `(merge - base) / (specialist - base)` (share of the RL gain kept; 1 = all of it, "
        "0 = back to the base, < 0 = below the base; only for seeds where the specialist "
        f"gained at least {100 * MIN_GAIN:.0f} points), averaged over seeds, then over tasks.",
        "",
        "| merge | " + " | ".join(f"{t} score kept" for t in TASK_NAMES) + " | mean score kept "
        "| " + " | ".join(f"{t} gain kept" for t in TASK_NAMES) + " | mean gain kept |",
        "|---|" + "---:|" * (2 * len(TASK_NAMES) + 2),
    ]
    for model in main:
        ret = retention(results, model)
        ratio = [_fmt(ret[t]["score_ratio"]) for t in TASK_NAMES]
        gain = [_fmt(ret[t]["gain_kept"]) for t in TASK_NAMES]
        mean_ratio = _fmt(
            [statistics.fmean(ret[t]["score_ratio"]) for t in TASK_NAMES if ret[t]["score_ratio"]]
        )
        mean_gain = _fmt(
            [statistics.fmean(ret[t]["gain_kept"]) for t in TASK_NAMES if ret[t]["gain_kept"]]
        )
        lines.append(f"| {model} | " + " | ".join([*ratio, mean_ratio, *gain, mean_gain]) + " |")
    lines += ["", "## What RL did", "", _rl_section(results), ""]
    summary = probe_summary(results)
    lines += [
        "## The task vectors (`ram-dist probe`)",
        "",
        sparsity_sentence(summary),
        "",
        "![density and overlap per task, seed " + str(seeds[0]) + "](figure2.png)",
        "",
        f"Per task ({cell}): density = share of all weights the agent changed "
        "(|tau| > 1e-5); overlap k = share of the agent's changed weights that exactly k "
        "agents changed (k = 1: unique to it); rho = shared / unique; lambda = the RAM+ and "
        "RAM+s factors on its unique changes (r = 0.1, alpha = 2).",
        "",
        "| task | density % | "
        + " | ".join(f"overlap k={k} %" for k in range(1, len(TASK_NAMES) + 1))
        + " | rho | lambda RAM+ | lambda RAM+s |",
        "|---|" + "---:|" * (len(TASK_NAMES) + 4),
    ]
    for t, v in summary.items():
        lines.append(
            f"| {t} | {pct(v['density'])} | "
            + " | ".join(f"{100 * x:.1f}" for x in v["overlap_share"])
            + f" | {_fmt(v['rho'], 2)} | {_fmt(v['lambda_ram_plus'], 3)} | "
            f"{_fmt(v['lambda_ram_plus_soft'], 3)} |"
        )
    lines += ["", _steps_section(results)]
    sweep = results.get("sweep_methods") or []
    if sweep:
        lines += [
            "",
            "## Sensitivity (not used for the table above)",
            "",
            "Each method's own knob over a grid, the same grid for every seed; the main table's "
            "settings were fixed before any run. Average over tasks and seeds.",
            "",
            "| merge | " + " | ".join(TASK_NAMES) + " | avg |",
            "|---|" + "---:|" * (len(TASK_NAMES) + 1),
        ]
        for model in sorted([*main, *sweep]):
            cells = [pct(_scores(results, model, t)) for t in TASK_NAMES]
            cells.append(pct(_avg_per_seed(results, model)))
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "## Every score", "", "| model | seed | " + " | ".join(TASK_NAMES) + " |"]
    lines.append("|---|---:|" + "---:|" * len(TASK_NAMES))
    for model in results["models"]:
        for s in seeds:
            row = [results["scores"].get(model, {}).get(t, {}).get(str(s)) for t in TASK_NAMES]
            lines.append(
                f"| {model} | {s} | "
                + " | ".join("" if v is None else f"{100 * v:.1f}" for v in row)
                + " |"
            )
    lines += ["", "## Commands (seed " + str(seeds[0]) + ")", "", "```"]
    lines.append(results["probe"][str(seeds[0])]["command"])
    commands = [info["command"] for info in results["merges"][str(seeds[0])].values()]
    lines += list(dict.fromkeys(commands))  # a sweep's command once for all its merges
    lines += ["```", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def _fmt(values: list[float], digits: int = 2) -> str:
    if not values:
        return "n/a"
    m, s = _mean_sd(values)
    if not math.isfinite(m):
        return str(m)
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def _load(results: dict) -> str:
    load = results["machine"].get("loadavg_at_end")
    return "n/a" if not load else f"{load[0]:.1f}"


def _setup(results: dict) -> str:
    p = results["plan"]
    size = p["size"]
    params = next(iter(results["training"].values()))["sft"].get("parameters", "?")
    return (
        f"Model: Qwen2-shaped decoder, hidden {size['hidden']}, {size['layers']} layers, "
        f"{size['heads']} heads ({size['kv_heads']} KV), MLP {size['intermediate']}, "
        f"{params} parameters, character vocabulary, weights saved in bf16. "
        f"Base: {p['sft_steps']} supervised steps of {p['sft_batch']} on the task mixture. "
        f"Agents: {p['rl_steps']} GRPO steps of {p['rl_prompts']} prompts x {p['rl_group']} "
        f"samples on one task each (reward = the verifier's score, lr {p['rl_lr']}). "
        f"Evaluation: {p['eval_n']} held-out prompts per task, greedy."
    )


def _rl_section(results: dict) -> str:
    rows = [
        "| agent | base on its task | agent on its task | train reward, first 10 steps "
        "| train reward, last 10 steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in TASK_NAMES:
        first, last = [], []
        for s in results["plan"]["seeds"]:
            curve = results["training"][str(s)]["rl"][t]["train_reward"]
            first.append(statistics.fmean(curve[:10]))
            last.append(statistics.fmean(curve[-10:]))
        rows.append(
            f"| agent-{t} | {pct(_scores(results, 'base', t))} | "
            f"{pct(_scores(results, f'agent-{t}', t))} | {pct(first)} | {pct(last)} |"
        )
    return "\n".join(rows)


def _steps_section(results: dict) -> str:
    """How far the changed weights moved, in bf16 steps (mean over seeds)."""
    seeds = [str(s) for s in results["plan"]["seeds"] if "bf16_steps" in results["probe"][str(s)]]
    if not seeds:
        return ""
    labels = list(results["probe"][seeds[0]]["bf16_steps"][TASK_NAMES[0]]["share_by_steps"])
    rows = [
        "How far each agent's changed weights moved from the base, in bf16 steps (adjacent "
        "representable values), as a share of its changed weights (mean over seeds):",
        "",
        "| agent | " + " | ".join(f"{k} step(s) %" for k in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for t in TASK_NAMES:
        shares = [
            statistics.fmean(
                results["probe"][s]["bf16_steps"][t]["share_by_steps"][k] for s in seeds
            )
            for k in labels
        ]
        rows.append(f"| agent-{t} | " + " | ".join(f"{100 * x:.1f}" for x in shares) + " |")
    return "\n".join(rows)


def _paired(results: dict, model: str, ref: str) -> list[float]:
    a, b = _avg_per_seed(results, model), _avg_per_seed(results, ref)
    return [x - y for x, y in zip(a, b, strict=False)] if len(a) == len(b) else []


def _summary(results: dict) -> list[str]:
    seeds = [str(s) for s in results["plan"]["seeds"]]
    out = []
    gains = []
    for t in TASK_NAMES:
        per = [
            results["scores"][f"agent-{t}"][t][s] - results["scores"]["base"][t][s] for s in seeds
        ]
        weak = [s for s, g in zip(seeds, per, strict=True) if g < MIN_GAIN]
        note = f" (less than {100 * MIN_GAIN:.0f} points in seed {', '.join(weak)})" if weak else ""
        gains.append(f"{t} {signed(per)}{note}")
    out.append(
        "- RL: each agent's gain on its own task over the base, in points (mean over seeds): "
        + "; ".join(gains)
        + "."
    )
    main = results["main_methods"]
    ranked = sorted(main, key=lambda m: -statistics.fmean(_avg_per_seed(results, m) or [0]))
    out.append(
        "- Merges, by average score over tasks and seeds: "
        + ", ".join(f"{m} {100 * statistics.fmean(_avg_per_seed(results, m)):.1f}" for m in ranked)
        + "."
    )
    for ours in ("ram", "ram_plus"):
        cmp = []
        for other in main:
            if other.startswith("ram"):
                continue
            diff = _paired(results, ours, other)
            wins = sum(d > 0 for d in diff)
            cmp.append(f"{other} {signed(diff)} ({wins} of {len(diff)} seeds ahead)")
        head = f"- {ours} minus each baseline, paired by seed, in points: "
        out.append(head + "; ".join(cmp) + ".")
    if "task_arithmetic@w=0.33" in results["scores"]:
        diff = _paired(results, "ram", "task_arithmetic@w=0.33")
        out.append(
            "- ram minus the plain mean of the agents (task_arithmetic at weight 1/3, from the "
            f"sensitivity grid): {signed(diff)} points."
        )
    diff = _paired(results, "ram_plus", "ram")
    out.append(f"- ram_plus minus ram: {signed(diff)} points.")
    summary = probe_summary(results)
    all3 = statistics.fmean(v["overlap_share"][-1] for v in summary.values())
    out.append(
        f"- Probe: {sparsity_sentence(summary)} On average {100 * all3:.0f}% of an agent's "
        "changed weights were changed by all agents: there RAM takes the mean of the three "
        "changes, as plain averaging does, while task arithmetic at weight 1 adds them."
    )
    return out


def signed(values: list[float]) -> str:
    """A signed mean ± sd over seeds, in points."""
    if not values:
        return "n/a"
    m, s = _mean_sd([100 * v for v in values])
    return f"{m:+.1f} ± {s:.1f}" if len(values) > 1 else f"{m:+.1f}"
