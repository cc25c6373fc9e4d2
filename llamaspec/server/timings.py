"""llama-server's per-response `timings` object, from a request's GenerationStats, with llama-server's field names
and meaning (tools/server: server_slot_stats::to_json), plus llamaspec's own speculation figures.

llama-server's meaning: `prompt_*` covers prompt processing (`cache_n` prompt tokens were reused, `prompt_n` were
not), `predicted_*` the generation after it: predicted_n tokens over predicted_ms. Where llamaspec differs in
how, not what: its prefill decodes the prompt but its last token, which the first verification decodes together
with the first draft, as a plain step decodes it for the first token. So `prompt_ms` is the prefill and its rates
count the tokens the prefill decoded; `predicted_ms` runs from the end of the prefill to the last token and holds
every generated token's work, the first step's included, so a reply that ends in its first step reports that
step's rate, not one from the instant between its last token and the reply's end. A rate is 0 where nothing was
decoded in its span. `draft_n` / `draft_n_accepted` appear only when something was drafted and stop where the
reply stopped (GenerationStats.end_reply). Knows nothing about HTTP.
"""
from __future__ import annotations


def timings(stats) -> dict:
    prompt_n = stats.prompt_tokens - stats.prompt_tokens_cached
    prefilled = max(prompt_n - 1, 0)   # the last prompt token is decoded by the first verification
    prefill_done = stats.time_prefill > 0 or stats.tokens_generated > 0
    prompt_s = stats.time_prefill if prefill_done else stats.time_total
    predicted_n = stats.tokens_generated
    predicted_s = max(stats.time_total - stats.time_prefill, 0.0) if predicted_n else 0.0
    out = {
        "cache_n": stats.prompt_tokens_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / prefilled if prefilled and prefill_done else 0.0,
        "prompt_per_second": prefilled / prompt_s if prefilled and prefill_done and prompt_s > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_s * 1e3,
        "predicted_per_token_ms": predicted_s * 1e3 / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0,
    }
    if stats.drafted:
        out["draft_n"] = stats.drafted
        out["draft_n_accepted"] = stats.accepted
    # llamaspec's own
    out["draft_acceptance"] = stats.acceptance_rate
    out["tokens_per_pass"] = stats.mean_accepted_length
    out["target_passes"] = stats.target_passes
    out["policy"] = stats.policy
    return out
