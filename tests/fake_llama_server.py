"""A stand-in for llama.cpp's `llama-server`, for tests/test_bench_llama_cpp.py.

Takes llama-server's command line (records it, every start's in order too, and its OMP_* environment), answers GET /health with 503 "Loading model" a
few times and then 200 {"status": "ok"}, as the real one does while it loads a model, and POST
/completion with a token-id prompt: `n_predict` tokens (prompt[-1] + 1, + 2, ...), non-streamed
as one JSON object, streamed as one server-sent event per token and a final `stop: true` event,
each in the shape llama-server's own answers have. Started with `--spec-type`, every final answer's
timings also count drafted and accepted tokens as llama-server's do (`draft_n`: the tokens
generated, `draft_n_accepted`: half of them). Every request body goes to a log, and the
most requests it ever had at once to a file. Only the standard library: it runs as its own
process like the real server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 32000


def tokens_for(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i + 1) % VOCAB for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spec-type", default=None)
    args, _ = ap.parse_known_args()
    out = os.environ["FAKE_LLAMA_DIR"]
    with open(os.path.join(out, "argv.json"), "w") as f:
        json.dump(sys.argv[1:], f)
    with open(os.path.join(out, "argvs.jsonl"), "a") as f:  # every start, in order
        f.write(json.dumps(sys.argv[1:]) + "\n")
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith("OMP_")}, f)
    state = {"health": int(os.environ.get("FAKE_LLAMA_LOADING", "3")), "now": 0, "most": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def _json(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
            with lock:
                loading = state["health"] > 0
                state["health"] -= 1
            if loading:
                return self._json(503, {"error": {"code": 503, "message": "Loading model",
                                                  "type": "unavailable_error"}})
            return self._json(200, {"status": "ok"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                with open(os.path.join(out, "requests.jsonl"), "a") as f:
                    f.write(json.dumps(body) + "\n")
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                with open(os.path.join(out, "most.txt"), "w") as f:
                    f.write(str(state["most"]))
            left = [False]

            def leave() -> None:
                # Before the last byte goes out: a client that sends its next request the moment
                # this answer ends must not find this one still counted (a race, not a limit broken).
                if not left[0]:
                    left[0] = True
                    with lock:
                        state["now"] -= 1

            try:
                self._complete(body, leave)
            finally:
                leave()

        def _complete(self, body: dict, leave: Callable[[], None]) -> None:
            prompt, n = body["prompt"], body["n_predict"]
            ids = tokens_for(prompt, n)
            done = {"index": 0, "id_slot": 0, "stop": True, "model": args.m, "tokens_predicted": n,
                    "tokens_evaluated": len(prompt), "stop_type": "limit", "stopping_word": "",
                    "tokens_cached": len(prompt) + n, "timings": {"predicted_n": n}}
            if args.spec_type:
                done["timings"].update(draft_n=n, draft_n_accepted=n // 2)
            if not body.get("stream"):
                leave()
                return self._json(200, {**done, "content": "", "tokens": ids})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i, t in enumerate(ids):
                event = {"index": 0, "content": "", "tokens": [t], "stop": False, "id_slot": 0,
                         "tokens_predicted": i + 1, "tokens_evaluated": len(prompt)}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            leave()
            self.wfile.write(b"data: " + json.dumps({**done, "content": "", "tokens": []}).encode() + b"\n\n")
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
