"""The first minutes of a new user: llama.cpp's flag names, grouped --help, the pair offered per GPU, the CPU-only
build on a GPU machine, `chat` saying why `auto` decoded plainly. No model is loaded here."""
from __future__ import annotations

from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from llamaspec import sysinfo
from llamaspec.cli import main
from llamaspec.cli.options import GPU_LAYERS, HELP_SECTIONS
from llamaspec.cli.pair_choice import warn_before_load


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.mark.parametrize("command", ["chat", "run", "bench", "serve"])
def test_help_is_grouped_and_every_option_has_a_line(command):
    from llamaspec.cli.options import Command

    cmd = main.commands[command]
    text = invoke(command, "--help").output
    for section in ("Model:", "Drafting:", "Placement:") + (("Sampling:",) if command != "serve" else ()):
        assert section in text, (command, section)
    assert ("Server:" in text) == (command == "serve")
    missing = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help and not p.hidden]
    assert isinstance(cmd, Command) and missing == []


def test_llama_cpp_flag_names_reach_the_same_settings():
    cmd = main.commands["run"]
    ctx = cmd.make_context("run", ["--spec-draft-n-max", "5", "--spec-draft-n-min", "2", "--spec-draft-p-min", "0.4",
                                   "--spec-draft-model", "d.gguf", "-ngl", "all", "-n", "7", "--temp", "0.5",
                                   "-p", "hi", "-sys", "brief"])
    p = ctx.params
    assert (p["draft_max"], p["draft_min"], p["draft_p_min"], p["model_draft"]) == (5, 2, 0.4, "d.gguf")
    assert (p["n_gpu_layers"], p["max_tokens"], p["temperature"], p["prompt_option"], p["system"]) == (
        -1, 7, 0.5, "hi", "brief")
    old = cmd.make_context("run", ["--draft-max", "5", "--n-predict", "7", "--temperature", "0.5", "-ngl", "12"]).params
    assert (old["draft_max"], old["max_tokens"], old["temperature"], old["n_gpu_layers"]) == (5, 7, 0.5, 12)
    assert GPU_LAYERS.convert("auto", None, None) == -1


def test_sys_on_a_command_without_it_is_an_unknown_option_not_a_seed():
    result = invoke("bench", "-sys", "x")
    assert result.exit_code == 2 and "-sys" in result.stderr and "Traceback" not in result.output
    assert invoke("run", "-ngl", "most", "x").exit_code == 2


def test_nvidia_gpu_is_seen_from_nvidia_smi_or_device_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(sysinfo.shutil, "which", lambda name: None)
    assert sysinfo.nvidia_gpu_signs(tmp_path) == []
    (tmp_path / "nvidiactl").touch()
    assert sysinfo.nvidia_gpu_signs(tmp_path) == []          # the control node alone is not a GPU
    (tmp_path / "dxg").touch()
    assert sysinfo.nvidia_gpu_signs(tmp_path) == [f"{tmp_path}/dxg (WSL2)"]
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(sysinfo.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert len(sysinfo.nvidia_gpu_signs(tmp_path)) == 3


@pytest.mark.parametrize("signs, ngl, warned", [(["nvidia-smi"], -1, True), (["/dev/dxg (WSL2)"], 0, False),
                                                ([], -1, False), ([], 5, True)])
def test_cpu_only_build_on_a_gpu_machine_says_so_once_with_the_install_command(monkeypatch, capsys, signs, ngl,
                                                                               warned):
    import llamaspec.backend

    monkeypatch.setattr(llamaspec.backend, "supports_gpu_offload", lambda: False)
    monkeypatch.setattr(sysinfo, "nvidia_gpu_signs", lambda: signs)
    warn_before_load("t.gguf", "d.gguf", ngl, None)
    err = capsys.readouterr().err
    assert err.count("warning:") == (1 if warned else 0)
    if signs and warned:
        assert sysinfo.CUDA_REINSTALL in err and signs[0] in err


@pytest.mark.parametrize("gpus, expected", [
    ([sysinfo.GPU(0, "NVIDIA GeForce RTX 4090", 24564, 22900)], "qwen3.6-27b-mtp"),
    ([sysinfo.GPU(0, "NVIDIA GeForce RTX 3060", 12288, 11500)], "default"),
    ([], "default")])
def test_no_model_offers_the_pair_for_the_free_vram(monkeypatch, tmp_path, gpus, expected):
    import llamaspec.backend
    from llamaspec.cli.pair_choice import default_pair_for_this_machine

    monkeypatch.setenv("LLAMASPEC_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(llamaspec.backend, "supports_gpu_offload", lambda: True)
    monkeypatch.setattr(sysinfo, "nvidia_gpus", lambda: gpus)
    assert default_pair_for_this_machine() == expected
    monkeypatch.setattr(llamaspec.backend, "supports_gpu_offload", lambda: False)   # a CPU-only build: small pair
    assert default_pair_for_this_machine() == "default"


class ScriptedChatPair:
    """What `chat`'s session uses of a pair: a template, tokenize, a stream of pieces and its statistics."""

    def __init__(self, policy, drafted: int = 0):
        self.target = SimpleNamespace(info=SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}"
                                                           "{% endfor %}", tokens=(), bos_id=None, eos_id=None))
        self.target_ctx = SimpleNamespace(on_decode=None)   # chat follows its decodes for the prefill line
        self.policy, self.speculative, self.n_ctx = policy, True, 512
        self.drafted, self.last_stats = drafted, None

    def tokenize(self, text, add_special=True):
        return [1, 2, 3]

    def stream(self, tokens, **kwargs):
        from llamaspec.stats import GenerationStats
        from llamaspec.text import Piece

        self.last_stats = GenerationStats(policy=self.policy.name, tokens_generated=20, drafted=self.drafted,
                                          finish_reason="length")
        return (Piece("word ", i, False) for i in range(20))


def _auto_on(t_draft: float, verify, accepted: bool, steps: int = 60):
    """An `auto` policy after `steps` steps on a synthetic machine (draft cost per token, verify cost curve)."""
    from llamaspec.policy import AutoPolicy

    policy = AutoPolicy(draft_max=10)
    for _ in range(steps):
        k = policy.next_draft_len()
        policy.update(k, k if accepted else 0, k * t_draft, verify(k + 1))
    return policy


@pytest.mark.parametrize("machine, reason", [
    (dict(t_draft=0.5, verify=float, accepted=True),                 # verifying n tokens costs n plain passes
     "auto decoded plainly: on this machine even a draft that is always right would be only 0."),
    (dict(t_draft=0.01, verify=lambda n: 1 + 0.01 * (n - 1), accepted=False),   # cheap drafts, all rejected
     "auto decoded plainly: the draft's tokens were not accepted often enough to pay for drafting"),
])
def test_chat_says_why_auto_decoded_a_reply_plainly(machine, reason, capsys):
    from llamaspec.cli.chat import ChatSession
    from llamaspec.policy import FixedPolicy

    session = ChatSession(ScriptedChatPair(_auto_on(**machine)), None, {"max_tokens": None})
    session.reply("hi")
    assert f"[{reason}" in click.unstyle(capsys.readouterr().out)
    for pair in (ScriptedChatPair(_auto_on(**machine), drafted=6), ScriptedChatPair(FixedPolicy(4))):
        ChatSession(pair, None, {"max_tokens": None}).reply("hi")   # it drafted, or it is not `auto`: no line
        assert "decoded plainly" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# the download prompt of `--pair NAME`
# ---------------------------------------------------------------------------------------------------------------
def _pair_on_the_hub(tmp_path, monkeypatch, vram_gb: float, gpus: list, offload: bool = True) -> None:
    """A user pair `big` of two files not downloaded yet (an empty cache), on a terminal, with these GPUs."""
    import llamaspec.backend
    from llamaspec.cli import pair_choice

    (tmp_path / "config").mkdir(parents=True)
    (tmp_path / "config" / "models.toml").write_text(
        '[pairs.big]\ntarget = { repo = "example/Big-GGUF", file = "big-Q4_K_M.gguf", size_gb = 16.8 }\n'
        'draft = { repo = "example/Small-GGUF", file = "small-Q8_0.gguf", size_gb = 0.5 }\n'
        f"vram_gb = {vram_gb}\n")
    monkeypatch.setenv("LLAMASPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(pair_choice, "on_terminal", lambda: True)
    monkeypatch.setattr(llamaspec.backend, "supports_gpu_offload", lambda: offload)
    monkeypatch.setattr(sysinfo, "nvidia_gpus", lambda *a, **k: gpus)
    monkeypatch.setattr(sysinfo, "nvidia_gpu_signs", lambda *a, **k: ["nvidia-smi"] if gpus else [])


def test_download_prompt_without_a_gpu_names_size_and_need_and_defaults_to_no(tmp_path, monkeypatch):
    _pair_on_the_hub(tmp_path, monkeypatch, vram_gb=24, gpus=[])
    result = invoke("chat", "--pair", "big", input="\n")   # Enter takes the default
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert ("Pair 'big' needs big-Q4_K_M.gguf and small-Q8_0.gguf (17.3 GB) from Hugging Face and a GPU with 24 GB; "
            "this machine has no GPU. On the CPU it would be very slow") in result.stderr
    assert "Download now? [y/N]" in result.stderr
    assert "error: download declined" in result.stderr


def test_download_prompt_on_a_gpu_too_small_or_unusable_defaults_to_no(tmp_path, monkeypatch):
    small = sysinfo.GPU(0, "NVIDIA GeForce RTX 3060", 12288, 11000)
    _pair_on_the_hub(tmp_path, monkeypatch, vram_gb=24, gpus=[small])
    result = invoke("chat", "--pair", "big", input="\n")
    assert "this machine has NVIDIA GeForce RTX 3060 with 10.7 GiB free" in result.stderr
    assert "[y/N]" in result.stderr and result.exit_code == 1
    _pair_on_the_hub(tmp_path / "cpu-build", monkeypatch, vram_gb=24, gpus=[small], offload=False)
    result = invoke("chat", "--pair", "big", input="\n")
    assert "this llama-cpp-python build cannot use this machine's GPU" in result.stderr and "[y/N]" in result.stderr


def test_download_prompt_defaults_to_yes_when_the_pair_fits(tmp_path, monkeypatch):
    big = sysinfo.GPU(0, "NVIDIA GeForce RTX 4090", 24564, 23500)
    _pair_on_the_hub(tmp_path, monkeypatch, vram_gb=24, gpus=[big])
    result = invoke("chat", "--pair", "big", input="n\n")   # said no: nothing is downloaded
    assert "with 22.9 GiB free." in result.stderr and "Download now? [Y/n]" in result.stderr
    assert "On the CPU" not in result.stderr and "error: download declined" in result.stderr


def test_serve_parallel_help_says_what_the_readme_says_it_batches():
    text = " ".join(invoke("serve", "--help").output.split())
    for claim in ("Attention and hybrid targets", "the MTP head", "EAGLE-3 / DFlash drafters",
                  "one request at a time"):
        assert claim in text, claim
