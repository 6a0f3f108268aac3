"""On a GPU: the server's greedy answers equal ``SpeculativeGenerator.generate`` of each request alone, in
float32 with CUDA graphs, for 16 concurrent clients (the default model and its shipped head).

    python3 eval/device/serve_check.py [--clients 16] [--max-tokens 64]

Starts ``fsd-eagle serve --device cuda --dtype float32`` on a free port, sends the clients' chat requests at
once (MT-bench first turns), then loads the same model in this process and compares each text with its
request decoded alone; prints one JSON line and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.serve import Server, chat_body, free_port  # noqa: E402
from eval.tasks import load_mt_bench  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    port = free_port()
    server = Server("fsd-eagle", [sys.executable, "-m", "fsd_eagle.cli", "serve", "--port", str(port), "--device",
                                  "cuda", "--dtype", "float32", "--max-batch", str(args.clients), "--quiet"], port, None)
    texts = [q.turns[0] for q in load_mt_bench(args.clients)]
    answers: dict[int, str] = {}
    server.start(Path("/tmp/serve_check.log"), 600)
    try:
        def ask(i: int) -> None:
            import http.client

            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(None, texts[i], args.max_tokens,
                                                                               stream=False)),
                         {"Content-Type": "application/json"})
            answers[i] = json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        server.stop()
    from fsd_eagle.api import SpeculativeGenerator

    gen = SpeculativeGenerator.load(device="cuda", dtype="float32")
    alone = [gen.generate([{"role": "user", "content": t}], args.max_tokens).text for t in texts]
    same = [answers.get(i) == alone[i] for i in range(len(texts))]
    print(json.dumps({"clients": len(texts), "identical": sum(same), "max_tokens": args.max_tokens,
                      "start_s": round(server.started_s, 1)}))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
