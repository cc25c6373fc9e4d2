"""Quantize a GGUF model with llama.cpp's quantizer, e.g. so a draft matches its target's quantization.

    python convert/quantize.py DRAFT-F16.gguf DRAFT-Q4_K_M.gguf --type Q4_K_M

K-quant types fall back to a block-32 type for tensors whose rows are not a multiple of 256 (llama.cpp's rule).
The output is written to a temp file and renamed when complete.
"""
from __future__ import annotations

import sys
import threading
import time

import click
from _common import CONTEXT_SETTINGS, megabytes, one_line_errors  # first: finds llamaspec

from llamaspec.errors import InvalidParameterError, ModelFileError, ModelLoadError
from llamaspec.gguf.edit import check_output_path, temp_path_for, write_failure_message
from llamaspec.gguf.reader import read_model_info

FLOAT_TYPES = ("F32", "F16", "BF16")
SPINNER = "|/-\\"


def quantized_types(path) -> list[str]:
    """The quantized (not float) types of the matrices in a file."""
    info = read_model_info(path)
    return sorted({t.type_name for t in info.tensors if len(t.shape) > 1 and t.type_name not in FLOAT_TYPES})


def run_with_progress(job, show: bool, progress) -> float:
    """Run `job` (a blocking C call) in a thread; show a spinner, tensors done and elapsed time on stderr."""
    failure: list[BaseException] = []

    def target():
        try:
            job()
        except BaseException as e:  # re-raised in the main thread
            failure.append(e)

    start = time.monotonic()
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    tick = 0
    while worker.is_alive():
        worker.join(0.2)
        if show:
            done = progress()
            where = f"tensor {done[0]}/{done[1]}, " if done else ""
            sys.stderr.write(f"\r{SPINNER[tick % 4]} quantizing: {where}{time.monotonic() - start:.0f} s   ")
            sys.stderr.flush()
            tick += 1
    if show:
        sys.stderr.write("\r" + " " * 60 + "\r")
    if failure:
        raise failure[0]
    return time.monotonic() - start


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("model", type=click.Path())
@click.argument("output", type=click.Path())
@click.option("--type", "-t", "qtype", required=True, help="Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q5_1, Q5_0, Q4_K_M, "
              "Q4_K_S, Q4_1, Q4_0, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K, F16, BF16 or F32.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: physical cores).")
@click.option("--allow-requantize", is_flag=True, help="Quantize an already quantized model (loses quality).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
@one_line_errors
def main(model, output, qtype, threads, allow_requantize, force, quiet):
    """Quantize MODEL to the given type and write OUTPUT."""
    from _quantizer import QUANT_FTYPES, quantize_model, quantize_progress

    qtype = qtype.upper()
    if qtype not in QUANT_FTYPES:
        raise InvalidParameterError(f"--type {qtype} is not supported; choose one of {', '.join(QUANT_FTYPES)}")
    if threads is not None and threads < 1:
        raise InvalidParameterError(f"--threads must be >= 1, got {threads}")
    source = read_model_info(model)
    output = check_output_path(output, force, inputs=[model])
    already = quantized_types(model)
    if already and not allow_requantize:
        raise InvalidParameterError(
            f"{model} is already quantized ({', '.join(already)}); quantizing again loses quality: start from an "
            "F16/BF16/F32 file, or pass --allow-requantize")
    tmp = temp_path_for(output)
    try:
        seconds = run_with_progress(
            lambda: quantize_model(model, tmp, qtype, n_threads=threads, allow_requantize=allow_requantize),
            show=not quiet and sys.stderr.isatty(), progress=quantize_progress)
        read_model_info(tmp)  # a short write (disk full) shows up as a truncated file
        tmp.replace(output)
    except ModelFileError:
        raise ModelFileError(write_failure_message(output, "the quantized file came out truncated")) from None
    except ModelLoadError as e:
        if "iostream" not in str(e):
            raise
        raise ModelFileError(write_failure_message(output, "llama.cpp could not write it")) from None
    finally:
        tmp.unlink(missing_ok=True)
    click.echo(f"wrote {output}: {qtype}, {megabytes(output.stat().st_size)} (was {megabytes(source.file_size)}), "
               f"{seconds:.1f} s")


if __name__ == "__main__":
    main()
