"""Make a smaller draft from a GGUF model by keeping some of its transformer blocks.

    python convert/prune_draft.py MODEL.gguf OUT.gguf --drop-last 4
    python convert/prune_draft.py TARGET.gguf SELF-DRAFT.gguf --keep-first 8     # self-speculative draft
    python convert/prune_draft.py MODEL.gguf OUT.gguf --layers 0-9,12,23

Kept blocks are renumbered from 0; the block count and every per-block metadata array follow. The tensors are
copied byte for byte (any quantization), through a temp file renamed at the end.
"""
from __future__ import annotations

import click
from _common import CONTEXT_SETTINGS, megabytes, one_line_errors, show_progress  # first: finds llamaspec

from llamaspec.gguf.edit import check_output_path, read_gguf, write_gguf
from llamaspec.gguf.prune import check_prunable, parse_layer_list, prune_blocks, select_blocks
from llamaspec.gguf.reader import read_model_info


def describe_blocks(keep: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6'."""
    runs, start = [], keep[0]
    for prev, cur in zip(keep, keep[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ",".join(runs)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("model", type=click.Path())
@click.argument("output", type=click.Path())
@click.option("--keep-first", type=int, default=None, help="Keep the first N blocks.")
@click.option("--drop-last", type=int, default=None, help="Drop the last N blocks.")
@click.option("--layers", default=None, help="Blocks to keep, e.g. 0,1,2,5 or 0-11,20.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@one_line_errors
def main(model, output, keep_first, drop_last, layers, force, quiet):
    """Keep a subset of MODEL's transformer blocks and write the smaller model to OUTPUT."""
    contents = read_gguf(model)
    check_prunable(contents)
    output = check_output_path(output, force, inputs=[model])
    keep = select_blocks(contents.n_layer, keep_first=keep_first, drop_last=drop_last,
                         layers=parse_layer_list(layers) if layers is not None else None)
    pruned = prune_blocks(contents, keep)
    write_gguf(pruned, output, progress=show_progress(quiet))
    size = read_model_info(output).file_size
    click.echo(f"wrote {output}: blocks {describe_blocks(keep)} ({len(keep)} of {contents.n_layer}), "
               f"{megabytes(size)} (was {megabytes(contents.path.stat().st_size)})")


if __name__ == "__main__":
    main()
