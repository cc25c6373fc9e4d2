"""How much a pruned draft loses: file size, draft speed and acceptance against the target, per setting.

    python benchmarks/probes/prune_report.py TARGET.gguf DRAFT.gguf --drop 0,2,4,8 --self-keep 14

For each setting the draft is pruned into a temp folder with convert/prune_draft.py (`--drop-last N`; the
`--self-keep N` rows keep the target's own first N blocks), then measured: tokens/s of the draft alone (greedy),
and acceptance and tokens/s of the pair (greedy, fixed draft length) over a few chat prompts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

import llamaspec
from llamaspec.chat_template import ChatTemplate
from llamaspec.gguf.reader import read_model_info

PRUNE_SCRIPT = Path(__file__).resolve().parents[2] / "convert" / "prune_draft.py"
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search in C over a sorted array of ints; return the index or -1.",
    "Explain in a short paragraph what a hash map is and when to use one.",
    "Write a bash script that prints the ten largest files under the current directory.",
)


@dataclass
class Row:
    setting: str
    n_blocks: int
    file_bytes: int
    draft_tps: float
    acceptance: float
    tokens_per_pass: float
    pair_tps: float


def prune(source: Path, output: Path, how: list[str]) -> Path:
    cmd = [sys.executable, str(PRUNE_SCRIPT), str(source), str(output), "--quiet", "--force", *how]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise click.ClickException(result.stderr.strip())
    return output


def chat_prompts(target: Path, n_prompts: int) -> list[str]:
    template = ChatTemplate.from_model_info(read_model_info(target))
    return [template.render([{"role": "user", "content": p}]) for p in PROMPTS[:n_prompts]]


def measure(setting: str, target: Path, draft: Path, prompts: list[str], max_tokens: int, draft_max: int,
            n_ctx: int, n_threads: int | None) -> Row:
    alone = llamaspec.load_pair(str(draft), n_ctx=n_ctx, n_threads=n_threads, no_repack=True)
    draft_tps = alone.generate(prompts[0], max_tokens=max_tokens, temperature=0.0).stats.tokens_per_second
    alone.close()
    pair = llamaspec.load_pair(str(target), str(draft), n_ctx=n_ctx, n_threads=n_threads, no_repack=True,
                               policy="fixed", draft_max=draft_max)
    drafted = accepted = generated = passes = 0
    seconds = 0.0
    for prompt in prompts:
        pair.reset()
        stats = pair.generate(prompt, max_tokens=max_tokens, temperature=0.0).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        generated, passes = generated + stats.tokens_generated, passes + stats.target_passes
        seconds += stats.decode_time
    pair.close()
    info = read_model_info(draft)
    return Row(setting, info.n_layer, info.file_size, draft_tps, accepted / max(drafted, 1),
               generated / max(passes, 1), generated / seconds)


def target_alone_tps(target: Path, prompts: list[str], max_tokens: int, n_ctx: int, n_threads: int | None) -> float:
    pair = llamaspec.load_pair(str(target), n_ctx=n_ctx, n_threads=n_threads, no_repack=True)
    generated, seconds = 0, 0.0
    for prompt in prompts:
        pair.reset()
        stats = pair.generate(prompt, max_tokens=max_tokens, temperature=0.0).stats
        generated, seconds = generated + stats.tokens_generated, seconds + stats.decode_time
    pair.close()
    return generated / seconds


def table(rows: list[Row], target_tps: float) -> str:
    lines = ["| draft | blocks | file MB | draft tok/s | acceptance | tokens/pass | pair tok/s | vs target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.setting} | {r.n_blocks} | {r.file_bytes / 1e6:.0f} | {r.draft_tps:.1f} | "
                     f"{r.acceptance:.0%} | {r.tokens_per_pass:.2f} | {r.pair_tps:.1f} | "
                     f"{r.pair_tps / target_tps:.2f}x |")
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("target", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--drop", default="0,2,4,8", show_default=True, help="Blocks to drop from the end of the draft.")
@click.option("--self-keep", default="", help="Self-speculative rows: keep the target's first N blocks.")
@click.option("--prompts", "n_prompts", type=click.IntRange(1, len(PROMPTS)), default=4, show_default=True)
@click.option("--max-tokens", type=int, default=96, show_default=True)
@click.option("--draft-max", type=int, default=4, show_default=True)
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=1024, show_default=True)
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None, help="CPU threads.")
def main(target, draft, drop, self_keep, n_prompts, max_tokens, draft_max, n_ctx, n_threads):
    """Prune DRAFT (and TARGET, for self-speculation) several ways and print a table of what each costs."""
    os.environ.setdefault("LLAMASPEC_NO_REPACK", "1")
    prompts = chat_prompts(target, n_prompts)
    target_tps = target_alone_tps(target, prompts, max_tokens, n_ctx, n_threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = [(f"draft -{n}" if n else "draft (full)", draft, ["--drop-last", str(n)] if n else None)
                    for n in int_list(drop)]
        settings += [(f"target first {n}", target, ["--keep-first", str(n)]) for n in int_list(self_keep)]
        for i, (label, source, how) in enumerate(settings):
            path = prune(source, Path(tmp) / f"draft-{i}.gguf", how) if how else source
            rows.append(measure(label, target, path, prompts, max_tokens, draft_max, n_ctx, n_threads))
            click.echo(f"{label}: done", err=True)
            if how:
                path.unlink()
    click.echo(f"target {target.name} alone: {target_tps:.1f} tok/s; {n_prompts} prompts, {max_tokens} tokens, "
               f"greedy, draft length {draft_max}")
    click.echo(table(rows, target_tps))


if __name__ == "__main__":
    main()
