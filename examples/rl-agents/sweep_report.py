"""The regime sweep's outputs from what its jobs left on disk: sweep.json, SWEEP.md (the
crossover table, the ablations), crossover.png and regime_map.json (what `ram-dist probe`
places a user's agents on)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics

from rl_report import MIN_GAIN, pct, signed
from rl_tasks import TASK_NAMES


def record(folder: str, kind: str = "job") -> str:
    """The file beside a model folder (never inside it) that records a job's result: a
    merge copies every non-weight file of its base, so a record inside the base would be
    copied into each merged model."""
    return f"{folder.rstrip(os.sep)}.{kind}.json"


BASELINES = ("task_arithmetic", "task_arithmetic@w=0.33", "ties", "dare_ties", "ram")
LABELS = {"task_arithmetic@w=0.33": "mean"}


def _read(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _avg(scores: dict) -> float:
    return statistics.fmean(scores[t] for t in TASK_NAMES)


def collect(out: str, sweep, points, lay) -> dict:
    """Every number the jobs wrote, by point and seed (missing ones are left out)."""
    seeds = [str(s) for s in sweep.plan.seeds]
    res: dict = {
        "plan": sweep.plan.to_json(),
        "lrs": [list(x) for x in sweep.lrs],
        "seeds": seeds,
        "smoke": sweep.smoke,
        "methods": [m for m, _ in sweep.methods],
        "ablations": [m for m, _ in sweep.ablations],
        "points": [{"name": p.name, "lr": p.lr, "steps": dict(p.steps)} for p in points],
        "base": {},
        "training": {},
        "point": {},
    }
    for s in sweep.plan.seeds:
        base = _read(record(lay.base(s), "scores"))
        job = _read(record(lay.base(s)))
        if base:
            res["base"][str(s)] = base["scores"]
        if job:
            res["training"][str(s)] = {"sft_wall_s": job["wall_s"], "parameters": job["parameters"]}
    for p in points:
        rows: dict = {}
        for s in sweep.plan.seeds:
            row: dict = {"agents": {}, "probe": None, "scores": {}, "commands": {}}
            for t in TASK_NAMES:
                folder = lay.agent(s, p.lr, t, p.updates(t))
                sc, job = (
                    _read(record(folder, "scores")),
                    _read(record(folder)),
                )
                if sc and job:
                    rewards = job["train_reward"][: p.updates(t)]
                    row["agents"][t] = {
                        "scores": sc["scores"],
                        "reward_first10": statistics.fmean(rewards[:10]),
                        "reward_last10": statistics.fmean(rewards[-10:]),
                        "trajectory_wall_s": job["wall_s"],
                    }
            probe = _read(os.path.join(lay.point(s, p.name), "probe.json"))
            if probe:
                row["probe"] = {
                    t: {
                        "density": r["density"],
                        "unique_share": r["unique"] / max(1, r["changed"]),
                        "rho": float(r["rho"]),
                        "lambda_ram_plus": r["lambda"]["ram_plus"],
                    }
                    for t, r in zip(TASK_NAMES, probe["tasks"], strict=True)
                }
                row["commands"]["probe"] = _read(
                    record(os.path.join(lay.point(s, p.name), "probe"), "command")
                )
            for m in res["methods"] + res["ablations"]:
                folder = lay.merged(s, p.name, m)
                sc = _read(record(folder, "scores"))
                if sc:
                    row["scores"][m] = sc["scores"]
                    row["commands"][m] = _read(record(folder, "command"))
            rows[str(s)] = row
        res["point"][p.name] = rows
    return res


def point_summary(res: dict, name: str) -> dict | None:
    """Means over seeds: density, unique share, own-task gains, RAM+ minus each baseline
    (paired by seed); None until every seed of the point is scored."""
    rows = res["point"][name]
    seeds = [s for s in res["seeds"] if s in res["base"]]
    complete = [
        s
        for s in seeds
        if rows[s]["probe"]
        and len(rows[s]["agents"]) == len(TASK_NAMES)
        and all(m in rows[s]["scores"] for m in ("ram_plus", *BASELINES))
    ]
    if not complete or len(complete) < len(res["seeds"]):
        return None
    dens = {t: [rows[s]["probe"][t]["density"] for s in complete] for t in TASK_NAMES}
    uniq = {t: [rows[s]["probe"][t]["unique_share"] for s in complete] for t in TASK_NAMES}
    gain = {
        t: [rows[s]["agents"][t]["scores"][t] - res["base"][s][t] for s in complete]
        for t in TASK_NAMES
    }
    ram_plus = [_avg(rows[s]["scores"]["ram_plus"]) for s in complete]
    delta = {
        b: [rp - _avg(rows[s]["scores"][b]) for rp, s in zip(ram_plus, complete, strict=True)]
        for b in BASELINES
    }
    point = next(p for p in res["points"] if p["name"] == name)
    return {
        "name": name,
        "lr": point["lr"],
        "steps": point["steps"],
        "seeds": complete,
        "density": {t: statistics.fmean(v) for t, v in dens.items()},
        "unique_share": {t: statistics.fmean(v) for t, v in uniq.items()},
        "mean_density": statistics.fmean(x for v in dens.values() for x in v),
        "mean_unique_share": statistics.fmean(x for v in uniq.values() for x in v),
        "gain": {t: statistics.fmean(v) for t, v in gain.items()},
        "gain_by_seed": gain,
        "learned": {t: statistics.fmean(v) >= MIN_GAIN for t, v in gain.items()},
        "ram_plus_avg": statistics.fmean(ram_plus),
        "avg": {
            m: statistics.fmean(_avg(rows[s]["scores"][m]) for s in complete)
            for m in res["methods"]
            if all(m in rows[s]["scores"] for s in complete)
        },
        "delta": {
            b: {
                "mean": statistics.fmean(v),
                "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
                "ahead": sum(x > 0 for x in v),
                "behind": sum(x < 0 for x in v),
                "n": len(v),
                "by_seed": v,
            }
            for b, v in delta.items()
        },
    }


def ablation_point(res: dict) -> str:
    """The sparsest point (lowest mean density) where every agent learned its task; if no
    point has that, the point whose least-improved agent gained most (said in SWEEP.md)."""
    rows = [x for x in (point_summary(res, p["name"]) for p in res["points"]) if x]
    if not rows:
        raise RuntimeError("no point of the sweep is scored yet")
    learned = [r for r in rows if all(r["learned"].values())]
    if learned:
        return min(learned, key=lambda r: r["mean_density"])["name"]
    return max(rows, key=lambda r: min(r["gain"].values()))["name"]


def regime_map(res: dict, summaries: list[dict]) -> dict:
    """The measured map from (density, unique share) to RAM+ minus each baseline: the data
    `ram-dist probe` cites (ram_dist/report/regime_map.json is a copy of the full run's)."""
    params = {t["parameters"] for t in res["training"].values()}
    return {
        "source": "examples/rl-agents/sweep.py (RESULTS.md, 'When does RAM help?')",
        "model": (
            f"{'/'.join(f'{p / 1e6:.2g}M' for p in sorted(params))}-parameter Qwen2-shaped "
            f"agents (add, kv, tool; bf16), {len(res['seeds'])} "
            + ("seed" if len(res["seeds"]) == 1 else "seeds")
        ),
        "smoke": bool(res.get("smoke")),
        "ram_plus": "ram_plus --r 0.1 --alpha 2.0",
        "points": [
            {
                "name": s["name"],
                "lr": s["lr"],
                "steps": s["steps"],
                "mean_density": s["mean_density"],
                "mean_unique_share": s["mean_unique_share"],
                "learned": all(s["learned"].values()),
                "seeds": len(s["seeds"]),
                "ram_plus_minus": {
                    LABELS.get(b, b): {k: s["delta"][b][k] for k in ("mean", "sd", "ahead", "n")}
                    for b in BASELINES
                },
            }
            for s in summaries
        ],
    }


def _figure(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, xlabel in (
        (axes[0], "mean_density", "density of the task vectors (mean over agents and seeds)"),
        (axes[1], "mean_unique_share", "unique share of each agent's changes (mean)"),
    ):
        for b, marker in zip(BASELINES, "osD^v", strict=True):
            pts = sorted(summaries, key=lambda s: s[key])
            xs = [100 * s[key] for s in pts]
            ys = [100 * s["delta"][b]["mean"] for s in pts]
            es = [100 * s["delta"][b]["sd"] for s in pts]
            line = ax.errorbar(xs, ys, yerr=es, marker=marker, ls="-", lw=0.8, capsize=2, ms=5)
            color = line[0].get_color()
            for s, x, y in zip(pts, xs, ys, strict=True):
                if not all(s["learned"].values()):
                    ax.plot(x, y, marker=marker, ms=9, mfc="white", mec=color, ls="none")
            line.set_label(f"RAM+ - {LABELS.get(b, b)}")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel(xlabel + ", %")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RAM+ minus baseline, avg score, points (paired by seed)")
    axes[0].legend(fontsize=8)
    fig.suptitle("When does RAM+ help? (hollow: some agent did not learn its task)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep_outputs(res: dict, out: str) -> None:
    summaries = [x for x in (point_summary(res, p["name"]) for p in res["points"]) if x]
    res["summaries"] = summaries
    with open(os.path.join(out, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "regime_map.json"), "w", encoding="utf-8") as f:
        json.dump(regime_map(res, summaries), f, indent=1)
    if summaries:
        _figure(summaries, os.path.join(out, "crossover.png"))
    with open(os.path.join(out, "SWEEP.md"), "w", encoding="utf-8") as f:
        f.write(sweep_markdown(res, summaries))


BEGIN, END = "<!-- sweep: made by sweep.py --into -->", "<!-- /sweep -->"


def write_into(out: str, results_md: str) -> None:
    """Put DIR/SWEEP.md between the markers of `results_md` (RESULTS.md beside run.py's
    tables), and DIR/crossover.png beside it."""
    with open(os.path.join(out, "SWEEP.md"), encoding="utf-8") as f:
        section = f.read().strip()
    with open(results_md, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{results_md} has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(results_md, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{section}\n{END}{tail}")
    shutil.copyfile(
        os.path.join(out, "crossover.png"),
        os.path.join(os.path.dirname(results_md), "crossover.png"),
    )


def sweep_markdown(res: dict, summaries: list[dict]) -> str:
    plan = res["plan"]
    runs = res.get("runs") or []
    made = f"Made by `{res.get('command', 'python examples/rl-agents/sweep.py')}`"
    if runs:
        total = sum(r["wall_s"] for r in runs) / 60
        each = ", ".join(f"{r['wall_s'] / 60:.1f}" for r in runs)
        cpus = res.get("machine", {}).get("cpus", "?")
        made += (
            f" in {total:.1f} min on {cpus} CPU cores"
            if len(runs) == 1
            else f", in {len(runs)} runs that each resumed the one before, {total:.1f} min in all "
            f"on {cpus} CPU cores ({each} min)"
        )
    lines = [
        "## When does RAM help? The regime sweep",
        "",
        made + ".",
        "",
        f"The bases, tasks, RL batch ({plan['rl_prompts']} prompts x {plan['rl_group']} samples) "
        f"and evaluation ({plan['eval_n']} held-out prompts per task, greedy) are the main run's; "
        "only the RL learning rate and the number of updates vary (fp32 master weights, bf16 "
        "checkpoints). Each point is one set of three agents; `all N`: every agent took N "
        "updates, `het`: add, kv and tool took different numbers (heterogeneous, as the paper's). "
        f"Seeds {', '.join(res['seeds'])}; every merge is a `ram-dist` command (`sweep.json` "
        "has each), RAM+ at the paper's defaults (r 0.1, alpha 2). Density and unique share "
        "come from `ram-dist probe` (an element counts as changed when |tau| > 1e-5). "
        f"An agent *learned* when it gained at least {100 * MIN_GAIN:.0f} points on its own "
        "task over the base (mean over seeds); points where one did not are kept and marked.",
        "",
    ]
    if not summaries:
        return "\n".join([*lines, "No point is scored yet.", ""])
    lines += _verdict(summaries)
    lines += [
        "",
        "![RAM+ minus each baseline against density and unique share](crossover.png)",
        "",
        "RAM+ minus each baseline: the average score over the three tasks, in points, mean ± sd "
        "over seeds paired by seed (same base, same agents), and in how many seeds RAM+ was "
        "ahead.",
        "",
        "| point | lr | updates add/kv/tool | density add/kv/tool % | unique share add/kv/tool % "
        "| own-task gain add/kv/tool, points | RAM+ avg | "
        + " | ".join(f"- {LABELS.get(b, b)}" for b in BASELINES)
        + " |",
        "|---|---:|---|---|---|---|---:|" + "---:|" * len(BASELINES),
    ]
    for s in sorted(summaries, key=lambda s: s["mean_density"]):
        gains = "/".join(
            f"{100 * s['gain'][t]:+.1f}" + ("" if s["learned"][t] else "*") for t in TASK_NAMES
        )
        lines.append(
            f"| {s['name']} | {s['lr']:g} | "
            + "/".join(str(s["steps"][t]) for t in TASK_NAMES)
            + " | "
            + "/".join(f"{100 * s['density'][t]:.1f}" for t in TASK_NAMES)
            + " | "
            + "/".join(f"{100 * s['unique_share'][t]:.1f}" for t in TASK_NAMES)
            + f" | {gains} | {100 * s['ram_plus_avg']:.1f} | "
            + " | ".join(_delta_cell(s["delta"][b]) for b in BASELINES)
            + " |"
        )
    lines += [
        "",
        "\\* did not learn: gained less than "
        f"{100 * MIN_GAIN:.0f} points on its own task (mean over seeds). Every score of every "
        "model is in `sweep.json`.",
        "",
        "Average score of every method at each point (mean over seeds, %):",
        "",
        "| point | " + " | ".join(LABELS.get(m, m) for m in res["methods"]) + " |",
        "|---|" + "---:|" * len(res["methods"]),
    ]
    for s in sorted(summaries, key=lambda s: s["mean_density"]):
        lines.append(
            f"| {s['name']} | "
            + " | ".join(
                f"{100 * s['avg'][m]:.1f}" if m in s["avg"] else "" for m in res["methods"]
            )
            + " |"
        )
    lines += ["", *_ablations(res, summaries), ""]
    return "\n".join(lines)


def _delta_cell(d: dict) -> str:
    return f"{signed(d['by_seed'])} ({d['ahead']}/{d['n']})"


def _verdict(summaries: list[dict]) -> list[str]:
    """What was measured, in sentences generated from the numbers, whichever way it went."""
    out = []
    learned = [s for s in summaries if all(s["learned"].values())]
    dens = [s["mean_density"] for s in summaries]
    uniq = [s["mean_unique_share"] for s in summaries]
    out.append(
        f"- Measured densities span {100 * min(dens):.1f}% to {100 * max(dens):.1f}% "
        f"(mean over agents), unique shares {100 * min(uniq):.1f}% "
        f"to {100 * max(uniq):.1f}%; every agent learned "
        f"its task at {len(learned)} of {len(summaries)} points."
    )
    for b in BASELINES:
        wins = [s for s in learned if s["delta"][b]["mean"] > 0 and s["delta"][b]["behind"] == 0]
        losses = [s for s in learned if s["delta"][b]["mean"] < 0 and s["delta"][b]["ahead"] == 0]
        best = max(learned, key=lambda s: s["delta"][b]["mean"]) if learned else None
        text = (
            f"- RAM+ against {LABELS.get(b, b)}, at the {len(learned)} points where every agent "
            f"learned: ahead in every seed at {len(wins)}, behind in every seed at {len(losses)}"
        )
        if best:
            text += (
                f"; its best point is {best['name']} "
                f"({100 * best['delta'][b]['mean']:+.1f} points, "
                f"density {100 * best['mean_density']:.1f}%)"
            )
        out.append(text + ".")
    if learned and not any(
        s["delta"][b]["mean"] > 0 and s["delta"][b]["behind"] == 0
        for s in learned
        for b in ("ties", "task_arithmetic")
    ):
        out.append(
            "- RAM+ beats neither TIES nor task arithmetic in every seed at any point where the "
            "agents learned: at this scale, it does not win anywhere against them."
        )
    return out


def _ablations(res: dict, summaries: list[dict]) -> list[str]:
    abl = res["ablations"]
    have = {
        p: rows
        for p, rows in res["point"].items()
        if all(any(m in rows[s]["scores"] for m in abl) for s in res["seeds"])
    }
    if not have:
        return []
    name = next(iter(have))
    rows = have[name]
    s = next((x for x in summaries if x["name"] == name), None)
    why = (
        "the sparsest point where every agent learned its task"
        if s and all(s["learned"].values())
        else "no point had every agent learn its task, so the point whose least-improved agent "
        "gained most"
    )
    out = [
        f"### The paper's ablations, at {name} ({why})",
        "",
        "RAM+ with one setting changed from the defaults (r 0.1, alpha 2, eps 1e-5); average "
        "score (mean ± sd over seeds) and its difference from the defaults, paired by seed.",
        "",
        "| setting | avg score % | minus defaults, points |",
        "|---|---:|---:|",
    ]
    seeds = res["seeds"]
    ref = [_avg(rows[x]["scores"]["ram_plus"]) for x in seeds]
    out.append(f"| defaults (r 0.1, eps 1e-5) | {pct(ref)} | |")
    for m in abl:
        if all(m in rows[x]["scores"] for x in seeds):
            v = [_avg(rows[x]["scores"][m]) for x in seeds]
            d = [a - b for a, b in zip(v, ref, strict=True)]
            out.append(f"| {m.split('@', 1)[1].replace('=', ' ')} | {pct(v)} | {signed(d)} |")
    if s:
        lam = ", ".join(
            f"{t} rho {statistics.fmean(rows[x]['probe'][t]['rho'] for x in seeds):.2f}"
            for t in TASK_NAMES
            if all(math.isfinite(rows[x]["probe"][t]["rho"]) for x in seeds)
        )
        if lam:
            out += ["", f"At this point (mean over seeds): {lam}."]
    return out
