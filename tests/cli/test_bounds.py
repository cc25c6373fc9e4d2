"""Every number a user or a client gives has one range (bounds.py), applied alike by the CLI, the library and the
server: beyond it, one line naming the value, never a traceback, a wrapped integer or an allocation that follows a
typo. Pure tests (no model): the CLI stops at its options, the server's checks run without HTTP."""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from llamaspec import bounds
from llamaspec.cli import main
from llamaspec.config import LoadConfig, ModelConfig
from llamaspec.errors import InvalidParameterError
from llamaspec.policy import make_policy
from llamaspec.sampling import SamplerConfig

HUGE = ["99999999999999999999", "1e20", "5e7", "-1", "nan", "inf", "-inf", "²", "0x10", "", " ", "1" * 5000]
NUMERIC_OPTIONS = {   # option -> the bounds row it follows (run, chat and serve share the pair and sampler options)
    "-c": "n_ctx", "-b": "n_batch", "-t": "n_threads", "-td": "n_threads", "-ngl": "n_gpu_layers",
    "-ngld": "n_gpu_layers", "-mg": "main_gpu", "--main-gpu-draft": "main_gpu", "--draft-max": "draft_max",
    "--draft-min": "draft_min", "--draft-p-min": "draft_p_min", "-n": "max_tokens", "--temp": "temperature",
    "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p", "-s": "seed",
}
SAMPLER_ROWS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")
SERVE_OPTIONS = {"--port": "port", "--max-queue": "max_queue", "--max-body-bytes": "max_body_bytes",
                 "--shutdown-timeout": "shutdown_timeout", "--read-timeout": "read_timeout"}


def one_line_error(result) -> str:
    text = result.output.strip()
    assert "Traceback" not in text and result.exception is None or isinstance(result.exception, SystemExit), text
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
@pytest.mark.parametrize("option", list(NUMERIC_OPTIONS) + list(SERVE_OPTIONS))
def test_every_numeric_option_refuses_absurd_values_in_one_line(command, option, tmp_path):
    if option in SERVE_OPTIONS and command != "serve":
        pytest.skip("a serve option")
    if command == "serve" and NUMERIC_OPTIONS.get(option) in SAMPLER_ROWS:
        pytest.skip("serve takes sampling settings per request")
    missing = str(tmp_path / "absent.gguf")
    extra = {"run": ["hi"], "chat": [], "serve": [] if option == "--port" else ["--port", "0"]}[command]
    for value in HUGE:
        result = CliRunner().invoke(main, [command, "-m", missing, option, value, *extra])
        line = one_line_error(result)
        # out of range or not a number: a usage error naming the option; in range: the next check (the file)
        assert result.exit_code == 2 and option in line or result.exit_code == 1 and "absent.gguf" in line, line


def test_the_cli_the_library_and_the_server_agree_on_a_range():
    from llamaspec.server.validation import parse_completion, parse_policy_update
    from llamaspec.server.apierror import APIError

    for row, value in [("draft_max", 2**70), ("draft_max", 10**9), ("top_k", 10**30), ("seed", 10**400),
                       ("seed", -1), ("temperature", math.inf), ("temperature", 2.5), ("temperature", 2e-251), ("max_tokens", 2**40)]:
        expected = bounds.BOUNDS[row].problem(value, {"n_batch": ModelConfig().n_batch})   # the default batch
        assert expected is not None
        with pytest.raises(InvalidParameterError) as library:
            if row in ("draft_max",):
                LoadConfig(draft_max=value)
            elif row == "max_tokens":
                bounds.check(row, value)
            else:
                SamplerConfig(**{"temperature": 0.5, row: value})
        assert expected in str(library.value) and "\n" not in str(library.value)
        with pytest.raises(APIError) as server:
            if row == "draft_max":
                parse_policy_update({"draft_max": value}, {}, ModelConfig().n_batch)
            else:
                parse_completion({"prompt": "hi", row: value})
        assert server.value.status == 400 and server.value.param == row and expected in server.value.message
        if row != "max_tokens":
            option = {"draft_max": "--draft-max", "top_k": "--top-k", "seed": "-s", "temperature": "--temp"}[row]
            result = CliRunner().invoke(main, ["run", "-m", "absent.gguf", option, str(value), "hi"])
            assert bounds.BOUNDS[row].problem(value) in one_line_error(result)   # before any batch is known


def test_draft_length_is_bounded_by_the_batch():
    assert LoadConfig().replace(n_batch=64, draft_max=63).drafting.draft_max == 63
    with pytest.raises(InvalidParameterError, match=r"draft_max must be an integer in \[0, 63\]: a verification"):
        LoadConfig().replace(n_batch=64, draft_max=64)
    with pytest.raises(InvalidParameterError, match="draft_max"):
        make_policy("auto", draft_max=10**9)
    with pytest.raises(InvalidParameterError, match="draft_max"):
        from llamaspec.policy import AutoPolicy
        AutoPolicy(draft_max=10**9)   # would build two lists of 10^9 floats


def test_threads_are_bounded_by_the_machine():
    n = bounds.cpu_count()
    assert ModelConfig(n_threads=n).n_threads == n
    with pytest.raises(InvalidParameterError, match="logical CPUs"):
        ModelConfig(n_threads=n + 1)


@pytest.mark.parametrize("split", [(1, math.nan), (-1, -1), (0, 0), (1, math.inf), ()])
def test_tensor_split_must_be_finite_shares_with_a_positive_sum(split):
    with pytest.raises(InvalidParameterError, match="tensor_split must be finite shares"):
        ModelConfig(tensor_split=split)
    assert ModelConfig(tensor_split=(3, 1)).tensor_split == (3.0, 1.0)


@pytest.mark.parametrize("value", ["1,nan", "-1,-1", "0,0", "a,b"])
def test_tensor_split_option_is_one_line(value):
    result = CliRunner().invoke(main, ["run", "-m", "absent.gguf", "-ts", value, "hi"])
    assert "--tensor-split" in one_line_error(result) or "absent.gguf" in result.output


def test_main_gpu_and_context_are_checked_against_the_machine(real_models):
    from llamaspec.gguf.reader import read_model_info
    from llamaspec.loading import check_placement

    from conftest import REAL_SMOLLM

    info = read_model_info(real_models / REAL_SMOLLM)   # ~23 KB of KV cache per token: 2^24 tokens is 380 GB
    with pytest.raises(InvalidParameterError, match="main_gpu must be an integer in \\[0, 0\\]"):
        check_placement(info, ModelConfig(main_gpu=1), [])
    with pytest.raises(InvalidParameterError, match="n_ctx must be an integer in .*memory"):
        check_placement(info, ModelConfig(n_ctx=bounds.MAX_CTX), [])
    check_placement(info, ModelConfig(n_ctx=256), [])
