"""The recipe comparison's and the long run's tables from their run folders (scripts/gpu/research_compare.sh).

    python scripts/gpu/research_table.py --runs /tmp/research                  # the tables (markdown)
    python scripts/gpu/research_table.py --runs /tmp/research --best           # the best preset's name, alone
    python scripts/gpu/research_table.py --runs lease1/ lease2/ --write-benchmarks docs/benchmarks.md --machine "..."

Each --runs folder holds one folder per run, named PRESET_sSEED (default_s0, grpo_s1, ...) for the
comparison, long_PRESET for the long run and calculator_s0 / calcnobonus_s0 for the tool task: on the device
a job.output_dir (run-N/ and the link latest, with metrics.jsonl, samples.jsonl, config.toml) and the
standalone evaluator's report on the run's export beside it as eval_NAME.json (research_compare.sh wait);
unpacked from research.tgz, the same files in the run's folder (the report as evaluate.json). A run in a later
--runs folder replaces one of the same name in an earlier one (the leases' tarballs, unpacked side by side).
A run with no metrics yet is a row saying so; a line a kill cut short is skipped; where a step has two lines
(a resume), the later one counts. A run short of its config's trainer.steps has no final evaluation (named under
"Not finished"), whatever it evaluated last.

The best preset: the highest final held-out accuracy (the mean over its seeds where it has two), ties broken
by the named set.
"""

import argparse
import datetime
import json
import re
import statistics
import tomllib
from pathlib import Path

PRESETS = ("default", "grpo", "drgrpo", "dapo", "gspo")
LABELS = {"default": "default (token mean, 1 step a batch)", "grpo": "GRPO (seq-mean, k3 KL 0.04)",
          "drgrpo": "Dr. GRPO (no std, sum / (B x 256))", "dapo": "DAPO (clip 0.28, acc. filter, overlong)",
          "gspo": "GSPO (seq ratio, clip 3e-4 / 4e-4)"}
PLAN = ("default_s0", "grpo_s0", "drgrpo_s0", "dapo_s0", "gspo_s0", "default_s1", "grpo_s1", "dapo_s1")
"""The comparison research_compare.sh runs by default (its COMPARE): the table names those not run yet."""
RUN = re.compile(r"^(?P<preset>[a-z]+)_s(?P<seed>\d+)$")
TOOL_RUNS = ("calculator", "calcnobonus")
"""research_compare.sh's tool-task runs: the calculator with the math config's format bonus, and without."""
SECTION = "GRPO recipes on SmolLM2 math (cuda)"
LONG_SECTION = "GRPO long run on SmolLM2 math (cuda)"
TOOL_SECTION = "Multi-turn tool task after the fixes (cuda)"
CHANGES = """What changed against the presets of the earlier, incomplete comparison (2026-11-25, below): DAPO's dynamic
sampling keeps a group when its *accuracy* varies (some answers right, some wrong), not when the reward with the
format bonus and length penalty does, and each refill draws only the groups still missing; the GRPO preset adds
the published KL term (k3 to the initial policy, 0.04); Dr. GRPO divides by every row x 256, overlong-masked rows
included; GSPO is new (sequence ratio clipped at 3e-4 / 4e-4, sequence-level off-policy correction). Every run
scores word_problems (64 hand-written problems, not from the training generator) beside the held-out split, and
a final answer must be an evaluated number (task.numeric_answer = "number": '38 + 81' no longer counts for 119).
Runs shared GPUs (research_compare.sh: the same overrides for all, nothing tuned per recipe)."""


def find_runs(folders: list[Path]) -> dict[str, Path]:
    """Run name -> its folder, over every --runs folder (a later one wins)."""
    runs = {}
    for folder in folders:
        runs.update({p.name: p for p in sorted(folder.iterdir()) if p.is_dir()} if folder.is_dir() else {})
    return runs


def run_file(folder: Path, name: str) -> Path:
    """A run's file: through its ``latest`` link on the device, directly in an unpacked tarball."""
    return folder / "latest" / name if (folder / "latest").is_dir() else folder / name


def read_run(folder: Path) -> tuple[dict[int, dict], dict[int, dict]] | None:
    """({step: training line}, {step: evaluation line}) of a run's metrics.jsonl; None without one."""
    path = run_file(folder, "metrics.jsonl")
    if not path.is_file():
        return None
    steps, evals = {}, {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if any(k.startswith("eval_") for k in record) else steps)[record["step"]] = record
    return steps, evals


def read_samples(folder: Path, step: int) -> dict[str, list[tuple[str, str, bool]]]:
    """samples.jsonl's (prompt, completion, correct) of one evaluation, per set."""
    path = run_file(folder, "samples.jsonl")
    out: dict[str, list] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r["step"] == step:
            out.setdefault(r["set"], []).append((r["prompt"], r["completion"], r["correct"]))
    return out


def comparison_runs(runs: dict[str, Path]) -> list[str]:
    """The PRESET_sSEED runs, presets in PRESETS order, then by seed."""
    found = [name for name in runs if RUN.match(name)]
    key = {p: i for i, p in enumerate(PRESETS)}
    found = [n for n in found if RUN.match(n)["preset"] in key]
    return sorted(found, key=lambda n: (key[RUN.match(n)["preset"]], int(RUN.match(n)["seed"])))


def set_names(evals: dict[int, dict]) -> list[str]:
    """The held-out set ('heldout', metrics without /NAME) first, then each named set."""
    names = {k.partition("/")[2] or "heldout" for r in evals.values() for k in r if k.startswith("eval_accuracy")}
    return sorted(names, key=lambda n: (n != "heldout", n))


def key(metric: str, name: str) -> str:
    return f"eval_{metric}" + ("" if name == "heldout" else f"/{name}")


def cell(record: dict | None, name: str) -> str:
    if not record or key("accuracy", name) not in record:
        return "-"
    return f"{record[key('accuracy', name)]:.3f} ± {record[key('accuracy_se', name)]:.3f}"


def window(steps: dict[int, dict], metric: str, first: int, last: int, fmt: str = "{:.2f}") -> str:
    values = [steps[s][metric] for s in range(first, last + 1) if s in steps and metric in steps[s]]
    return fmt.format(statistics.mean(values)) if values else "-"


def planned_steps(folder: Path) -> int | None:
    """trainer.steps of the run's config.toml (None without one)."""
    path = run_file(folder, "config.toml")
    return tomllib.loads(path.read_text()).get("trainer", {}).get("steps") if path.is_file() else None


def final_eval(folder: Path, steps: dict[int, dict], evals: dict[int, dict]) -> dict | None:
    """The evaluation after the run's last planned step (its final one), if the run got there."""
    if not steps or max(steps) + 1 < (planned_steps(folder) or 0):
        return None
    return evals.get(max(steps) + 1)


def final_evals(runs: dict[str, Path], data: dict[str, tuple | None]) -> dict[str, dict | None]:
    """Each run's final evaluation (``final_eval``; None for a run with no metrics or short of its end)."""
    return {n: final_eval(runs[n], *d) if d else None for n, d in data.items()}


def export_check(folder: Path, final: dict | None) -> str:
    """Whether the standalone evaluator scored the run's export as the loop's ``final`` evaluation did: the accuracy
    of every set and the completions samples.jsonl kept."""
    report_path = folder / "evaluate.json"
    if not report_path.is_file():
        report_path = folder.parent / f"eval_{folder.name}.json"
    if not report_path.is_file() or final is None:
        return "-"
    report = json.loads(report_path.read_text())
    logged = read_samples(folder, final["step"])
    differ = []
    for set_name, s in report["sets"].items():
        if s["accuracy"] != final.get(key("accuracy", set_name)):
            differ.append(f"{set_name} {s['accuracy']:.3f} vs {final.get(key('accuracy', set_name))}")
        problems = [(p["prompt"], p["completion"], p["correct"]) for p in s["problems"]]
        same = sum(a == b for a, b in zip(problems, logged.get(set_name, [])))
        if same != len(logged.get(set_name, [])):
            differ.append(f"{set_name}: {same}/{len(logged[set_name])} samples identical")
    return "equal" if not differ else "DIFFERS: " + "; ".join(differ)


def comparison_tables(runs: dict[str, Path]) -> str:
    names = comparison_runs(runs)
    if not names:
        return "no comparison runs"
    data = {n: read_run(runs[n]) for n in names}
    finals = final_evals(runs, data)
    eval_steps = sorted({s for d in data.values() if d for s in d[1]})
    sets = sorted({s for d in data.values() if d for s in set_names(d[1])}, key=lambda n: (n != "heldout", n))
    out = []
    for set_name in sets:
        label = "held-out (task's split)" if set_name == "heldout" else set_name
        head = ["run", "seed", "steps"] + [f"@{s}" for s in eval_steps]
        out += [f"Greedy accuracy ± standard error, {label}:", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in names:
            m, d = RUN.match(n), data[n]
            if d is None:
                out.append(f"| {LABELS.get(m['preset'], m['preset'])} | {m['seed']} | no metrics yet |")
                continue
            cells = [cell(d[1].get(s), set_name) for s in eval_steps]
            out.append("| " + " | ".join([LABELS.get(m["preset"], m["preset"]), m["seed"], str(len(d[0])), *cells])
                       + " |")
        out.append("")
    head = ["run", "seed", "reward 0-4 -> last 5", "entropy", "length", "cut at max", "clip low / high",
            "approx_kl", "median step s", "export in the evaluator"]
    out += ["Training over the run (means of the first and last five steps):", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        m, d = RUN.match(n), data[n]
        if d is None or not d[0]:
            continue
        steps, last = d[0], max(d[0])
        span = lambda metric, fmt="{:.2f}": f"{window(steps, metric, 0, 4, fmt)} -> {window(steps, metric, last - 4, last, fmt)}"
        out.append("| " + " | ".join([
            LABELS.get(m["preset"], m["preset"]), m["seed"], span("reward_mean", "{:.3f}"), span("entropy"),
            span("response_length_mean", "{:.0f}"), span("truncated_frac"),
            f"{window(steps, 'clip_frac_low', last - 4, last, '{:.4f}')} / {window(steps, 'clip_frac_high', last - 4, last, '{:.4f}')}",
            window(steps, "approx_kl", last - 4, last, "{:.4f}"),
            f"{statistics.median(r['step_s'] for r in steps.values()):.2f}",
            export_check(runs[n], finals[n])]) + " |")
    missing = [n for n in PLAN if not data.get(n)]
    cut = [n for n in names if data[n] and finals[n] is None]
    best_of = "the runs so far" if missing or cut else "mean over seeds"
    out += ["", seeds_table(finals), "", f"Best preset (final held-out accuracy, {best_of}): {best(finals)}"]
    def short(name: str) -> str:
        m = RUN.match(name)
        return f"{LABELS[m['preset']].split(' (')[0]} seed {m['seed']}"

    if cut:
        out.append("Not finished (no final evaluation): " + ", ".join(
            f"{short(n)} ({len(data[n][0])} of {planned_steps(runs[n]) or '?'} steps)" for n in cut) + ".")
    if missing:
        out.append("Not run yet: " + ", ".join(map(short, missing)) + ".")
    out += ["", CHANGES]
    return "\n".join(out)


def seeds_table(finals: dict[str, dict | None]) -> str:
    """Presets run with two seeds: each seed's final held-out accuracy and their difference against its SE."""
    by_preset: dict[str, list[dict]] = {}
    for n, final in finals.items():
        if final is not None and "eval_accuracy" in final:
            by_preset.setdefault(RUN.match(n)["preset"], []).append(final)
    lines = ["| preset | final held-out per seed | difference | its standard error |", "|---|---|---|---|"]
    for preset, finals in by_preset.items():
        if len(finals) < 2:
            continue
        a, b = finals[:2]
        se = (a["eval_accuracy_se"] ** 2 + b["eval_accuracy_se"] ** 2) ** 0.5
        lines.append(f"| {LABELS.get(preset, preset)} | " + " / ".join(f"{f['eval_accuracy']:.3f}" for f in finals)
                     + f" | {abs(a['eval_accuracy'] - b['eval_accuracy']):.3f} | {se:.3f} |")
    return "\n".join(lines) if len(lines) > 2 else "(no preset has two seeds yet)"


def best(finals: dict[str, dict | None]) -> str:
    """The preset with the highest final held-out accuracy (mean over its seeds), ties broken by the named sets."""
    scores: dict[str, list[tuple[float, float]]] = {}
    for n, final in finals.items():
        if final is None or "eval_accuracy" not in final:
            continue
        named = [v for k, v in final.items() if k.startswith("eval_accuracy/")]
        scores.setdefault(RUN.match(n)["preset"], []).append((final["eval_accuracy"], statistics.mean(named or [0.0])))
    if not scores:
        return "none (no run has finished)"
    return max(scores, key=lambda p: tuple(statistics.mean(x) for x in zip(*scores[p])))


def curve_tables(runs: dict[str, Path], prefixes: tuple[str, ...], *, every: int = 25) -> str:
    """Runs whose name starts with one of ``prefixes`` (the long run, the tool-task runs): evaluations and
    training over windows of ``every`` steps."""
    found = [runs[name] for name in sorted(runs) if name.startswith(prefixes)]
    out = []
    for folder in found:
        d = read_run(folder)
        if d is None:
            out.append(f"{folder.name}: no metrics yet")
            continue
        steps, evals = d
        sets = set_names(evals)
        head = ["steps", *(f"{'held-out' if s == 'heldout' else s} (at the window's end)" for s in sets),
                "reward", "right answers", "entropy", "length", "cut at max", "clip low", "clip high", "approx_kl",
                "step s"]
        out += [f"{folder.name} ({len(steps)} steps trained):", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                "| before step 0 | " + " | ".join(cell(evals.get(0), s) for s in sets) + " |" + " |" * 9]
        for first in range(0, max(steps) + 1, every):
            last = min(first + every - 1, max(steps))
            out.append("| " + " | ".join([
                f"{first}-{last}", *(cell(evals.get(last + 1), s) for s in sets),
                window(steps, "reward_mean", first, last, "{:.3f}"), window(steps, "correct_frac", first, last, "{:.3f}"),
                window(steps, "entropy", first, last),
                window(steps, "response_length_mean", first, last, "{:.0f}"),
                window(steps, "truncated_frac", first, last), window(steps, "clip_frac_low", first, last, "{:.4f}"),
                window(steps, "clip_frac_high", first, last, "{:.4f}"), window(steps, "approx_kl", first, last, "{:.4f}"),
                window(steps, "step_s", first, last)]) + " |")
        accuracy = [(s, r["eval_accuracy"], r["eval_accuracy_se"]) for s, r in sorted(evals.items()) if "eval_accuracy" in r]
        if accuracy:
            peak = max(accuracy, key=lambda a: a[1])
            end = accuracy[-1]
            drop = (peak[1] - end[1]) / max((peak[2] ** 2 + end[2] ** 2) ** 0.5, 1e-9)
            out += ["", f"Held-out peak {peak[1]:.3f} at step {peak[0]}, last {end[1]:.3f} at step {end[0]}: "
                        f"{drop:.1f} standard errors below the peak."]
        check = export_check(folder, final_eval(folder, steps, evals))
        out.append("Export scored by the standalone evaluator: "
                   + ("not yet (no final evaluation, or no report)" if check == "-" else check) + ".")
        out.append("")
    return "\n".join(out) if out else f"no {' or '.join(prefixes)} run"


def write_section(path: Path, name: str, body: str, *, machine: str, command: str) -> None:
    """Replace (or append) the marked section ``name`` of ``path`` (docs/benchmarks.md, or a device call's copy of
    it)."""
    section = (f"<!-- {name} -->\n## {name}\n\n- command: `{command}`\n- machine: {machine}\n"
               f"- date: {datetime.date.today().isoformat()}\n\n{body.rstrip()}\n<!-- /{name} -->\n")
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->\n.*?<!-- /{re.escape(name)} -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, type=Path, nargs="+",
                        help="folders of one folder per run (research_compare.sh's RUNS, or research.tgz unpacked)")
    parser.add_argument("--best", action="store_true", help="print only the best preset's name")
    parser.add_argument("--write-benchmarks", type=Path, help="write the sections that have runs into this file")
    parser.add_argument("--machine", default="?", help="what ran it (for --write-benchmarks)")
    args = parser.parse_args()
    runs = find_runs(args.runs)
    if args.best:
        names = comparison_runs(runs)
        print(best(final_evals(runs, {n: read_run(runs[n]) for n in names})))
        return
    compare, long = comparison_tables(runs), curve_tables(runs, ("long_",))
    tool = curve_tables(runs, tuple(f"{name}_s" for name in TOOL_RUNS), every=10)
    print("\n\n".join((compare, long, tool)))
    if args.write_benchmarks:
        for name, body, verbs in ((SECTION, compare, "start|wait"), (LONG_SECTION, long, "long|wait"),
                                  (TOOL_SECTION, tool, "start|wait, COMPARE='calculator calcnobonus'")):
            if not body.startswith("no "):
                write_section(args.write_benchmarks, name, body, machine=args.machine,
                              command=f"bash scripts/gpu/research_compare.sh {verbs} (issue 42)")


if __name__ == "__main__":
    main()
