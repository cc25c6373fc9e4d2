"""Pad (or trim the padding of) a draft's vocabulary so it matches its target's exactly.

    python convert/align_vocab.py DRAFT.gguf TARGET.gguf OUT.gguf

Families like Qwen pad the vocabulary differently per model size (151936 vs 152064 entries). The aligned draft
gets the target's entries for the new ids, and zero rows in its embedding and output matrices (in their own
quantization type). Drafts whose real tokens differ from the target's are refused.
"""
from __future__ import annotations

import click
from _common import CONTEXT_SETTINGS, megabytes, one_line_errors, show_progress  # first: finds llamaspec

from llamaspec.errors import IncompatiblePairError
from llamaspec.gguf.align import align_vocab, vocab_mismatch_ignoring_size
from llamaspec.gguf.edit import check_output_path, read_gguf, write_gguf
from llamaspec.gguf.reader import read_model_info


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("draft", type=click.Path())
@click.argument("target", type=click.Path())
@click.argument("output", type=click.Path())
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@one_line_errors
def main(draft, target, output, force, quiet):
    """Write DRAFT with its vocabulary padded or trimmed to TARGET's size, as OUTPUT."""
    draft_info, target_info = read_model_info(draft), read_model_info(target)
    if draft_info.n_vocab == target_info.n_vocab:
        reason = vocab_mismatch_ignoring_size(target_info, draft_info)
        if reason is not None:
            raise IncompatiblePairError(f"draft {draft_info.path} and target {target_info.path} have different "
                                        f"tokenizers: {reason}")
        click.echo(f"{draft}: already has the target's vocabulary ({draft_info.n_vocab} entries); nothing to do")
        return
    output = check_output_path(output, force, inputs=[draft, target])
    contents = read_gguf(draft)
    aligned = align_vocab(contents, target)
    write_gguf(aligned, output, progress=show_progress(quiet))
    rows = [t.name for t in aligned.tensors if t.shape != contents.tensor(t.name).shape]
    verb = "padded" if target_info.n_vocab > draft_info.n_vocab else "trimmed"
    click.echo(f"wrote {output}: vocabulary {verb} {draft_info.n_vocab} -> {target_info.n_vocab} "
               f"({', '.join(rows) or 'no tensors'} resized), {megabytes(output.stat().st_size)}")


if __name__ == "__main__":
    main()
