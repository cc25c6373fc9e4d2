"""llama-server's per-response `timings` object, from a request's GenerationStats, with llama-server's field names
and meaning (tools/server: server_slot_stats::to_json), plus llamaspec's own speculation figures.

llama-server's meaning: `prompt_*` covers prompt processing up to the first generated token (`cache_n` prompt
tokens were reused, `prompt_n` were processed); `predicted_*` covers the generation after it, so the per-token
figures divide by predicted_n - 1 (the first token comes with the prompt); `draft_n` / `draft_n_accepted`
appear only when something was drafted. Knows nothing about HTTP.
"""
from __future__ import annotations


def timings(stats) -> dict:
    prompt_n = stats.prompt_tokens - stats.prompt_tokens_cached
    prompt_s = stats.time_to_first_token if stats.tokens_generated else stats.time_total
    steps = max(stats.tokens_generated - 1, 0)
    predicted_s = max(stats.time_total - prompt_s, 0.0) if steps else 0.0
    out = {
        "cache_n": stats.prompt_tokens_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": stats.tokens_generated,
        "predicted_ms": predicted_s * 1e3,
        "predicted_per_token_ms": predicted_s * 1e3 / steps if steps else 0.0,
        "predicted_per_second": steps / predicted_s if predicted_s > 0 else 0.0,
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
