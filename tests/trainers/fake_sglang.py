"""A deliberately faulty SGLang-protocol server for the trainer's fault tests.

It speaks the native routes the trainer uses with random (but well-formed) completions, and
injects one fault on request: 5xx or 4xx on /generate, malformed samples, failed weight
syncs (`missing_weights`: an update from a directory that does not exist fails, as on a real
server), or death after a number of generations. It records every request it receives.

With `upstream` (a real server's URL) it is a proxy instead: every request goes to the real
server, and the fault changes what the trainer sees — `shift_logprobs` (each response token
gets the next token's log-prob: a server that garbles its output), `no_model_info` (only
`/get_model_info` and `/get_server_info`, without `weight_version`, as sglang-jax),
`no_update_route` (no `/update_weights_from_disk`), `no_weight_version` (replies without
`weight_version` / `weight_versions`).
"""

import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeSGLang:
  def __init__(
    self,
    *,
    fault: str | None = None,
    after: int = 0,
    vocab=(3, 13),
    generate_delay_s: float = 0.0,
    update_delay_s: float = 0.0,
    upstream: str | None = None,
    port: int = 0,
  ):
    self.fault, self.after, self.vocab, self.upstream = fault, after, vocab, upstream
    self.generate_delay_s, self.update_delay_s = generate_delay_s, update_delay_s
    self.events: list[tuple[str, float, float]] = []  # (route, start, end) of timed requests
    self.requests: list[tuple[str, str]] = []
    self.bodies: list[tuple[str, dict]] = []  # (route, body) of every POST
    self.generate_calls = 0
    self.weight_version = "init"
    handler = self._handler()
    self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _sample(self, rng, n_tokens, i):
    ids = [rng.randrange(*self.vocab) for _ in range(n_tokens)]
    lps = [[-rng.random() * 3, t, None] for t in ids]
    f = self.fault
    if f == "malformed_missing" and i % 2 == 0:
      return {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length", "length": n_tokens}}}
    if f == "malformed_length" and i % 2 == 0:
      lps = lps[:-1]
    if f == "malformed_null" and i % 2 == 0:
      lps[0][0] = None
    if f == "some_aborted" and i % 4 == 0:
      return {
        "text": "",
        "output_ids": [],
        "meta_info": {"finish_reason": {"type": "abort", "message": "x"}, "output_token_logprobs": []},
      }
    version = self.weight_version
    if f == "stale_versions":  # the server reports weights two versions behind the trainer's
      version = str(max(int(version) - 2, 0)) if version.isdigit() else version
    return {
      "text": "",
      "output_ids": ids,
      "meta_info": {
        "id": str(i),
        "finish_reason": {"type": "length", "length": n_tokens},
        "prompt_tokens": 5,
        "completion_tokens": n_tokens,
        "cached_tokens": 0,
        "output_token_logprobs": lps,
        "weight_version": version,
      },
    }

  def _handler(self):
    fake = self

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def _proxy(self, method, body=None):
        import httpx

        f = fake.fault
        if f == "no_model_info" and self.path in ("/model_info", "/server_info"):
          return self._reply(404, {"detail": "Not Found"})
        if f == "no_update_route" and self.path == "/update_weights_from_disk":
          return self._reply(404, {"detail": "Not Found"})
        path = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}.get(self.path, self.path)
        r = httpx.request(method, fake.upstream + path, json=body, timeout=120)
        try:
          out = r.json() if r.content else None
        except ValueError:  # a text body (/flush_cache): passed on as it is
          self.send_response(r.status_code)
          self.send_header("Content-Length", str(len(r.content)))
          self.end_headers()
          self.wfile.write(r.content)
          return
        if f == "no_model_info" and isinstance(out, dict):
          out.pop("weight_version", None)
        if self.path == "/generate" and r.status_code == 200:
          for item in out if isinstance(out, list) else [out]:
            meta = item["meta_info"]
            if f == "shift_logprobs":
              lps = meta["output_token_logprobs"]
              values = [e[0] for e in lps[1:]] + [lps[0][0]]
              meta["output_token_logprobs"] = [[v, *e[1:]] for v, e in zip(values, lps)]
            if f == "no_weight_version":
              meta.pop("weight_version", None)
              meta.pop("weight_versions", None)
        return self._reply(r.status_code, out)

      def do_GET(self):
        fake.requests.append(("GET", self.path))
        if fake.upstream:
          return self._proxy("GET")
        if self.path == "/health":
          return self._reply(200, {})
        if self.path == "/model_info":
          return self._reply(200, {"model_path": "fake", "is_generation": True, "weight_version": fake.weight_version})
        self._reply(404, {"error": {"message": "not found"}})

      def do_POST(self):
        fake.requests.append(("POST", self.path))
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        fake.bodies.append((self.path, body))
        if fake.upstream:
          return self._proxy("POST", body)
        if self.path == "/generate":
          fake.generate_calls += 1
          start = time.perf_counter()
          time.sleep(fake.generate_delay_s)
          fake.events.append(("generate", start, time.perf_counter()))
          if fake.fault == "die_after" and fake.generate_calls > fake.after:
            return self._reply(503, {"error": {"message": "server is shutting down"}})
          if fake.fault == "generate_500":
            return self._reply(500, {"error": {"message": "internal error"}})
          if fake.fault == "generate_400":
            return self._reply(400, {"error": {"message": "Unknown sampling_params key 'bogus'"}})
          # SGLang's batch normalisation: a list of sampling params is one per prompt (their n
          # must agree), a dict is shared; results are prompt-major, n per prompt.
          sps = body["sampling_params"]
          sps = sps if isinstance(sps, list) else [sps] * len(body["input_ids"])
          n = sps[0].get("n") or 1
          out = []
          for p, sp in enumerate(sps):
            rng = random.Random(sp.get("sampling_seed", 0))
            out += [fake._sample(rng, sp["max_new_tokens"], p * n + j) for j in range(n)]
          return self._reply(200, out)
        if self.path == "/update_weights_from_disk":
          if "model_path" not in body:  # SGLang's request model requires it (the trainer's route probe)
            return self._reply(400, {"error": {"message": "model_path: field required"}})
          start = time.perf_counter()
          time.sleep(fake.update_delay_s)
          fake.events.append(("update", start, time.perf_counter()))
          if fake.fault == "sync_fail" and fake.generate_calls >= fake.after:
            return self._reply(400, {"success": False, "message": "shapes mismatch"})
          if fake.fault == "missing_weights" and not os.path.isdir(body["model_path"]):  # as a real server
            return self._reply(400, {"success": False, "message": f"{body['model_path']} does not exist"})
          if fake.fault != "sync_version_stuck":
            fake.weight_version = body.get("weight_version", fake.weight_version)
          return self._reply(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        if self.path in ("/pause_generation", "/continue_generation", "/flush_cache"):
          return self._reply(200, {})
        self._reply(404, {"error": {"message": "not found"}})

    return Handler
