"""Scripted coding-agent sessions for the session replay benchmark (session_replay.py): OpenAI-style chat histories
with `tools`, deterministic for a given checkout of this repository, written for this project.

A session is a system prompt (agent instructions, then the project's own README as the project notes an agent
client puts there, ~4K tokens at full size), ten tool schemas, and turns of scripted assistant tool calls with
their results: this repository's source files read from disk (numbered lines, as agents show them), real `grep`
output over its sources, directory listings, and scripted command output (a pytest run listing the test names in
tests/, a `git log --oneline` listing). Request i sends `messages[:requests[i]]`; `messages[requests[i]]` is the
scripted answer the next request carries instead of what the server generated.

- agent-32k / agent-64k: reading and searching the code to answer a task, growing to ~32K / ~64K tokens;
- edit-32k: edit-heavy: read a file, rewrite it whole with write_file (most of it unchanged, two comments added),
  run its tests, then one edit_file, for one file after another.

Sizes are approximate: text is measured in characters at CHARS_PER_TOKEN (a BPE vocabulary's rate on code); the
replay reports the server's own prompt token counts. `scale` multiplies the target (CI builds a ~2K-token one).
Knows nothing about HTTP, servers or tokenizers.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

CHARS_PER_TOKEN = 3.5
REPO = Path(__file__).resolve().parents[2]
SYSTEM_TOKENS = 4000           # the full-size system prompt
TURN_TOKENS = 3000             # one turn per this many tokens of target, 3 to 20 turns

SESSIONS = {"agent-32k": ("agent", 32_000), "agent-64k": ("agent", 64_000), "edit-32k": ("edit", 32_000)}


@dataclass(frozen=True)
class Session:
    name: str
    messages: tuple        # OpenAI chat messages (dicts), the scripted whole
    tools: tuple           # OpenAI tool schemas
    requests: tuple        # request i sends messages[:requests[i]]; messages[requests[i]] is its scripted answer

    def request_messages(self, i: int) -> list[dict]:
        return list(self.messages[:self.requests[i]])

    def scripted_answer(self, i: int) -> dict:
        return self.messages[self.requests[i]]

    @property
    def approx_tokens(self) -> int:
        return round(text_chars(self.messages, self.tools) / CHARS_PER_TOKEN)

    @property
    def digest(self) -> str:
        """Names the exact content: two reports with one digest replayed the same requests."""
        text = json.dumps([self.messages, self.tools, self.requests], ensure_ascii=False, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def build(name: str, scale: float = 1.0, target_tokens: int | None = None, turns: int | None = None,
          root: Path = REPO) -> Session:
    """One of SESSIONS, at its target size times `scale` (or exactly `target_tokens`)."""
    if name not in SESSIONS:
        raise ValueError(f"unknown session {name!r}: one of {', '.join(SESSIONS)}")
    kind, size = SESSIONS[name]
    target = target_tokens or max(1, round(size * scale))
    n_turns = turns or max(3, min(20, target // TURN_TOKENS))
    script = _Script(name, root, target, n_turns)
    (_agent if kind == "agent" else _edit)(script)
    return script.session()


# ---------------------------------------------------------------------------------------------------------------
# The fixed parts: instructions, tools, tasks
# ---------------------------------------------------------------------------------------------------------------
INSTRUCTIONS = """You are a coding agent working in the user's repository through tools. You read before you \
write, you make the smallest change that does the job, and you check your work by running the tests.

# How you work
- Start by understanding the request. If it names a file, read it. If it names a behaviour, search for it with \
grep and read the places that implement it before proposing anything.
- Prefer reading whole files over guessing from fragments; a file you have read in this session does not need to \
be read again unless it changed.
- Plan briefly in plain text before a series of tool calls: say which files you will look at and why.
- Make edits with edit_file when a change touches a few lines; use write_file only for new files or when most of \
a file changes. Always preserve the file's existing style, indentation and line endings.
- After an edit, run the narrowest test command that covers it. If a test fails, read the failure, fix the cause, \
and run it again. Never weaken a test to make it pass.
- Do not run commands that change state outside the repository (installing packages, pushing, deleting branches) \
unless the user asks.
- Keep the user informed: after a series of tool calls, summarise what you found or changed in a few sentences, \
with file paths and line numbers.

# Tool use
- Call one tool at a time and wait for its result.
- Paths are relative to the repository root.
- run_command runs in a shell at the repository root with a 120 s timeout; long-running servers must not be \
started with it.
- grep takes a regular expression (Python syntax) and an optional glob of files; it prints path:line:text.
- read_file prints the file with line numbers; use offset and limit for large files.
- edit_file replaces old_string with new_string exactly once; old_string must match the file byte for byte, \
including indentation, and must be unique in the file.

# Code style
- Match the surrounding code. Names say what a thing is. Comments explain the non-obvious, not the obvious.
- Errors meant for users name the fix. Library code never prints or prompts; the command-line layer does.
- New behaviour comes with a test that could fail; tests are named after the property they check.

# Answers
- Be concise. Lead with the answer, then the evidence. Quote code only when it helps.
- When you are not sure, say what you checked and what you did not.
"""

TASKS = [
    "The server sometimes re-processes the whole prompt on a follow-up turn. Find where a request's prompt is "
    "matched against the cached tokens, and explain when the cache is reused and when it is not.",
    "Now look at how draft tokens are verified and rolled back, and tell me whether a rollback can ever happen "
    "twice for one step.",
    "Check how the chat template is rendered for tool calls, and whether earlier assistant turns are re-rendered "
    "differently on the next request.",
    "Find every place the context size is checked before a request runs, and list them with line numbers.",
    "Summarise what you found, and propose the smallest change that would keep the cache across turns.",
]

EDIT_TASK = ("Tidy these modules: add a short comment above the main entry points explaining their contract, keep "
             "everything else as it is, and run the tests after each file.")

GIT_SUBJECTS = [
    "server: keep the slot's cache when the next prompt extends it", "engine: one rollback per step, in keep()",
    "chat template: render tool calls as the model's template does", "bounds: check the context before prefill",
    "policy: learn draft length from measured pass times", "tests: name the reuse invariants",
    "slots: route a request to the slot sharing the longest prefix", "README: how to point an agent at serve",
    "mtp: resume the head's cache after a checkpoint restore", "server: stream tool calls whole at the end",
    "gguf: read the head count from the file, not the name", "cli: one line per user error",
    "batch: verify every slot's draft in one target pass", "metrics: count reused prompt tokens",
    "sampling: top-k before top-p, temperature last", "check: say what fits on a 24 GB card",
    "rollback: checkpoints of the recurrent state every turn", "loading: refuse a vocabulary mismatch early",
    "shaping: drop drafts below p_min", "server: 429 when the queue is full",
]


def tool_schemas() -> list[dict]:
    def tool(name, description, properties, required):
        return {"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": required}}}

    path = {"type": "string", "description": "Path relative to the repository root."}
    return [
        tool("read_file", "Read a file and print it with line numbers.",
             {"path": path, "offset": {"type": "integer", "description": "First line to print (1-based)."},
              "limit": {"type": "integer", "description": "Number of lines to print."}}, ["path"]),
        tool("write_file", "Create or overwrite a file with the given content.",
             {"path": path, "content": {"type": "string", "description": "The whole new content of the file."}},
             ["path", "content"]),
        tool("edit_file", "Replace one exact occurrence of old_string with new_string in a file.",
             {"path": path, "old_string": {"type": "string", "description": "Text to replace, matched exactly."},
              "new_string": {"type": "string", "description": "The replacement text."}},
             ["path", "old_string", "new_string"]),
        tool("run_command", "Run a shell command at the repository root and return its output and exit code.",
             {"command": {"type": "string", "description": "The command line."},
              "timeout": {"type": "integer", "description": "Seconds before the command is stopped (max 120)."}},
             ["command"]),
        tool("grep", "Search files for a regular expression; prints path:line:text for each match.",
             {"pattern": {"type": "string", "description": "A Python regular expression."},
              "glob": {"type": "string", "description": "Only files matching this glob, e.g. '**/*.py'."}},
             ["pattern"]),
        tool("list_dir", "List a directory's entries with their sizes.", {"path": path}, ["path"]),
        tool("glob", "Find files by a glob pattern, e.g. 'tests/**/test_*.py'.",
             {"pattern": {"type": "string", "description": "The glob pattern."}}, ["pattern"]),
        tool("git_diff", "Show the uncommitted changes, optionally for one path.", {"path": path}, []),
        tool("todo_write", "Replace the task list shown to the user.",
             {"items": {"type": "array", "items": {"type": "object", "properties": {
                 "text": {"type": "string"}, "done": {"type": "boolean"}}}, "description": "The tasks in order."}},
             ["items"]),
        tool("ask_user", "Ask the user a question and wait for the answer.",
             {"question": {"type": "string", "description": "One clear question."}}, ["question"]),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Building a session
# ---------------------------------------------------------------------------------------------------------------
class _Script:
    """A session being written: a character budget for the whole, split evenly over the turns' tool results."""

    def __init__(self, name: str, root: Path, target_tokens: int, n_turns: int):
        self.name, self.root, self.n_turns = name, root, n_turns
        self.tools = tool_schemas()
        self.budget = target_tokens * CHARS_PER_TOKEN
        system_chars = min(SYSTEM_TOKENS * CHARS_PER_TOKEN, self.budget / 4)
        self.messages: list[dict] = [{"role": "system", "content": system_prompt(root, system_chars)}]
        self.requests: list[int] = []

    @property
    def chars(self) -> int:
        return text_chars(self.messages, self.tools)

    @property
    def turn_chars(self) -> int:
        """A tool result's share: what is left of the budget over the turns left (a short result leaves more)."""
        left = max(1, self.n_turns - len(self.requests))
        return max(400, int((self.budget - self.chars) / left) - 150)

    @property
    def done(self) -> bool:
        return len(self.requests) >= self.n_turns or self.chars >= self.budget

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def call(self, text: str, name: str, arguments: dict, result: str) -> None:
        """A request, its scripted answer (`text` and one tool call), and the tool's result."""
        call_id = f"call_{len(self.requests):04d}"
        self.requests.append(len(self.messages))
        self.messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})

    def session(self) -> Session:
        """Closed with a last request whose scripted answer is a plain summary."""
        self.requests.append(len(self.messages))
        self.messages.append({"role": "assistant", "content": "I have what I need. In short: the files above hold "
                              "the logic in question; the details and the proposed change follow."})
        return Session(self.name, tuple(self.messages), tuple(self.tools), tuple(self.requests))

    def read(self, rel: str) -> str:
        return _plain((self.root / rel).read_text(errors="replace"))


def text_chars(messages, tools) -> int:
    """The characters a chat template renders, near enough: every content and tool-call argument, the schemas."""
    size = len(json.dumps(list(tools), ensure_ascii=False))
    for m in messages:
        size += len(m.get("content") or "") + 20
        size += sum(len(c["function"]["arguments"]) + 40 for c in m.get("tool_calls", ()))
    return size


def system_prompt(root: Path, chars: float) -> str:
    """The instructions, then the project's README as project notes, cut at a paragraph to `chars` in all."""
    text = INSTRUCTIONS + "\n# Project notes (README.md)\n\n"
    readme = _plain((root / "README.md").read_text(errors="replace")) if (root / "README.md").is_file() else ""
    room = int(chars) - len(text)
    if room <= 0:
        return INSTRUCTIONS[:int(chars)].rsplit("\n", 1)[0] + "\n"
    cut = readme[:room]
    return text + (cut.rsplit("\n\n", 1)[0] if "\n\n" in cut else cut) + "\n"


def numbered(text: str, limit_chars: int) -> tuple[str, bool]:
    """A file as read_file prints it (`cat -n` style), cut at a line to `limit_chars`; whether it was cut."""
    out, size = [], 0
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        row = f"{i:6d}\t{line}"
        if size + len(row) + 1 > limit_chars and out:
            out.append(f"... ({len(lines) - i + 1} more lines; use offset={i} to read on)")
            return "\n".join(out), True
        out.append(row)
        size += len(row) + 1
    return "\n".join(out), False


def source_files(root: Path, folder: str = "llamaspec") -> list[str]:
    """The package's Python files, in a fixed order: the core first, then each subpackage, by name (no
    __init__.py)."""
    files = sorted((p.relative_to(root).as_posix() for p in (root / folder).rglob("*.py")),
                   key=lambda rel: (rel.count("/"), rel))
    return [f for f in files if not f.endswith("__init__.py")]


def list_dir(root: Path, rel: str) -> str:
    rows = []
    for p in sorted((root / rel).iterdir()):
        if p.name.startswith(".") or p.name == "__pycache__":
            continue
        rows.append(f"{p.name}/" if p.is_dir() else f"{p.name}  ({p.stat().st_size} bytes)")
    return "\n".join(rows)


def grep(root: Path, pattern: str, files: list[str], limit_chars: int) -> str:
    regex, out, size = re.compile(pattern), [], 0
    for rel in files:
        for i, line in enumerate(_plain((root / rel).read_text(errors="replace")).splitlines(), 1):
            if regex.search(line):
                row = f"{rel}:{i}:{line.strip()}"
                if size + len(row) > limit_chars:
                    return "\n".join(out + ["... (more matches; narrow the pattern)"])
                out.append(row)
                size += len(row) + 1
    return "\n".join(out) or "(no matches)"


def pytest_output(root: Path, test_file: str) -> str:
    """A scripted `pytest -v` run of one test file: its real test names, all passing, a made-up duration."""
    path = root / test_file
    names = re.findall(r"^def (test_\w+)", path.read_text(errors="replace"), re.M) if path.is_file() else []
    names = names or ["test_smoke"]
    rows = [f"$ python -m pytest -v {test_file}", "============================= test session starts "
            "==============================", f"collected {len(names)} items", ""]
    for i, name in enumerate(names, 1):
        rows.append(f"{test_file}::{name} PASSED".ljust(72) + f"[{100 * i // len(names):3d}%]")
    rows += ["", f"============================== {len(names)} passed in {0.37 * len(names):.2f}s "
             "=============================="]
    return "\n".join(rows)


def git_log(start: int, n: int = 20) -> str:
    rows = []
    for i in range(n):
        subject = GIT_SUBJECTS[(start + i) % len(GIT_SUBJECTS)]
        rows.append(hashlib.sha1(f"{start + i}:{subject}".encode()).hexdigest()[:7] + " " + subject)
    return "$ git log --oneline -n 20\n" + "\n".join(rows)


def test_file_for(root: Path, rel: str) -> str:
    """The test file that most likely covers a source file (tests/test_<stem>.py), else the first one."""
    guess = f"tests/test_{Path(rel).stem}.py"
    if (root / guess).is_file():
        return guess
    tests = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py"))
    return tests[0] if tests else guess


# what an agent on the tasks above reads first (files that exist; the rest follow in source_files' order)

def _plain(text: str) -> str:
    """A source file as a tool result, with chat-template control markup ("<|im_start|>" in this repository's
    template code) spaced apart, so that every server reads the same plain text and none refuses or parses it."""
    return text.replace("<|", "< |")

FIRST_READS = ["llamaspec/server/worker.py", "llamaspec/slots.py", "llamaspec/server/prompt.py", "llamaspec/engine.py",
               "llamaspec/backend/rollback.py", "llamaspec/chat_template.py", "llamaspec/server/tools.py",
               "llamaspec/bounds.py"]
GREPS = [r"def \w*cache\w*\(", r"n_past|keep\(", r"checkpoint", r"n_ctx", r"tool_call", r"raise \w+Error\("]


def _agent(s: _Script) -> None:
    """Read, search and run: mostly read_file, with grep, list_dir, a test run and a git log between."""
    files = source_files(s.root)
    first = [f for f in FIRST_READS if f in files]
    code = first + sorted((f for f in files if f not in first), key=lambda f: -(s.root / f).stat().st_size)
    last_read = code[0]
    step = 0
    while not s.done:
        turn = len(s.requests)
        if turn % 6 == 0:
            s.user(TASKS[(turn // 6) % len(TASKS)])
        kind = ("list", "read", "read", "grep", "read", "test", "read", "read", "git", "read")[step % 10]
        step += 1
        if kind == "list":
            folder = ("llamaspec", "llamaspec/server", "llamaspec/backend", "tests")[(step // 10) % 4]
            s.call(f"Let me look at what is in {folder} first.", "list_dir", {"path": folder},
                   list_dir(s.root, folder))
        elif kind == "grep":
            pattern = GREPS[(step // 10) % len(GREPS)]
            s.call(f"I'll search for `{pattern}` to find every place this is handled.", "grep",
                   {"pattern": pattern, "glob": "llamaspec/**/*.py"}, grep(s.root, pattern, files, s.turn_chars))
        elif kind == "test":
            test = test_file_for(s.root, last_read)
            s.call("Before going further, let me confirm the current tests pass.", "run_command",
                   {"command": f"python -m pytest -v {test}"}, pytest_output(s.root, test))
        elif kind == "git":
            s.call("Let me check the recent history of these files.", "run_command",
                   {"command": "git log --oneline -n 20"}, git_log(step))
        else:
            rel = last_read = code.pop(0) if code else files[step % len(files)]
            body, cut = numbered(s.read(rel), s.turn_chars)
            s.call(f"Now I'll read {rel} to see how it works.", "read_file",
                   {"path": rel, "limit": 2000} if cut else {"path": rel}, body)


def edited(text: str, note: str) -> str:
    """The file with two comment lines added above its first two top-level definitions past the first third, the
    rest byte for byte (a rewrite that carries most of the file)."""
    lines = text.splitlines(keepends=True)
    spots = [i for i, line in enumerate(lines) if i >= len(lines) // 3 and re.match(r"(def|class) ", line)][:2]
    for n, i in reversed(list(enumerate(spots, 1))):
        lines.insert(i, f"# {note} (entry point {n})\n")
    if not spots:
        lines.append(f"# {note}\n")
    return "".join(lines)


def _edit(s: _Script) -> None:
    """For one file after another: read it, rewrite it whole, run its tests, then one small edit."""
    s.user(EDIT_TASK)
    # files that fit a read plus a rewrite in about two turns' share each, largest first
    share = s.turn_chars * 2 * 0.8
    files = [f for f in source_files(s.root) if 1500 <= (s.root / f).stat().st_size <= share]
    files.sort(key=lambda f: (-(s.root / f).stat().st_size, f))
    files = files or source_files(s.root)[:1]
    i = 0
    while not s.done:
        rel = files[i % len(files)]
        text = s.read(rel)[:int(share)]
        note = f"contract: see the module docstring; revision {i + 1}"
        new_text = edited(text, note)
        body, _ = numbered(text, len(text) * 2)
        s.call(f"Reading {rel} before changing it.", "read_file", {"path": rel}, body)
        if s.done:
            break
        s.call(f"I'll rewrite {rel} with the two comments added and the rest unchanged.", "write_file",
               {"path": rel, "content": new_text}, f"Wrote {len(new_text.encode())} bytes to {rel}")
        if s.done:
            break
        test = test_file_for(s.root, rel)
        s.call("Running its tests.", "run_command", {"command": f"python -m pytest -v {test}"},
               pytest_output(s.root, test))
        if s.done:
            break
        old = next(line for line in new_text.splitlines() if line.startswith(f"# {note}"))
        s.call("One wording fix in the comment I added.", "edit_file",
               {"path": rel, "old_string": old, "new_string": old.replace("contract: see", "contract: read")},
               f"Replaced 1 occurrence in {rel}")
        i += 1
