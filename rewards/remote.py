"""Remote scoring: run a reward in its own process (its own environment if need be) behind a small HTTP API.

Server (``flowrl serve-reward NAME [--args JSON] [--host 127.0.0.1] [--port 8765]``):
- ``GET /health`` -> ``{"reward": NAME}``;
- ``POST /score`` with a safetensors body: tensor ``images`` ((N, 3, H, W) or videos (N, F, 3, H, W), float in
  [0, 1]) and metadata ``prompts`` / ``metadata`` (JSON lists) -> ``{"scores": [...]}`` (NaN as null), or
  ``{"error": "..."}`` with status 400 / 500.

Client: the ``remote`` reward (``args: {url: http://127.0.0.1:8765, timeout: 60, retries: 3}``) sends the same
body, retries connection failures and timeouts with a growing pause, and then fails with one line naming the
URL and how to start the server; a reward error on the server is reported, not retried.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from flowrl.errors import RewardError, RewardServerError

from .registry import build_reward


def encode_request(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> bytes:
    from safetensors.torch import save

    meta = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(metadata or [{} for _ in prompts])}
    return save({"images": images.detach().float().cpu().contiguous()}, metadata=meta)


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    from safetensors.torch import load

    images = load(body)["images"]
    # the header (its first 8 bytes give its length) carries prompts and metadata as JSON strings
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + n])
    meta = header.get("__metadata__", {})
    return images, json.loads(meta.get("prompts", "[]")), json.loads(meta.get("metadata", "[]"))


PIXEL_SLACK = 1e-3  # pixel values may stray this far outside [0, 1] (rounding in a client's conversion)


def _request_problem(images: torch.Tensor, prompts, metadata) -> str | None:
    """Why a decoded request cannot be scored (its shape, its pixel range, its prompt and metadata counts)."""
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        return f"images of shape {tuple(images.shape)}: send (N, 3, H, W) images or (N, F, 3, H, W) videos"
    if images.numel() == 0:
        return f"images of shape {tuple(images.shape)} hold no pixels: send at least one image of at least 1 x 1"
    low, high = float(images.min()), float(images.max())
    if low < -PIXEL_SLACK or high > 1 + PIXEL_SLACK:
        return f"pixel values span {low:.4g}..{high:.4g}: send images in [0, 1]"
    if not isinstance(prompts, list) or len(prompts) != images.shape[0]:
        n = len(prompts) if isinstance(prompts, list) else type(prompts).__name__
        return f"{images.shape[0]} images and {n} prompts: send one prompt per image"
    if not isinstance(metadata, list) or len(metadata) not in (0, images.shape[0]):
        n = len(metadata) if isinstance(metadata, list) else type(metadata).__name__
        return f"{images.shape[0]} images and {n} metadata entries: send one per image, or none"
    return None


MAX_BODY_MB = 64  # a request carries a batch of images: 64 MiB is 2,000 512 px images in fp16
READ_TIMEOUT_S = 30.0  # a client that claims more bytes than it sends is cut off after this


def make_server(name: str, args: dict | None = None, host: str = "127.0.0.1", port: int = 8765,
                scorer=None, max_body_mb: float = MAX_BODY_MB, timeout: float = READ_TIMEOUT_S) -> ThreadingHTTPServer:
    """A ready (not yet serving) HTTP server around reward ``name``; ``port=0`` picks a free port. Requests are
    bounded: a body over ``max_body_mb`` or a Content-Length that is missing, negative or not a number gets a
    4xx at once, and a client that stalls mid-body is dropped after ``timeout`` seconds."""
    scorer = scorer or build_reward(name, **(args or {}))
    limit = int(max_body_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: a stalled client holds one thread, briefly

        def setup(self):
            super().setup()
            self.connection.settimeout(timeout)
        def _reply(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # http.server dispatches on these method names
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"reward": name})
            else:
                self._reply(404, {"error": f"unknown path {self.path}; use GET /health or POST /score"})

        def do_POST(self):
            if self.path.rstrip("/") != "/score":
                self._reply(404, {"error": f"unknown path {self.path}; use POST /score"})
                return
            try:
                size = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(411, {"error": "send a Content-Length header with the body size in bytes"})
                return
            if size < 0:
                self._reply(400, {"error": f"Content-Length {size} is negative"})
                return
            if size > limit:
                self._reply(413, {"error": f"body of {size} bytes is over the server's {limit} byte limit "
                                           "(serve-reward --max-mb); send smaller batches"})
                return
            try:
                body = self.rfile.read(size)
            except OSError:  # timed out: the client sent less than it announced
                self.close_connection = True
                return
            if len(body) < size:
                self._reply(400, {"error": f"body ended after {len(body)} of {size} bytes"})
                return
            try:
                images, prompts, metadata = decode_request(body)
            except Exception as exc:
                self._reply(400, {"error": f"bad request body ({exc}); send safetensors with an 'images' tensor"})
                return
            if not images.is_floating_point() or not bool(torch.isfinite(images).all()):
                bad = "are not floating point" if not images.is_floating_point() else \
                    f"hold {int((~torch.isfinite(images)).sum())} NaN or inf values"
                self._reply(400, {"error": f"the images {bad}; send finite pixel values in [0, 1]"})
                return
            problem = _request_problem(images, prompts, metadata)
            if problem:
                self._reply(400, {"error": problem})
                return
            metadata = metadata or [{} for _ in prompts]
            try:
                scores = torch.as_tensor(scorer(images, prompts, metadata), dtype=torch.float64).flatten().tolist()
            except Exception as exc:
                self._reply(500, {"error": f"reward {name!r} failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"})
                return
            self._reply(200, {"scores": [s if math.isfinite(s) else None for s in scores]})

        def log_message(self, fmt, *a):  # quiet: one line per request would flood the trainer's terminal
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        why = "the port is in use" if exc.errno in (98, 48) else exc.strerror or str(exc)
        raise RewardServerError(f"cannot serve on {host}:{port}: {why}; choose another --port (0 picks a free "
                                "one) or stop the process holding it") from exc
    server.daemon_threads = True
    return server


def serve(name: str, args: dict | None = None, host: str = "127.0.0.1", port: int = 8765,
          max_body_mb: float = MAX_BODY_MB) -> None:
    server = make_server(name, args, host, port, max_body_mb=max_body_mb)
    print(f"serving reward {name!r} on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class RemoteReward:
    def __init__(self, url: str = "http://127.0.0.1:8765", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"remote reward: url {url!r} must start with http:// or https://")
        if retries < 1 or timeout <= 0:
            raise RewardError("remote reward: retries must be >= 1 and timeout > 0")
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff

    def __call__(self, images, prompts, metadata=None):
        body = encode_request(images, prompts, metadata)
        request = urllib.request.Request(self.url + "/score", data=body, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        last = None
        for attempt in range(self.retries):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                    payload = json.loads(resp.read())
                break
            except urllib.error.HTTPError as exc:  # the server answered: its message says what is wrong
                try:
                    msg = json.loads(exc.read()).get("error", str(exc))
                except Exception:
                    msg = str(exc)
                raise RewardError(f"remote reward at {self.url}: {msg}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = getattr(exc, "reason", exc)
                if attempt + 1 < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
        else:
            raise RewardError(f"remote reward at {self.url} is not answering ({last}) after {self.retries} tries; "
                              f"start it with `flowrl serve-reward NAME --port PORT` or fix args.url")
        scores = [math.nan if s is None else float(s) for s in payload.get("scores", [])]
        return torch.tensor(scores, dtype=torch.float64)
