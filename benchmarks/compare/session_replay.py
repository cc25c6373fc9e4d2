"""Session replay: scripted coding-agent sessions (sessions.py) sent turn by turn through the OpenAI chat endpoint
of llamaspec `serve`, llama.cpp's llama-server and ik_llama.cpp's llama-server, one server after another, each
started fresh for each session and sampling regime. Prints a markdown report (also to --out, with a JSON dump
beside it) with every server's exact command.

On a GPU machine, a qwen35 target whose MTP head is in the file (all three servers draft with it):

    python benchmarks/compare/session_replay.py --target Qwen3.6-27B-Q4_K_M.gguf \\
        --server llamaspec,llama-server,ik --llama-server LLAMA_CPP/build/bin/llama-server \\
        --ik-server IK_LLAMA_CPP/build/bin/llama-server --sampling greedy,qwen --out session-replay.md

A draft-model pair instead of the MTP head: add `--draft D.gguf`. llamaspec alone, one session, smaller:
`--server llamaspec --sessions edit-32k --scale 0.25`. The CPU check (a tiny session, two servers):

    python benchmarks/compare/session_replay.py --target qwen2.5-coder-0.5b-instruct.gguf --drafter none \\
        --server llamaspec,llama-server --llama-server BIN/llama-server --target-tokens 2000 --max-tokens 16 \\
        --ctx 4096 --no-repack --sampling greedy

Each turn i POSTs /v1/chat/completions with the scripted history up to turn i, `tools`, `max_tokens`
(--max-tokens, 256), stream=True with stream_options.include_usage; the next request carries the scripted assistant
message, not the generated one (the divergence a real client causes). Per turn, from the server's own figures
(llama-server's `timings`: prompt_n = tokens processed, cache_n = reused, predicted_n / predicted_ms; usage's
prompt_tokens; ik_llama.cpp has no cache_n, usage's prompt_tokens_details.cached_tokens stands in):
- processed, reused, prompt tokens; re-processed = processed - the prompt's growth since the previous turn (what a
  cache that kept everything would not have done), beside the previous scripted answer's length in tokens (the
  goal: re-processed <= it; counted with the target's tokenizer on the answer as Qwen's template renders it, else
  estimated from its characters, marked ~);
- TTFT: the client's clock, from sending the request to the first chunk with content, reasoning or a tool call
  (a Hermes-style tool call's first delta, its id and name, comes as soon as the name is complete on both;
  llama.cpp then streams the arguments piece by piece, llamaspec whole at the call's end; the server's prompt
  seconds, prompt_ms, are shown beside it);
- decode tok/s: the server's predicted_per_second (llama.cpp counts predicted_n - 1 steps over predicted_ms,
  llamaspec predicted_n), else predicted_n / predicted_ms, else the client's clock from the first content.
Per session: wall seconds from the first request to the last answer (the server's load and a warm-up excluded),
and prompt tok/s over every turn's processed tokens and prompt seconds. `--last-only` sends the last request alone
to a fresh server (after the warm-up): the whole conversation processed at once, prompt speed at that length:

    python benchmarks/compare/session_replay.py --target T.gguf --server llamaspec,llama-server \
        --llama-server BIN/llama-server --sessions agent-64k --target-tokens 16000 --last-only

Servers (--server, run in the order given), each at its documented multi-turn settings for hybrid models plus what
the case needs; the same context (-c), KV type (-ctk/-ctv), flash attention, one slot (-np 1), draft length (--k)
and per-request sampling on all:
- llamaspec serve: `--drafter mtp` (or -md D.gguf, or `--drafter lookup` at its default lengths), --draft-max K;
  turn checkpoints are its default;
- llama-server: `--spec-type draft-mtp` (or -md with draft-simple, or ngram-simple for lookup at its default
  lengths), --spec-draft-n-max K, --ctx-checkpoints 32,
  --cache-ram 8192 (its defaults, said explicitly), --jinja (its default); no --cache-reuse (KV shifting does not
  apply to a recurrent state);
- ik_llama.cpp: `--spec-type mtp:n_max=K,p_min=0.0` (or draft:...), --jinja (off by default there),
  --ctx-checkpoints 32, --cache-ram 8192;
- llamaspec-fixed:K: llamaspec serve again, `--policy fixed --draft-max K`: `auto` (the first llamaspec run) against a
  fixed draft length on the same turns, e.g. `--server llamaspec,llamaspec-fixed:2,llama-server`;
- llamaspec-max:K: llamaspec serve again with its policy (`auto`) and K as its longest draft: the load of
  llamaspec-fixed:K (on a hybrid the recurrent-state snapshots follow the longest draft) with `auto`'s choices, which
  tells a policy's cost from its load's.
Sampling (--sampling): greedy (temperature 0) and qwen (Qwen's recommended T=0.6, top-k 20, top-p 0.95, min-p 0,
seed 0). A server that fails to start or answers an error ends the run: the message names the server, the session,
the turn and the server's log tail, and the exit status is 1. Servers are stopped at the end, on Ctrl-C and on
SIGTERM.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import math
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

try:
    from . import peers, sessions
    from .bench_engine import hardware
except ImportError:   # run as a script: its folder is on sys.path
    import peers
    import sessions
    from bench_engine import hardware

SERVERS = ("llamaspec", "llama-server", "ik")
LABELS = {"llamaspec": "llamaspec serve", "llama-server": "llama-server", "ik": "ik_llama.cpp llama-server"}
FIXED = "llamaspec-fixed:"   # llamaspec serve --policy fixed --draft-max K: `auto` against a fixed length, same run
CAPPED = "llamaspec-max:"    # llamaspec serve --draft-max K: its policy within a fixed length's load
OWN = {FIXED: "fixed", CAPPED: "capped"}


def own_k(name: str) -> tuple[str, int] | None:
    """("fixed" or "capped", K) of a server named llamaspec-fixed:K or llamaspec-max:K, else None."""
    for prefix, kind in OWN.items():
        if name.startswith(prefix):
            return kind, int(name[len(prefix):])
    return None


def label(name: str) -> str:
    own = own_k(name)
    if own is None:
        return LABELS[name]
    kind, k = own
    return f"llamaspec serve, fixed k={k}" if kind == "fixed" else f"llamaspec serve, draft-max {k}"


SAMPLING = {"greedy": {"temperature": 0.0},
            "qwen": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "seed": 0}}
CACHE_RAM_MIB, CTX_CHECKPOINTS = 8192, 32


class ReplayError(RuntimeError):
    """A server that did not start or answered an error: the message says which and where."""


# ---------------------------------------------------------------------------------------------------------------
# Server commands
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What every server runs with."""
    target: str
    draft: str | None = None
    drafter: str = "mtp"          # mtp (the target's head), draft (the --draft file), none
    k: int = 3
    n_ctx: int = 8192
    n_gpu_layers: int = -1
    kv_type: str = "f16"
    flash_attn: str = "on"
    no_repack: bool = False

    def common(self) -> list[str]:
        ngl = str(99 if self.n_gpu_layers < 0 else self.n_gpu_layers)
        flags = ["-m", self.target, "-c", str(self.n_ctx), "-ngl", ngl, "-fa", self.flash_attn,
                 "-ctk", self.kv_type, "-ctv", self.kv_type, "-np", "1"]
        if self.drafter == "draft":
            flags[2:2] = ["-md", self.draft]
        return flags + (["--no-repack"] if self.no_repack else [])


def llamaspec_cmd(launcher: list[str], setup: Setup, port: int, extra: list[str]) -> list[str]:
    drafting = {"mtp": ["--drafter", "mtp"], "draft": ["--drafter", "model"], "lookup": ["--drafter", "lookup"],
                "none": ["--no-draft"]}[setup.drafter]
    if any(f in ("--drafter", "--no-draft") or f.startswith("--drafter=") for f in extra):
        drafting = []   # the extra flags choose the drafter (e.g. lookup+mtp): one --drafter in the command
    k = ["--draft-max", str(setup.k)] if setup.drafter not in ("none", "lookup") else []   # lookup: its default
    return [*launcher, "serve", *setup.common(), *drafting, *k, "--host", "127.0.0.1", "--port", str(port), *extra]


def llama_server_cmd(exe: str, setup: Setup, port: int, extra: list[str]) -> list[str]:
    spec = {"mtp": ["--spec-type", "draft-mtp"], "draft": ["--spec-type", "draft-simple"],
            "lookup": ["--spec-type", "ngram-simple"], "none": []}[setup.drafter]
    k = ["--spec-draft-n-max", str(setup.k)] if spec and setup.drafter != "lookup" else []   # ngram: its defaults
    return [exe, *setup.common(), *spec, *k, "--ctx-checkpoints", str(CTX_CHECKPOINTS), "--cache-ram",
            str(CACHE_RAM_MIB), "--jinja", "--host", "127.0.0.1", "--port", str(port), *extra]


def ik_server_cmd(exe: str, setup: Setup, port: int, extra: list[str]) -> list[str]:
    if setup.drafter == "lookup":
        raise ReplayError("ik_llama.cpp: prompt lookup is not set up in this benchmark (--drafter lookup)")
    stage = {"mtp": "mtp", "draft": "draft"}.get(setup.drafter)
    spec = ["--spec-type", f"{stage}:n_max={setup.k},p_min=0.0"] if stage else []
    common = [f for f in setup.common() if f != "--no-repack"]   # ik_llama.cpp repacks only with -rtr
    return [exe, *common, *spec, "--jinja", "--ctx-checkpoints", str(CTX_CHECKPOINTS), "--cache-ram",
            str(CACHE_RAM_MIB), "--host", "127.0.0.1", "--port", str(port), *extra]


# ---------------------------------------------------------------------------------------------------------------
# One streamed request
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    processed: int
    reused: int
    ttft_s: float              # client: request sent -> first chunk with content, reasoning or a tool call
    prompt_s: float            # the server's prompt_ms / 1000
    decode_tps: float
    decode_from: str           # "server" (its timings) or "client"
    completion_tokens: int
    wall_s: float              # the request, sent to [DONE]
    drafted: int = 0
    accepted: int = 0
    growth: int | None = None          # prompt tokens - the previous turn's
    floor: int | None = None           # what the chat template made new (template_floors); None: not known
    reprocessed: int | None = None     # processed - floor (else processed - growth)
    last_answer_tokens: int | None = None
    last_answer_estimated: bool = False

    @property
    def within_goal(self) -> bool | None:
        if self.reprocessed is None or self.last_answer_tokens is None:
            return None
        return self.reprocessed <= self.last_answer_tokens


def stream_chat(port: int, body: dict, timeout: float) -> dict:
    """POST /v1/chat/completions with stream=True; the figures of one turn (Turn's fields but turn and the diffs).
    Raises ReplayError on an HTTP error, an error event in the stream, or a reply without usage or timings."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    first = None
    usage, timings = None, None
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise ReplayError(f"HTTP {response.status}: {response.read()[:500].decode(errors='replace')}")
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                if line.startswith("error:"):
                    raise ReplayError(f"error event: {line[:500]}")
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ReplayError(f"error in the stream: {json.dumps(chunk['error'])[:500]}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if first is None and any(delta.get(f) for f in ("content", "reasoning_content", "tool_calls")):
                    first = time.perf_counter()
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    except (OSError, http.client.HTTPException) as e:   # a timeout, a reset, a server gone
        raise ReplayError(f"{e.__class__.__name__}: {e}") from None
    finally:
        conn.close()
    end = time.perf_counter()
    if not timings or "prompt_n" not in timings:
        raise ReplayError(f"the reply had no timings (prompt_n): usage={usage} timings={timings}")
    processed = int(timings["prompt_n"])
    cached = timings.get("cache_n")
    if cached is None and usage:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else \
        processed + int(cached or 0)
    reused = int(cached) if cached is not None else prompt_tokens - processed
    completion = int(timings.get("predicted_n", usage.get("completion_tokens", 0) if usage else 0))
    first = first or end
    if timings.get("predicted_per_second"):
        tps, source = float(timings["predicted_per_second"]), "server"
    elif timings.get("predicted_ms"):
        tps, source = completion / (float(timings["predicted_ms"]) / 1e3), "server"
    else:
        tps, source = (completion / (end - first) if end > first else 0.0), "client"
    return {"prompt_tokens": prompt_tokens, "processed": processed, "reused": reused, "ttft_s": first - t0,
            "prompt_s": float(timings.get("prompt_ms", 0.0)) / 1e3, "decode_tps": tps, "decode_from": source,
            "completion_tokens": completion, "wall_s": end - t0, "drafted": int(timings.get("draft_n", 0)),
            "accepted": int(timings.get("draft_n_accepted", 0))}


# ---------------------------------------------------------------------------------------------------------------
# A session on a server
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    server: str
    session: str
    sampling: str
    cmd: str
    digest: str = ""
    wall_s: float = 0.0
    turns: list = field(default_factory=list)

    def summary(self) -> dict:
        t = self.turns
        predicted = sum(x.completion_tokens / x.decode_tps for x in t if x.decode_tps > 0)
        goal = [x.within_goal for x in t if x.within_goal is not None]
        timed = [x for x in t if x.processed > 0 and x.prompt_s > 0]
        prompt_s = sum(x.prompt_s for x in timed)
        return {"wall_s": self.wall_s, "mean_ttft_s": sum(x.ttft_s for x in t) / len(t) if t else 0.0,
                "prompt_tps": sum(x.processed for x in timed) / prompt_s if prompt_s else 0.0,
                "processed": sum(x.processed for x in t), "reused": sum(x.reused for x in t),
                "decode_tps": sum(x.completion_tokens for x in t) / predicted if predicted else 0.0,
                "turns": len(t), "turns_within_goal": f"{sum(goal)}/{len(goal)}" if goal else "-"}


def replay(port: int, session: sessions.Session, sampling: str, max_tokens: int, timeout: float,
           answer_tokens: list, max_turns: int | None = None, on_turn=None,
           last_only: bool = False, floors: list | None = None) -> tuple[list[Turn], float]:
    """The session's requests in order on a started server: its Turns and the wall seconds. `last_only`: only
    the last request (of the first `max_turns`), on a server that holds at most the warm-up's first tokens: a
    prompt processed whole."""
    turns: list[Turn] = []
    n = len(session.requests) if max_turns is None else min(max_turns, len(session.requests))
    t0 = time.perf_counter()
    for i in ([n - 1] if last_only else range(n)):
        body = {"model": "session-replay", "messages": session.request_messages(i), "tools": list(session.tools),
                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **SAMPLING[sampling]}
        try:
            figures = stream_chat(port, body, timeout)
        except ReplayError as e:
            raise ReplayError(f"turn {i} of {n}: {e}") from None
        turn = Turn(i, **figures)
        if turns:
            derive(turn, turns[-1], answer_tokens[i - 1], floors[i] if floors else None)
        turns.append(turn)
        if on_turn:
            on_turn(turn)
    return turns, time.perf_counter() - t0


def derive(turn: Turn, before: Turn, answer: tuple[int, bool], floor: int | None) -> None:
    """A later turn's figures against the one before: growth, the template's floor and what was processed again."""
    turn.growth = turn.prompt_tokens - before.prompt_tokens
    turn.floor = floor
    turn.reprocessed = turn.processed - (turn.growth if floor is None else floor)
    turn.last_answer_tokens, turn.last_answer_estimated = answer


def template_floors(session: sessions.Session, vocab_model: str, template_source: str | None = None) -> list:
    """Per request, the tokens the chat template makes new: the prompt's tokens past its longest common prefix with
    the previous request's prompt, both rendered as `serve` renders them (the tools, the messages as the server
    parses them) and tokenized with `vocab_model`'s vocabulary. A cache can keep no more than that prefix, so
    processing the rest is forced. Usually the prompt's growth; on the turn after a new user message Qwen's template
    drops the thinking of every answer since the previous one, and the prompt differs from where the first of those
    answers began. The first request, and every one where the template or the vocabulary does not load: None."""
    from llamaspec.chat_template import ChatTemplate, ChatTemplateError
    from llamaspec.drafters import common_prefix_len
    from llamaspec.errors import LlamaspecError
    from llamaspec.gguf.reader import read_model_info
    from llamaspec.server.apierror import APIError
    from llamaspec.server.validation import parse_chat

    none = [None] * len(session.requests)
    try:
        template = ChatTemplate.from_model_info(read_model_info(vocab_model)) if template_source is None else \
            ChatTemplate(template_source)
        texts = [template.render(parse_chat({"messages": session.request_messages(i)}).prompt,
                                 tools=list(session.tools)) for i in range(len(session.requests))]
    except (ChatTemplateError, LlamaspecError, APIError, OSError, ValueError):
        return none
    prompts = tokenize_texts(vocab_model, texts)
    if prompts is None:
        return none
    return [None] + [len(now) - common_prefix_len(before, now) for before, now in zip(prompts, prompts[1:])]


def rendered_answer(message: dict) -> str:
    """An assistant message as Qwen's (Hermes-style) chat template renders it, near enough."""
    text = message.get("content") or ""
    for call in message.get("tool_calls", ()):
        fn = call["function"]
        text += "\n<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])},
                                               ensure_ascii=False) + "\n</tool_call>"
    return "<|im_start|>assistant\n" + text + "<|im_end|>\n"


def answer_lengths(session: sessions.Session, target: str) -> list[tuple[int, bool]]:
    """Each scripted answer's length in tokens and whether it was estimated: the target's tokenizer (llama.cpp,
    the vocabulary alone) where it loads, else characters / CHARS_PER_TOKEN."""
    texts = [rendered_answer(session.scripted_answer(i)) for i in range(len(session.requests))]
    counts = count_tokens(target, texts)
    if counts is None:
        return [(math.ceil(len(t) / sessions.CHARS_PER_TOKEN), True) for t in texts]
    return [(n, False) for n in counts]


def count_tokens(model_path: str, texts: list[str]) -> list[int] | None:
    """Token counts of `texts` (special tokens parsed, no BOS) with a GGUF's vocabulary, or None where it does not
    load."""
    tokens = tokenize_texts(model_path, texts)
    return None if tokens is None else [len(t) for t in tokens]


def tokenize_texts(model_path: str, texts: list[str]) -> list[list[int]] | None:
    """`texts` as tokens (special tokens parsed, no BOS) with a GGUF's vocabulary, or None where it does not
    load."""
    try:
        import llama_cpp

        from llamaspec.backend.native import init_backend, native_log
    except ImportError:
        return None
    init_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with native_log():   # llama.cpp's loader lines kept off the terminal
        model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params) \
            if Path(model_path).is_file() else None
    if not model:
        return None
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        out = []
        for text in texts:
            data = text.encode()
            n_max = len(data) + 16
            buf = (llama_cpp.llama_token * n_max)()
            n = int(llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, False, True))
            out.append(list(buf[:n]))
        return out
    finally:
        llama_cpp.llama_model_free(model)


def warm_up(port: int, timeout: float) -> None:
    """One short request with an unrelated prompt (kernels loaded, nothing of the session cached)."""
    stream_chat(port, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": 0.0}, timeout)


def server_command(name: str, a, setup: Setup, port: int) -> list[str]:
    if name == "llamaspec":
        return llamaspec_cmd(shlex.split(a.llamaspec), setup, port, shlex.split(a.llamaspec_args))
    own = own_k(name)
    if own is not None:   # the same server and flags, its draft length fixed or capped at K (lookup's too)
        kind, k = own
        length = ["--draft-max", str(k)] if setup.drafter == "lookup" else []
        policy = ["--policy", "fixed"] if kind == "fixed" else []
        return llamaspec_cmd(shlex.split(a.llamaspec), replace(setup, k=k), port,
                             [*policy, *length, *shlex.split(a.llamaspec_args)])
    exe = a.llama_server if name == "llama-server" else a.ik_server
    if not exe:
        flag = "--llama-server" if name == "llama-server" else "--ik-server"
        raise ReplayError(f"{label(name)}: no binary given ({flag})")
    if name == "llama-server":
        return llama_server_cmd(exe, setup, port, shlex.split(a.llama_server_args))
    return ik_server_cmd(exe, setup, port, shlex.split(a.ik_args))


def run_all(a, setup: Setup, session_list: list, log_dir: Path, progress=print) -> list[Run]:
    """Every server x session x sampling, a fresh server for each; stops at the first error (ReplayError)."""
    runs = []
    lengths = {s.name: answer_lengths(s, setup.target) for s in session_list}
    floors = {s.name: template_floors(s, setup.target) for s in session_list}
    for name in a.server:
        for session in session_list:
            for sampling in a.sampling:
                port = peers.free_port()
                cmd = server_command(name, a, setup, port)
                log_path = log_dir / f"{name.replace(':', '-')}-{session.name}-{sampling}.log"
                where = f"{label(name)}, session {session.name}, sampling {sampling}"
                progress(f"start: {where}: {peers.shown(cmd)}")
                try:
                    server = peers.PeerServer(cmd, port, log_path, a.start_timeout, a.timeout)
                except RuntimeError as e:
                    raise ReplayError(f"{where}: the server did not start: {e}\n{log_tail(log_path)}") from None
                with server:
                    run = Run(name, session.name, sampling, peers.shown(cmd), session.digest)
                    try:
                        warm_up(port, a.timeout)
                        run.turns, run.wall_s = replay(
                            port, session, sampling, a.max_tokens, a.timeout, lengths[session.name], a.max_turns,
                            last_only=a.last_only, floors=floors[session.name],
                            on_turn=lambda t: progress(f"  turn {t.turn}: prompt {t.prompt_tokens}, processed "
                                                       f"{t.processed}, TTFT {t.ttft_s:.2f} s"))
                    except ReplayError as e:
                        raise ReplayError(f"{where}: {e}\nserver log, last lines:\n{log_tail(log_path)}") from None
                runs.append(run)
    return runs


def log_tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-n:]) or "(empty log)"


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------
def turn_table(run: Run) -> list[str]:
    lines = ["| turn | prompt tokens | processed | reused | template floor | re-processed | last answer | within | "
             "TTFT s | prompt s | decode tok/s | tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in run.turns:
        answer = "" if t.last_answer_tokens is None else \
            f"{'~' if t.last_answer_estimated else ''}{t.last_answer_tokens}"
        within = {True: "yes", False: "**no**", None: ""}[t.within_goal]
        again = "" if t.reprocessed is None else str(t.reprocessed)
        tps = f"{t.decode_tps:.2f}" + ("" if t.decode_from == "server" else " (client)")
        floor = "" if t.floor is None else str(t.floor)
        lines.append(f"| {t.turn} | {t.prompt_tokens} | {t.processed} | {t.reused} | {floor} | {again} | {answer} | "
                     f"{within} | "
                     f"{t.ttft_s:.3f} | {t.prompt_s:.3f} | {tps} | {t.completion_tokens} |")
    return lines


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def report(a, setup: Setup, session_list: list, runs: list[Run], hardware: str, argv: list[str],
           note: str = "") -> str:
    files = [setup.target] + ([setup.draft] if setup.draft and setup.drafter == "draft" else [])
    sizes = ", ".join(f"{Path(f).name} ({Path(f).stat().st_size / 2**20:.0f} MiB)" if Path(f).is_file()
                      else Path(f).name for f in files)
    drafter = {"mtp": f"the target's MTP head, draft length {setup.k}", "none": "none (plain decoding)",
               "draft": f"draft model {Path(setup.draft or '').name}, draft length {setup.k}",
               "lookup": "prompt lookup (llama-server: ngram-simple), each at its default lengths"}[setup.drafter]
    lines = ["# Session replay", "", f"Hardware: {hardware}.", "", f"Model files: {sizes}. Drafter: {drafter}. "
             f"Context {setup.n_ctx}, KV {setup.kv_type}, flash attention {setup.flash_attn}, one slot; "
             f"max_tokens {a.max_tokens} per turn.", "",
             "Sessions: " + "; ".join(f"{s.name} ({len(s.requests)} turns, ~{s.approx_tokens} tokens, digest "
                                      f"{s.digest})" for s in session_list) + ".", "",
             "Template floor: the prompt's tokens past its common prefix with the previous request's, both rendered "
             "with the chat template and tokenized (what the template made new; no cache can keep more). It is the "
             "prompt's growth except after a new user message, where Qwen's template drops the thinking of the "
             "answers since the previous one. Re-processed: tokens processed minus the floor (minus the growth where "
             "the floor is not known); the goal is re-processed <= the previous scripted answer's length (last "
             "answer; ~ estimated from characters).", "", f"    python {shlex.join(argv)}", "",
             *([note, ""] if note else [])]
    for run in runs:
        lines += [f"## {label(run.server)}: {run.session}, {run.sampling}", "", f"    {run.cmd}", "",
                  *turn_table(run), ""]
    lines += ["## Summary", "", "Prompt tok/s: the tokens processed over the server's prompt seconds, every turn "
              "together.", "", "| server | session | sampling | wall s | mean TTFT s | processed | reused | "
              "prompt tok/s | decode tok/s | turns within goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = run.summary()
        lines.append(f"| {label(run.server)} | {run.session} | {run.sampling} | {s['wall_s']:.2f} | "
                     f"{s['mean_ttft_s']:.3f} | {s['processed']} | {s['reused']} | {s['prompt_tps']:.1f} | "
                     f"{s['decode_tps']:.2f} | {s['turns_within_goal']} |")
    ours = {(r.session, r.sampling): r.summary() for r in runs if r.server == "llamaspec"}
    peer_runs = [r for r in runs if r.server != "llamaspec" and (r.session, r.sampling) in ours]
    if peer_runs:
        lines += ["", "## llamaspec / each peer", "", "Wall time and TTFT: peer's / llamaspec's (above 1: llamaspec "
                  "faster); processed: llamaspec's / peer's (below 1: llamaspec processes less); decode: llamaspec's "
                  "/ peer's; prompt: llamaspec's prompt tok/s / peer's. A fixed-k llamaspec row is its `--policy` "
                  "(default `auto`) against that fixed length on the same turns; a draft-max row, against itself "
                  "with that longest draft.", "",
                  "| peer | session | sampling | wall | TTFT | processed | prompt | decode |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in peer_runs:
            o, p = ours[(r.session, r.sampling)], r.summary()
            lines.append(f"| {label(r.server)} | {r.session} | {r.sampling} | {ratio(p['wall_s'], o['wall_s'])} | "
                         f"{ratio(p['mean_ttft_s'], o['mean_ttft_s'])} | {ratio(o['processed'], p['processed'])} | "
                         f"{ratio(o['prompt_tps'], p['prompt_tps'])} | {ratio(o['decode_tps'], p['decode_tps'])} |")
    return "\n".join(lines) + "\n"


def dump(setup: Setup, session_list: list, runs: list[Run], hardware: str, argv: list[str],
         commit: str | None) -> dict:
    """The run as JSON; `commit`: the checkout the sessions were built from (they quote its files)."""
    return {"hardware": hardware, "argv": argv, "commit": commit, "setup": asdict(setup),
            "sessions": [{"name": s.name, "turns": len(s.requests), "approx_tokens": s.approx_tokens,
                          "digest": s.digest} for s in session_list],
            "runs": [{"server": r.server, "session": r.session, "sampling": r.sampling, "cmd": r.cmd,
                      "digest": r.digest, "summary": r.summary(),
                      "turns": [asdict(t) | {"within_goal": t.within_goal} for t in r.turns]} for r in runs]}


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------
def names(choices, fixed: bool = False):
    """A comma-separated list of `choices` (and, with `fixed`, llamaspec-fixed:K and llamaspec-max:K for K >= 1)."""
    def known(n: str) -> bool:
        return n in choices or fixed and any(n.startswith(p) and n[len(p):].isdigit() and int(n[len(p):]) > 0
                                             for p in OWN)

    def parse(text: str) -> list[str]:
        got = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in got if not known(n)]
        if bad or not got:
            listed = ", ".join([*choices, *([f"{p}K (K >= 1)" for p in OWN] if fixed else [])])
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not one of {listed}")
        return list(dict.fromkeys(got))
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="target GGUF (a qwen35 file carries its MTP head)")
    p.add_argument("--draft", help="draft GGUF (a draft-model pair instead of the MTP head)")
    p.add_argument("--drafter", choices=["mtp", "draft", "lookup", "none"],
                   help="mtp: the target's head; draft: --draft; lookup: prompt lookup (llama-server: ngram-simple; "
                        "each at its default lengths); none: plain [default: draft with --draft, else mtp]")
    p.add_argument("--k", type=int, default=3, help="draft length (llamaspec: its longest) [3]")
    p.add_argument("--server", type=names(SERVERS, fixed=True), default=["llamaspec"],
                   help="llamaspec,llama-server,ik; llamaspec-fixed:K runs llamaspec serve again with --policy fixed "
                        "--draft-max K (its `auto` against a fixed length on the same turns); llamaspec-max:K with "
                        "--draft-max K and its own policy (that fixed length's load, `auto`'s choices)")
    p.add_argument("--sessions", type=names(tuple(sessions.SESSIONS)), default=list(sessions.SESSIONS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply each session's target size")
    p.add_argument("--target-tokens", type=int, help="each session's target size in tokens (overrides --scale)")
    p.add_argument("--turns", type=int, help="turns per session (default: one per 3000 tokens, 3 to 20)")
    p.add_argument("--max-turns", type=int, help="replay at most this many turns of each session")
    p.add_argument("--last-only", action="store_true",
                   help="send only the last request (of --max-turns) to a fresh server (the warm-up only): "
                        "prompt processing of the whole conversation (with --target-tokens 16000, 64000: prompt speed at "
                        "that length)")
    p.add_argument("--sampling", type=names(tuple(SAMPLING)), default=["greedy"], help="greedy,qwen")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ctx", type=int, help="context size (default: the largest session + max-tokens, +25%%)")
    p.add_argument("--ngl", type=int, default=-1)
    p.add_argument("--kv-type", default="f16", help="-ctk/-ctv on every server [f16]")
    p.add_argument("--flash-attn", default="on", choices=["on", "off", "auto"])
    p.add_argument("--no-repack", action="store_true", help="llama.cpp's CPU --no-repack (llamaspec, llama-server)")
    p.add_argument("--llamaspec", default=f"{shlex.quote(sys.executable)} -m llamaspec",
                   help="how to start llamaspec [this Python -m llamaspec]")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--ik-server", help="ik_llama.cpp's llama-server binary")
    p.add_argument("--llamaspec-args", default="", help="more flags for llamaspec serve (one string)")
    p.add_argument("--llama-server-args", default="", help="more flags for llama-server")
    p.add_argument("--ik-args", default="", help="more flags for ik_llama.cpp's server")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds a request may wait for the server's next byte (the first: its prefill) [900]")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for a server to load [900]")
    p.add_argument("--out", help="the markdown report; the JSON dump goes beside it (.json)")
    p.add_argument("--report-from", metavar="JSON",
                   help="no servers: write the report again from a run's JSON dump, the sessions rebuilt from its "
                        "command line (their digests checked), answer lengths and template floors counted with "
                        "--target's vocabulary (a vocab-only GGUF will do) and --chat-template")
    p.add_argument("--chat-template", metavar="FILE",
                   help="with --report-from: the chat template the servers rendered (default: --target's own)")
    p.add_argument("--sessions-at", metavar="COMMIT",
                   help="with --report-from: build the sessions from this commit's files (default: the commit the "
                        "dump names, where the working tree's files give other sessions)")
    return p


def head_commit() -> str | None:
    """The repository's checked-out commit, or None outside a git checkout."""
    done = subprocess.run(["git", "-C", str(sessions.REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def sessions_at(commit: str, names: list[str], old: argparse.Namespace, into: Path) -> list:
    """The sessions as a run at `commit` built them (they quote the repository's files): that commit's tree is
    unpacked into `into` and the sessions built from it. ValueError when git cannot give that commit."""
    done = subprocess.run(["git", "-C", str(sessions.REPO), "archive", "--format=tar", commit], capture_output=True)
    if done.returncode != 0:
        raise ValueError(f"git cannot give commit {commit}: {done.stderr.decode(errors='replace').strip()[:200]}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(into, filter="data")
    return [sessions.build(n, old.scale, old.target_tokens, old.turns, root=into) for n in names]


def report_again(a, argv: list[str]) -> int:
    """--report-from: the report of a recorded run, with today's derived figures (floors, re-processed)."""
    from llamaspec.chat_template import ChatTemplate, ChatTemplateError

    try:
        data = json.loads(Path(a.report_from).read_text())
        if not isinstance(data, dict) or not {"argv", "setup", "sessions", "runs", "hardware"} <= data.keys():
            raise ValueError("not a session replay's JSON dump (argv, setup, sessions, runs, hardware)")
        with contextlib.redirect_stderr(io.StringIO()):   # argparse's usage text: the one line below says it
            old = parser().parse_args(data["argv"])
        setup = Setup(**data["setup"])
        recorded = {s["name"]: s["digest"] for s in data["sessions"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"session replay: cannot read {a.report_from}: {e}", file=sys.stderr)
        return 1
    except SystemExit:   # argparse has said what is wrong with the recorded command line
        print(f"session replay: {a.report_from} holds a command line this script does not take", file=sys.stderr)
        return 1
    template = None
    if a.chat_template:
        try:
            template = Path(a.chat_template).read_text()
            ChatTemplate(template)
        except (OSError, UnicodeDecodeError, ChatTemplateError) as e:
            print(f"session replay: --chat-template {a.chat_template}: {e}", file=sys.stderr)
            return 1
    at = a.sessions_at or data.get("commit")
    session_list = [sessions.build(n, old.scale, old.target_tokens, old.turns) for n in old.sessions]
    changed = [s.name for s in session_list if recorded.get(s.name) != s.digest]
    with tempfile.TemporaryDirectory(prefix="llamaspec-sessions-") as tree:
        if changed and at:   # the working tree moved on since the run: its files, as they were then
            try:
                session_list = sessions_at(at, old.sessions, old, Path(tree))
            except (ValueError, OSError, tarfile.TarError) as e:
                print(f"session replay: the sessions changed since {a.report_from} was recorded, and {e}",
                      file=sys.stderr)
                return 1
            changed = [s.name for s in session_list if recorded.get(s.name) != s.digest]
    if changed:
        where = f"at commit {at}" if at else "in this checkout (the dump names no commit: --sessions-at COMMIT)"
        print(f"session replay: the sessions {where} are not the ones {a.report_from} recorded "
              f"({', '.join(changed)}: other digests); re-run it instead", file=sys.stderr)
        return 1
    lengths = {s.name: answer_lengths(s, a.target) for s in session_list}
    floors = {s.name: template_floors(s, a.target, template) for s in session_list}
    fields = {f for f in Turn.__dataclass_fields__ if f not in ("growth", "floor", "reprocessed",
                                                                "last_answer_tokens", "last_answer_estimated")}
    runs = []
    try:
        for r in data["runs"]:
            turns = [Turn(**{k: v for k, v in t.items() if k in fields}) for t in r["turns"]]
            for before, now in zip(turns, turns[1:]):
                derive(now, before, lengths[r["session"]][now.turn - 1], floors[r["session"]][now.turn])
            runs.append(Run(r["server"], r["session"], r["sampling"], r["cmd"], r["digest"], r["summary"]["wall_s"],
                            turns))
    except (KeyError, TypeError, IndexError) as e:
        print(f"session replay: {a.report_from}: a run or turn is not as this script writes them ({e!r})",
              file=sys.stderr)
        return 1
    argv_then = ["benchmarks/compare/session_replay.py", *data["argv"]]
    note = (f"Re-reported from {Path(a.report_from).name} (no server run again): `python "
            f"{shlex.join(['benchmarks/compare/session_replay.py', *argv])}`.")
    text = report(old, setup, session_list, runs, data["hardware"], argv_then, note)
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(
            dump(setup, session_list, runs, data["hardware"], data["argv"], at), indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.chat_template and not a.report_from:
        parser().error("--chat-template goes with --report-from (a run renders with the target's own template)")
    if a.sessions_at and not a.report_from:
        parser().error("--sessions-at goes with --report-from (a run builds its sessions from this checkout)")
    if a.report_from:
        return report_again(a, argv)
    drafter = a.drafter or ("draft" if a.draft else "mtp")
    if drafter == "draft" and not a.draft:
        parser().error("--drafter draft needs --draft FILE")
    session_list = [sessions.build(n, a.scale, a.target_tokens, a.turns) for n in a.sessions]
    largest = max(s.approx_tokens for s in session_list)
    n_ctx = a.ctx or 1024 * math.ceil((largest + a.max_tokens) * 1.25 / 1024)
    setup = Setup(a.target, a.draft, drafter, a.k, n_ctx, a.ngl, a.kv_type, a.flash_attn, a.no_repack)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # SystemExit: the servers' `with` blocks stop them
    progress = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    with tempfile.TemporaryDirectory(prefix="session-replay-") as tmp:
        try:
            runs = run_all(a, setup, session_list, Path(tmp), progress)
        except ReplayError as e:
            print(f"session replay failed: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("session replay interrupted; servers stopped", file=sys.stderr)
            return 130
    hw = hardware()
    text = report(a, setup, session_list, runs, hw, ["benchmarks/compare/session_replay.py", *argv])
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(
            dump(setup, session_list, runs, hw, argv, head_commit()), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
