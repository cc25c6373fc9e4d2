"""`llamaspec bench`: plain decoding against speculation, same prompts, one run, the modes interleaved over repeats
(the library is llamaspec.bench); ends with one sentence on whether speculation pays on this machine."""
from __future__ import annotations

import csv
import json
import shlex
import sys

import click

from . import main
from .options import Command, fail, handle_errors, pair_options, sampler_kwargs, sampler_options
from .pair_choice import load_pair_from_options
PLOT_INSTALL = "pip install 'llamaspec[plot]'"
TABLE_COLUMNS = ("mode", "draft len", "mean draft", "acceptance", "tok/pass", "tok/s", "min-max", "speedup",
                 "vs plain", "same output")
VERDICT_WORDS = {"faster": "faster", "slower": "slower", "same": "same within noise", None: "?"}
EXIT_INTERRUPTED = 130


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table_rows(report) -> list[tuple[str, ...]]:
    """One row per mode (per mode and temperature in a sweep, with the temperature first)."""
    sweep = len(report.temperatures) > 1
    rows = []
    for r in report.results:
        draft_len = "0" if r.policy == "plain" else (str(r.draft_len) if r.policy == "fixed" else f"<={r.draft_len}")
        same = "-" if r.same_output is None else f"{r.same_output}/{r.prompts}"
        vs_plain = "-" if r.policy == "plain" else VERDICT_WORDS[r.verdict]
        row = (r.mode, draft_len, f"{r.mean_draft_len:.2f}", _fmt(r.acceptance_rate, ".0%"),
               f"{r.mean_accepted_length:.2f}", f"{r.tokens_per_second:.1f}",
               f"{r.tokens_per_second_min:.1f}-{r.tokens_per_second_max:.1f}", _fmt(r.speedup, ".2f") + "x", vs_plain,
               same)
        rows.append((f"{r.temperature:g}",) + row if sweep else row)
    return rows


def format_table(rows, columns=TABLE_COLUMNS) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line("-" * w for w in widths)] + [line(r) for r in rows])


def verdict_sentence(verdict) -> str:
    """Whether speculation pays, in words, from a llamaspec.bench.Verdict."""
    if verdict.noise is None:
        return "one repeat cannot tell a speed-up from noise: run with --repeats 3 or more to judge"
    best, auto = verdict.best, verdict.auto
    if best is None:
        return "speculation does not pay here: use plain decoding (--spec-type none)"
    sentence = f"on this machine speculation pays: {best.speedup:.2f}x with {best.mode}"
    flags = (f"--policy fixed --draft-max {best.draft_len}" if best.policy == "fixed" else f"--policy {best.policy}")
    if best is auto:
        return sentence + " (the default policy)"
    if verdict.auto_matches_best:
        return sentence + f"; auto picks it ({auto.speedup:.2f}x)"
    if auto is not None:
        return sentence + f"; auto gets {auto.speedup:.2f}x, so choose it yourself: {flags}"
    return sentence + f" ({flags})"


def verdict_lines(report) -> list[str]:
    verdicts = report.verdicts()
    if len(verdicts) == 1:
        return [verdict_sentence(verdicts[0])]
    return [f"at temperature {v.temperature:g}: {verdict_sentence(v)}" for v in verdicts]


def hardware_info(pair, n_threads: int | None) -> dict:
    from .. import sysinfo
    from ..backend import default_threads, supports_gpu_offload

    gpus = sysinfo.nvidia_gpus()
    threads = n_threads or default_threads()
    return {"line": sysinfo.hardware_line(threads, gpus), "cpu": sysinfo.cpu_model(), "cores": sysinfo.cpu_count(),
            "threads": threads, "gpus": [{"name": g.name, "total_mib": g.total_mib} for g in gpus],
            "gpu_offload": supports_gpu_offload()}


def model_info(model) -> dict | None:
    if model is None:
        return None
    return {"name": model.info.name, "path": str(model.path), "arch": model.info.arch,
            "size_bytes": model.info.weights_bytes}


def build_modes(pair, k_list: str | None, policies: str | None, draft_max: int | None):
    from .. import bench
    from ..engine import snapshot_bound

    if k_list is None and policies is None:
        return bench.default_modes(pair, draft_max)
    modes = [bench.fixed_mode(k) for k in (bench.parse_k_list(k_list) if k_list else [])]
    reach = draft_max if draft_max is not None else snapshot_bound(pair)   # as a load of this pair gives them
    modes += [bench.policy_mode(name, reach) for name in (bench.parse_policy_list(policies) if policies else [])]
    return modes


@main.command(cls=Command)
@click.option("--prompts", "prompt_spec", default="code", show_default=True,
              help="Built-in set (code, prose, grounded, all) or a JSONL file of {\"prompt\": ...} lines.")
@click.option("--k", "k_list", default=None, help="Fixed draft lengths to sweep, e.g. 1,2,3,5,8.")
@click.option("--policies", default=None, help="Adaptive policies to compare, e.g. auto,confidence,threshold.")
@click.option("--temps", "temps", default=None,
              help="Temperatures to sweep, e.g. 0,0.5,0.8,1.0: every mode at each (instead of --temp); the table "
                   "and --plot show acceptance and speedup against temperature.")
@click.option("--raw", is_flag=True, help="Send prompts as raw text instead of a chat-templated user message.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds over the prompts, every mode interleaved in each; the spread over them is the noise a "
                   "speed-up must beat.")
@click.option("--no-warmup", is_flag=True, help="Skip the unmeasured warm-up generation.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--csv", "as_csv", is_flag=True, help="Print the results as CSV.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help=f"Draw speedup and acceptance against draft length into a PNG (needs {PLOT_INSTALL}).")
@pair_options
@sampler_options(max_tokens=128)
@handle_errors
def bench(prompt_spec, k_list, policies, temps, raw, repeats, no_warmup, as_json, as_csv, plot_path, **opts):
    """Compare plain decoding with speculation (fixed draft lengths, policies) on the same prompts, and say whether
    speculation pays here. Ctrl-C prints what was measured so far."""
    from .. import bench as lib
    from ..bench.prompts import load_prompts

    if as_json and as_csv:
        raise click.UsageError("choose one of --json and --csv")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(f"--plot needs matplotlib: {PLOT_INSTALL}")
    if k_list is not None:
        lib.parse_k_list(k_list)
    if policies is not None:
        lib.parse_policy_list(policies)
    temperatures = lib.parse_temperature_list(temps) if temps is not None else None
    prompts = load_prompts(prompt_spec)
    command = shlex.join(["llamaspec", *sys.argv[1:]]) if sys.argv and "llamaspec" in sys.argv[0] else None

    pair = load_pair_from_options(opts)
    try:
        modes = build_modes(pair, k_list, policies, opts.get("draft_max"))
        token_prompts = lib.prepare_prompts(pair, prompts, chat=not raw)
        click.echo("warming up..." if not no_warmup else "running...", err=True)
        n_runs = repeats * len(prompts) * (1 + sum(m.policy != "plain" for m in modes)) * len(temperatures or [0])
        with click.progressbar(length=n_runs, label="bench", file=sys.stderr) as bar:
            report = lib.run_bench(pair, token_prompts, modes, max_tokens=opts["max_tokens"],
                                   sampler={k: v for k, v in sampler_kwargs(opts).items() if k != "max_tokens"},
                                   warmup=not no_warmup, draft_p_min=opts.get("draft_p_min"), progress=bar.update,
                                   temperatures=temperatures, repeats=repeats)
        if not report.results:
            click.echo("interrupted before any prompt was measured in every mode", err=True)
            sys.exit(EXIT_INTERRUPTED)
        hardware = hardware_info(pair, opts.get("n_threads"))
        header = {"command": command, "target": model_info(pair.target), "draft": model_info(pair.draft),
                  "drafter": pair.drafter_kind, "hardware": hardware, "prompts": prompt_spec}
        if as_json:
            click.echo(json.dumps({**header, **report.to_dict(), "verdict": verdict_lines(report)}, indent=2))
        elif as_csv:
            write_csv(report)
        else:
            print_report(header, report, len(prompts))
        if plot_path:
            lib.plot_report(report, plot_path)
            click.echo(f"plot written to {plot_path}", err=True)
        if report.interrupted:
            click.echo(f"interrupted: the results above are of {report.results[0].repeats} of {repeats} repeat(s)",
                       err=True)
            sys.exit(EXIT_INTERRUPTED)
    finally:
        pair.close()


def write_csv(report) -> None:
    rows = [{k: ";".join(f"{x:g}" for x in v) if isinstance(v, list) else v for k, v in r.to_dict().items()}
            for r in report.results]
    writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def print_report(header: dict, report, n_prompts: int) -> None:
    if header["command"]:
        click.echo(f"command:  {header['command']}")
    target, draft = header["target"], header["draft"]
    click.echo(f"target:   {target['name']} ({target['path']})")
    click.echo(f"draft:    {draft['name']} ({draft['path']})" if draft else "draft:    none")
    click.echo(f"drafter:  {header['drafter']}")
    click.echo(f"hardware: {header['hardware']['line']}; llama.cpp GPU offload: "
               f"{'yes' if header['hardware']['gpu_offload'] else 'no'}")
    temps = report.temperatures
    filters = ", ".join(f"{name} {report.sampler[name]:g}" for name, off in (("top_k", 0), ("top_p", 1.0),
                                                                               ("min_p", 0.0))
                        if report.sampler.get(name, off) != off)
    if len(temps) > 1:
        sampling = "temperatures " + ", ".join(f"{t:g}" for t in temps) + " (0 = greedy)"
    else:
        sampling = "greedy" if not temps[0] else f"temperature {temps[0]:g}"
    if filters and any(temps):
        sampling += f", {filters}"
    click.echo(f"prompts:  {header['prompts']} ({n_prompts}), up to {report.max_tokens} tokens each, {sampling}")
    click.echo()
    columns = (("temp",) + TABLE_COLUMNS) if len(temps) > 1 else TABLE_COLUMNS
    click.echo(format_table(table_rows(report), columns))
    from ..bench import MIN_NOISE

    click.echo()
    noise = [v.noise for v in report.verdicts() if v.noise is not None]
    if noise:
        click.echo(f"tok/s: the median over {report.results[0].repeats} repeats, min-max its range. A mode is faster "
                   "or slower than plain\nonly beyond the noise (plain's own spread over the repeats, here "
                   f"{max(noise):.0%}, at least {MIN_NOISE:.0%}) in every repeat.")
    for line in verdict_lines(report):
        click.echo(line)
