"""A bounded load test of `llamaspec serve` on loopback: a fixed number of requests within a time limit, all
answered, and the server's resident memory flat once warm (a leak per request would show as steady growth)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from support.servers import HTTP, start_server  # noqa: E402

N_SEQUENTIAL = 200
N_CLIENTS = 8
PER_CLIENT = 4
WARMUP = 10
TIME_LIMIT_S = 120.0   # a guard against hangs: the whole test takes about 5 s on a busy 2-core machine
RSS_GROWTH_LIMIT_KIB = 16 * 1024   # after warm-up; one leaked response per request would be far more


def ask(http: httpx.Client, url: str, i: int) -> int:
    """One small request; alternates endpoints and streaming so every response path is exercised."""
    if i % 2:
        body = {"messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 4, "temperature": 0,
                "stream": i % 4 == 1}
        r = http.post(f"{url}/v1/chat/completions", json=body)
    else:
        body = {"prompt": f"request number {i}:", "max_tokens": 4, "temperature": 0.7, "seed": i,
                "stream": i % 4 == 2}
        r = http.post(f"{url}/v1/completions", json=body)
    if r.status_code == 200 and body["stream"]:
        assert r.text.rstrip().endswith("data: [DONE]")
    return r.status_code


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = start_server(tiny_models, tmp_path_factory.mktemp("srv-load") / "server.log", "--max-queue",
                       str(N_CLIENTS), n_ctx=512)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_sequential_and_concurrent_requests_are_all_answered_with_flat_memory(server):
    start = time.monotonic()
    with httpx.Client(timeout=60) as http:
        assert all(ask(http, server.url, i) == 200 for i in range(WARMUP))
        rss_warm = server.rss_kib()

        statuses = [ask(http, server.url, i) for i in range(N_SEQUENTIAL)]
        rss_sequential = server.rss_kib()
    sequential_s = time.monotonic() - start

    def client(c: int) -> list[int]:
        with httpx.Client(timeout=60) as http:
            return [ask(http, server.url, 1000 + c * PER_CLIENT + j) for j in range(PER_CLIENT)]

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        concurrent = [s for result in pool.map(client, range(N_CLIENTS)) for s in result]
    rss_end = server.rss_kib()
    elapsed = time.monotonic() - start

    metrics = HTTP.get(f"{server.url}/metrics").text
    growth = rss_end - rss_warm
    print(f"\nload: {N_SEQUENTIAL} sequential in {sequential_s:.1f}s, {N_CLIENTS}x{PER_CLIENT} concurrent, "
          f"{elapsed:.1f}s total; RSS warm {rss_warm} KiB, after sequential {rss_sequential} KiB, "
          f"end {rss_end} KiB (growth {growth} KiB)")
    assert statuses == [200] * N_SEQUENTIAL
    assert concurrent == [200] * (N_CLIENTS * PER_CLIENT)
    assert elapsed < TIME_LIMIT_S
    assert growth < RSS_GROWTH_LIMIT_KIB, f"server RSS grew {growth} KiB over {N_SEQUENTIAL + len(concurrent)} requests"
    total = WARMUP + N_SEQUENTIAL + N_CLIENTS * PER_CLIENT
    answered = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("llamaspec_requests_total{endpoint=\"/v1/") and 'status="200"' in line)
    assert answered == total
    assert "llamaspec_queue_depth 0" in metrics
