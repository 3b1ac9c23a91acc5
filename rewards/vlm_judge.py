"""``vlm_judge``: a vision-language model as the reward, asked over an OpenAI-compatible chat-completions endpoint
(what vLLM and SGLang serve: ``POST {url}/chat/completions``).

Each image goes out as a base64 PNG inside one user message with the question; the answer text is parsed:

- ``template: quality`` asks for a 1-10 score of how well the image matches the prompt and its quality; the score
  is the number the answer gives (``Score: 7``, ``7/10`` or a lone ``7``), divided by ``scale`` (10 gives [0, 1]);
  an answer outside 1..10 is a failed answer, not a score (``answer_range`` sets the range of a template of your
  own);
- ``template: yes_no`` asks a yes/no question (GenEval-style: ``metadata["question"]``, else "Does this image show
  {prompt}?"); yes scores 1, no scores 0;
- ``template: edit`` judges an edit: the message holds the edit request's source image first and the result
  second, and asks for a 1-10 score of how well the result carries out the instruction while keeping the rest of
  the source (divided by ``scale``, 10);
- any other string is a template of its own, with ``{prompt}`` (and ``{question}``) filled in, parsed as a score.

Requests run ``max_concurrency`` at a time, each with a ``timeout`` and ``retries`` (growing pauses) on connection
errors, time-outs and 5xx answers. A request that still fails, and an answer that cannot be parsed, never score 0:
with ``on_failure: mask`` (the default) the sample's score is NaN, which training masks and counts
(``reward_nan_count``); with ``on_failure: fail`` the iteration stops with one line naming the URL and the cause.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from flowrl.errors import RewardError


TEMPLATES = {
    "quality": ("You are judging a generated image. The prompt was: \"{prompt}\". Rate how well the image matches "
                "the prompt and how good it looks, from 1 (worst) to 10 (best). Answer with the score only, as "
                "\"Score: N\"."),
    "yes_no": "{question} Answer with yes or no only.",
    # image editing: the judge sees the source first and the result second
    "edit": ("The first image is the original. The second image is the result of editing it with the instruction: "
             "\"{prompt}\". Rate from 1 (not done at all) to 10 (done exactly, with everything the instruction does "
             "not mention kept as in the original) how well the second image carries out the instruction. Answer "
             "with the score only, as \"Score: N\"."),
}


class JudgeFailure(Exception):
    """A request that failed after its retries, or an answer that could not be parsed."""


NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"


def parse_score(answer: str, out_of: float | None = None) -> float:
    """The score an answer gives: the number after "score", else the only number in it; ``7/10`` and
    ``Score: 10/10`` give the numerator, and a denominator other than ``out_of`` (the template's top) is a failed
    answer, not a score on another scale."""
    fraction = re.search(rf"(?:score\s*[:=]?\s*)?({NUMBER})\s*/\s*({NUMBER})", answer, re.IGNORECASE)
    if fraction:
        value, top = float(fraction.group(1)), float(fraction.group(2))
        if out_of is not None and top != out_of:
            raise JudgeFailure(f"the answer scores out of {top:g}, the template asks for a score out of {out_of:g}: "
                               f"{answer[:80]!r}")
        return value
    labelled = re.search(rf"score\s*[:=]?\s*({NUMBER})", answer, re.IGNORECASE)
    if labelled:
        return float(labelled.group(1))
    numbers = re.findall(NUMBER, answer)
    if len(numbers) == 1:
        return float(numbers[0])
    raise JudgeFailure(f"no single score in the answer {answer[:80]!r}")


def parse_yes_no(answer: str) -> float:
    words = re.findall(r"[a-z]+", answer.lower())
    if words and words[0] in ("yes", "no"):
        return 1.0 if words[0] == "yes" else 0.0
    raise JudgeFailure(f"the answer {answer[:80]!r} is neither yes nor no")


def png_base64(image: torch.Tensor) -> str:
    """(3, H, W) in [0, 1] -> a base64 PNG."""
    from PIL import Image

    arr = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class VLMJudge:
    """Args:
        url: the server's OpenAI-compatible base, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name.
        template: ``quality``, ``yes_no``, ``edit`` or a template string with ``{prompt}`` / ``{question}``.
        scale: scores are divided by it (``quality`` and ``edit``: 10).
        max_concurrency: requests in flight at once.
        timeout: seconds per request.
        retries: further tries after a connection error, a time-out or a 5xx answer.
        on_failure: ``mask`` (NaN, counted) or ``fail`` (stop the iteration).
        api_key_env: the environment variable holding a bearer token, if the server wants one.
        max_tokens, temperature: the completion's settings (greedy by default).
    """

    def __init__(self, url: str = "http://127.0.0.1:8000/v1", model: str = "default", template: str = "quality",
                 scale: float | None = None, max_concurrency: int = 8, timeout: float = 60.0, retries: int = 2,
                 on_failure: str = "mask", api_key_env: str = "OPENAI_API_KEY", max_tokens: int = 16,
                 temperature: float = 0.0, answer_range: list[float] | None = None):
        if on_failure not in ("mask", "fail"):
            raise RewardError(f"vlm_judge: on_failure must be mask or fail, not {on_failure!r}")
        if max_concurrency < 1 or retries < 0 or timeout <= 0:
            raise RewardError("vlm_judge: max_concurrency >= 1, retries >= 0 and timeout > 0, please")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.template_name = model, template
        self.template = TEMPLATES.get(template, template)
        self.scale = scale if scale is not None else (10.0 if template in ("quality", "edit") else 1.0)
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise RewardError(f"vlm_judge: scale divides the answer's number and must be a positive number, not "
                              f"{scale!r}")
        self.shows_source = template == "edit"  # the request's source image goes first
        # the numbers an answer may give (the template's own scale); outside it the answer fails like an unreadable one
        default_range = {"quality": (1.0, 10.0), "edit": (1.0, 10.0), "yes_no": (0.0, 1.0)}.get(template)
        self.answer_range = tuple(answer_range) if answer_range is not None else default_range
        if self.answer_range is not None and (
                len(self.answer_range) != 2
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in self.answer_range)
                or self.answer_range[0] > self.answer_range[1]):
            raise RewardError(f"vlm_judge: answer_range must be [low, high], two finite numbers with low <= high, not "
                              f"{answer_range!r}")
        top = self.answer_range[1] if self.answer_range is not None else None
        self.parse = parse_yes_no if template == "yes_no" else (lambda answer: parse_score(answer, top))
        self.max_concurrency, self.timeout, self.retries = max_concurrency, timeout, retries
        self.on_failure, self.api_key = on_failure, os.environ.get(api_key_env)
        self.max_tokens, self.temperature = max_tokens, temperature
        self.failures = 0  # samples masked so far

    def question(self, prompt: str, meta: dict) -> str:
        question = meta.get("question") or f"Does this image show {prompt}?"
        return self.template.format(prompt=prompt, question=question)

    def _post(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = json.loads(response.read())
                return payload["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
                if exc.code < 500:  # the request itself is wrong: another try gives the same answer
                    raise JudgeFailure(f"{last} from {self.url}: {exc.read()[:200].decode(errors='replace')}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise JudgeFailure(f"{self.url} answered something that is not a chat completion ({exc!r})") from exc
        raise JudgeFailure(f"{self.url} failed {self.retries + 1} times ({last}); is the server running?")

    def judge(self, image: torch.Tensor, prompt: str, meta: dict) -> float:
        """One image's score (NaN when masked)."""
        images = [image]
        if self.shows_source:  # an edit: the source (resized to the result's size) before the result
            from flowrl.editing import source_tensor

            images = [source_tensor([prompt], image.shape[-1])[0], image]
        message = {"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(x)}"}} for x in images),
            {"type": "text", "text": self.question(str(prompt), meta)}]}
        body = json.dumps({"model": self.model, "messages": [message], "max_tokens": self.max_tokens,
                           "temperature": self.temperature}).encode()
        try:
            value = self.parse(self._post(body))
            if self.answer_range is not None and not self.answer_range[0] <= value <= self.answer_range[1]:
                low, high = self.answer_range
                raise JudgeFailure(f"the answer gives {value:g}, outside the template's {low:g}..{high:g}")
            return value / self.scale
        except JudgeFailure as exc:
            if self.on_failure == "fail":
                raise RewardError(f"vlm_judge: {exc}") from exc
            self.failures += 1
            return math.nan

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """Args:
            images: (N, 3, H, W) in [0, 1].
            prompts: N prompts.
            metadata: N dicts (``question`` for yes/no templates).
        Returns:
            (N,) scores; NaN for masked failures.
        """
        if images.dim() != 4:
            raise RewardError("vlm_judge scores images (N, 3, H, W); wrap it in video_frames for videos")
        metas = [m if isinstance(m, dict) else {} for m in (metadata or [{}] * len(prompts))]
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            scores = list(pool.map(self.judge, images, prompts, metas))
        return torch.tensor(scores, dtype=torch.float32)
