"""The ``vlm_judge`` reward against a chat-completions server in the test (127.0.0.1): scores parsed, malformed
answers and HTTP errors masked and counted (or failing the iteration), never scored 0, and concurrency bounded."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch


class Judge(BaseHTTPRequestHandler):
    """Answers from the image: its mean brightness (0-255) decides the score; the prompt picks a misbehaviour."""

    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()
    calls: list[str] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        text = next(c["text"] for c in content if c["type"] == "text")
        urls = [c["image_url"]["url"] for c in content if c["type"] == "image_url"]
        from PIL import Image

        shown = [np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1])))).astype(float) for u in urls]
        image = shown[0]
        with Judge.lock:
            Judge.in_flight += 1
            Judge.most_in_flight = max(Judge.most_in_flight, Judge.in_flight)
            Judge.calls.append(text)
        time.sleep(0.05)
        with Judge.lock:
            Judge.in_flight -= 1
        if "broken server" in text:
            self.send_response(500)
            self.end_headers()
            return
        if "bad request" in text:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "no such model"}')
            return
        if "yes or no" in text:
            answer = "Yes." if image.mean() > 127 else "no"
        elif "result of editing" in text:  # an edit: how far the second image is from the first
            answer = f"Score: {round(np.abs(shown[1] - shown[0]).mean() / 255 * 9) + 1}"
        elif "rambling" in text:
            answer = "It is hard to say, maybe 3 or 4 out of 10"
        else:
            answer = f"Score: {round(image.mean() / 255 * 9) + 1}"
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def server():
    Judge.in_flight = Judge.most_in_flight = 0
    Judge.calls = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def grey(level: float, n: int = 1) -> torch.Tensor:
    return torch.full((n, 3, 8, 8), level)


def test_quality_scores_are_parsed_and_scaled(server):
    from flowrl.rewards import build_reward

    judge = build_reward("vlm_judge", url=server, template="quality")
    scores = judge(torch.cat([grey(0.0), grey(1.0), grey(5 / 9)]), ["a cat"] * 3, [{}] * 3)
    assert scores.tolist() == pytest.approx([0.1, 1.0, 0.6])  # "Score: 1", "Score: 10", "Score: 6", over 10
    assert 'The prompt was: "a cat"' in Judge.calls[0]


def test_yes_no_questions_from_metadata(server):
    from flowrl.rewards import build_reward

    judge = build_reward("vlm_judge", url=server, template="yes_no")
    scores = judge(torch.cat([grey(1.0), grey(0.0)]), ["two dogs", "two dogs"],
                   [{"question": "Are there two dogs?"}, {}])
    assert scores.tolist() == [1.0, 0.0]
    assert Judge.calls[0].startswith("Are there two dogs?") or Judge.calls[1].startswith("Are there two dogs?")
    assert any(c.startswith("Does this image show two dogs?") for c in Judge.calls)


def test_failures_are_masked_and_counted_never_scored_zero(server):
    from flowrl.rewards import build_reward

    judge = build_reward("vlm_judge", url=server, template="{prompt}", retries=1)
    scores = judge(grey(0.5, 4), ["fine", "rambling", "broken server", "bad request"], [{}] * 4)
    assert scores[0].item() == pytest.approx(6.0)  # a custom template: the raw score
    assert all(math.isnan(s) for s in scores[1:].tolist()) and judge.failures == 3
    assert sum("broken server" in c for c in Judge.calls) == 2  # a 5xx is retried once; a 4xx is not
    assert sum("bad request" in c for c in Judge.calls) == 1


def test_a_failure_can_fail_the_iteration_in_one_line(server):
    from flowrl.errors import RewardError
    from flowrl.rewards import build_reward

    judge = build_reward("vlm_judge", url=server, template="{prompt}", retries=0, on_failure="fail")
    with pytest.raises(RewardError, match=r"vlm_judge: .* failed 1 times \(HTTP 500\); is the server running\?"):
        judge(grey(0.5), ["broken server"], [{}])
    dead = build_reward("vlm_judge", url="http://127.0.0.1:9/v1", retries=0, timeout=2, on_failure="fail")
    with pytest.raises(RewardError, match=r"127.0.0.1:9/v1/chat/completions failed 1 times"):
        dead(grey(0.5), ["x"], [{}])


def test_concurrency_is_bounded(server):
    from flowrl.rewards import build_reward

    judge = build_reward("vlm_judge", url=server, max_concurrency=3)
    start = time.perf_counter()
    judge(grey(0.5, 12), ["a"] * 12, [{}] * 12)
    assert Judge.most_in_flight == 3 and time.perf_counter() - start >= 4 * 0.05


def test_the_edit_template_shows_the_source_then_the_result(server, tmp_path):
    from PIL import Image

    from flowrl.editing import EditPrompt
    from flowrl.rewards import build_reward

    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(tmp_path / "black.png")
    request = EditPrompt("make it white", [str(tmp_path / "black.png")])
    judge = build_reward("vlm_judge", url=server, template="edit")
    scores = judge(torch.cat([grey(1.0), grey(0.0)]), [request, request], [{}, {}])
    # the server scores how far the second image is from the first: white from black 10, black from black 1
    assert scores.tolist() == pytest.approx([1.0, 0.1])
    assert all('instruction: "make it white"' in c for c in Judge.calls)


def test_every_documented_answer_form_parses_and_other_scales_fail():
    from flowrl.errors import RewardError
    from flowrl.rewards.vlm_judge import JudgeFailure, VLMJudge, parse_score

    for answer, value in [("Score: 7", 7.0), ("7/10", 7.0), ("7", 7.0), ("10/10", 10.0), ("Score: 10/10", 10.0),
                          ("Score: 1e3", 1000.0)]:  # 1e3 is read whole, then fails the template's 1..10 range
        assert parse_score(answer, 10.0) == value, answer
    for answer in ("Score: 7/100", "8 out of 10, maybe 9"):
        with pytest.raises(JudgeFailure):
            parse_score(answer, 10.0)
    for kwargs in ({"scale": 0}, {"scale": -10}, {"scale": float("nan")}, {"answer_range": [float("nan")] * 2}):
        with pytest.raises(RewardError):
            VLMJudge(**kwargs)
