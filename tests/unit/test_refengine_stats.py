"""The reference engine's /get_server_info counters, which bench/pipeline.py reads to tell an
idle engine from a slow one: requests, prompt tokens prefilled and seconds spent computing."""

from __future__ import annotations

import threading
import time

import httpx

from harvest.engines.reference import ReferenceEngine, serve


def test_server_info_counts_requests_tokens_and_busy_time(tiny_model, tmp_path):
    engine = ReferenceEngine(tiny_model, str(tmp_path / "dump"), layers="2,4,8")
    server = serve(engine, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    http = httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}", timeout=60)
    try:
        info = http.get("/get_server_info").json()
        assert (info["requests"], info["prefill_tokens"], info["busy_seconds"]) == (0, 0, 0.0)
        assert info["capture_points"] == [2, 4, 8] and info["threads"] >= 1
        body = {
            "input_ids": [[5, 6, 7, 8, 9], [5, 6, 7]],
            "rid": ["warm-0", "warm-1"],
            "sampling_params": {"max_new_tokens": 1},
        }
        t0 = time.perf_counter()
        assert http.post("/generate", json=body).status_code == 200
        wall = time.perf_counter() - t0
        info = http.get("/get_server_info").json()
        assert (info["requests"], info["prefill_tokens"]) == (2, 8)
        assert 0 < info["busy_seconds"] <= wall  # the forward is inside the request, never longer
        assert http.post("/generate", json={"input_ids": [1, 2]}).status_code == 200
        assert http.get("/get_server_info").json()["prefill_tokens"] == 10
    finally:
        http.close()
        server.shutdown()
        server.server_close()
