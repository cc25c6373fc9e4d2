"""Scale a session replay's per-phase seconds (session_replay.py's JSON) to an RTX 3090: decode by the memory
bandwidth ratio, prompt processing by a compute ratio (7x and 14x), the rest unchanged; plus llamaspec with the
peers' reuse on the turns it processed again. The assumptions: benchmarks/results/projection-3090-agent-session-64k.md.

    python benchmarks/probes/project_session_3090.py benchmarks/results/h200-session-replay-agent-64k.json
"""
import json
import sys

BANDWIDTH = 4.8e12 / 936e9          # H200 HBM3e / RTX 3090 GDDR6X
COMPUTE = (7, 14)                   # int8 dense peaks; fp16 with fp32 accumulation


def phases(turns, wall, prompt_s=None):
    prompt = sum(t["prompt_s"] for t in turns) if prompt_s is None else prompt_s
    decode = sum(t["completion_tokens"] / t["decode_tps"] for t in turns)
    return prompt, decode, wall - sum(t["prompt_s"] for t in turns) - decode


def main(path: str) -> None:
    runs = {r["server"]: r for r in json.load(open(path))["runs"]}
    mine, peer = runs["llamaspec"]["turns"], runs["llama-server"]["turns"]
    rows = [(name, phases(r["turns"], r["summary"]["wall_s"])) for name, r in runs.items()]
    again = [i for i, (a, b) in enumerate(zip(mine, peer)) if a["processed"] > 1.2 * b["processed"] + 100]
    prompt = sum(peer[i]["processed"] * t["prompt_s"] / t["processed"] if i in again else t["prompt_s"]
                 for i, t in enumerate(mine))
    rows.append((f"llamaspec with the peer's reuse on turns {again}",
                 phases(mine, runs["llamaspec"]["summary"]["wall_s"], prompt)))
    print("| server | H200 prompt / decode / other / wall s | " + " | ".join(f"3090 pp x{c} wall s" for c in COMPUTE) + " |")
    for name, (p, d, o) in rows:
        print(f"| {name} | {p:.1f} / {d:.1f} / {o:.1f} / {p + d + o:.1f} | "
              + " | ".join(f"{p * c + d * BANDWIDTH + o:.0f}" for c in COMPUTE) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
