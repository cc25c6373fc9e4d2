"""Built-in prompt sets for `llamaspec bench`, and the JSONL prompt-file reader.

Each set stresses speculation differently: `code` (boilerplate-heavy, drafts agree often), `prose` (open-ended,
drafts agree less), `grounded` (the answer copies from the input: rewriting, reformatting, quoting; the easiest
case for a draft and for prompt lookup). Prompts are user messages; the bench applies the chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import PromptFileError

CODE = (
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and punctuation, with a docstring "
    "and three doctest examples.",
    "Implement binary search in C over a sorted array of ints. Return the index or -1. Include a small main() "
    "that tests it.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` in O(1) using OrderedDict, with type "
    "hints.",
    "Write a bash script that finds all files larger than 100 MB under a directory given as the first argument "
    "and prints them sorted by size.",
    "Write a SQL query that returns the ten customers with the highest total order amount in 2023, from tables "
    "customers(id, name) and orders(id, customer_id, amount, created_at).",
    "Write a JavaScript function `debounce(fn, ms)` and show how to use it on a window resize handler.",
    "Write a Rust function that reads a text file and counts how often each word occurs, returning a "
    "HashMap<String, usize>.",
    "Write pytest tests for a function `slugify(title: str) -> str` that lowercases, trims, and joins words "
    "with hyphens.",
)

PROSE = (
    "Write a short story (about 150 words) about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a twelve-year-old why the sky is blue.",
    "Write a persuasive paragraph on why cities should plant more trees.",
    "Describe a walk through a busy market in the early morning, using all five senses.",
    "What are the trade-offs between renting and buying a home? Answer in a few paragraphs.",
    "Write a friendly email inviting colleagues to a farewell lunch for a teammate.",
    "Summarise the causes of the French Revolution in one paragraph.",
    "Write a product description for a handmade ceramic coffee mug.",
)

_PY_SNIPPET = '''def total(items):
    t = 0
    for i in range(len(items)):
        if items[i]["qty"] > 0:
            t = t + items[i]["price"] * items[i]["qty"]
    return t'''

_JSON_SNIPPET = ('{"name":"llamaspec","version":"0.1.0","authors":[{"name":"Ada","email":"ada@example.org"},'
                 '{"name":"Linus","email":"linus@example.org"}],"license":"MIT","keywords":["llm","gguf",'
                 '"speculative decoding"],"dependencies":{"numpy":">=1.24","click":">=8.1"}}')

_ARTICLE = ("The city council voted on Tuesday to extend the riverside cycle path by four kilometres. "
            "\"This is the most requested project in our survey,\" said councillor Maria Lopez, adding that "
            "construction would start in spring. Opponents argued the budget of 2.3 million euros should go to "
            "road repairs instead. \"Potholes hurt cyclists too,\" said resident Tom Berg. The path is expected "
            "to open in late autumn next year.")

_CSV_SNIPPET = "name,age,city\nAlice,34,Berlin\nBob,29,Madrid\nChen,41,Toronto\nDana,25,Nairobi"

GROUNDED = (
    f"Rewrite this Python code with type hints and a docstring, keeping the logic:\n\n{_PY_SNIPPET}",
    f"Rewrite this Python code to use a generator expression and sum():\n\n{_PY_SNIPPET}",
    f"Reformat this JSON with two-space indentation. Output only the JSON:\n\n{_JSON_SNIPPET}",
    f"Convert this JSON to YAML. Output only the YAML:\n\n{_JSON_SNIPPET}",
    f"Summarise this article in three sentences, quoting both people exactly:\n\n{_ARTICLE}",
    f"List every number mentioned in this article with the sentence it appears in:\n\n{_ARTICLE}",
    f"Convert this CSV to a Markdown table:\n\n{_CSV_SNIPPET}",
    f"Rename the variable `t` to `amount` and `i` to `index` in this code; output the whole code:\n\n{_PY_SNIPPET}",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {"code": CODE, "prose": PROSE, "grounded": GROUNDED}


def load_prompts(spec: str) -> list[str]:
    """A built-in set name, `all`, or a JSONL file with one {"prompt": ...} object per line."""
    if spec == "all":
        return [p for prompts in PROMPT_SETS.values() for p in prompts]
    if spec in PROMPT_SETS:
        return list(PROMPT_SETS[spec])
    return read_prompt_file(Path(spec))


def read_prompt_file(path: Path) -> list[str]:
    if not path.exists():
        raise PromptFileError(f"{path}: no such prompt file (built-in sets: {', '.join(PROMPT_SETS)}, all)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read prompt file ({getattr(e, 'strerror', None) or e})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise PromptFileError(f'{path}:{number}: expected an object like {{"prompt": "..."}}')
        prompts.append(record["prompt"])
    if not prompts:
        raise PromptFileError(f"{path}: no prompts in file")
    return prompts
