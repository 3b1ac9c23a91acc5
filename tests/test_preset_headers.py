"""Every preset's header is true of what the preset does: each value it names in the patterns below (group size,
lr, clip, KL, SDE steps, noise level, CFG, LoRA rank and alpha, prompts per iteration) equals the config's, and a
full-size preset that follows a published recipe says how many prompts an iteration takes (the recipes' batches
are far larger than one GPU's)."""

import re
from pathlib import Path

import pytest

from flowrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(ROOT.glob("configs/*.yaml"))
NUMBER = r"(\d+(?:\.\d+)?(?:e-?\d+)?|\.\d+)"
# (what the header says, the config key it names)
CLAIMS = [
    (r"\bgroups? of (\d+)\b", "algorithm.group_size"),
    (r"\blr " + NUMBER, "train.lr"),
    (r"(?<!adv )(?<!gradient )\bclip " + NUMBER, "train.clip_range"),
    (r"\bKL " + NUMBER, "train.kl_beta"),
    (r"\b(\d+) SDE steps\b", "sampler.num_steps"),
    (r"\ba = " + NUMBER, "sampler.noise_level"),
    (r"\bCFG " + NUMBER, "sampler.guidance_scale"),
    (r"\bLoRA r (\d+)\b", "train.lora.rank"),
    (r"\bLoRA r \d+ / alpha (\d+)\b", "train.lora.alpha"),
    (r"\b(\d+) prompts? per iteration\b", "train.prompts_per_iter"),
]
# a clause that reports another setting (a measurement, the paper's or the code's value, another preset's, or what
# the preset departs from) is not a claim about this preset
ELSEWHERE = re.compile(r"measured|paper|in the code|the code's|recipe's|in place of|instead|differs|other|take here|"
                       r"lost|released", re.IGNORECASE)
RECIPE = re.compile(r"(?<!not a )published|(?<!not a published )recipe|released code|paper's", re.IGNORECASE)


def header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


def clauses(text: str) -> list[str]:
    """The parts of the header that speak of this preset: each sentence's text outside brackets, unless it is
    qualified as reporting something else, and each bracket of such a sentence that is not itself qualified."""
    parts = []
    for sentence in re.split(r"\.\s", text):
        outside = re.sub(r"\([^()]*\)", " ", sentence)
        if ELSEWHERE.search(outside):
            continue
        parts += [outside] + [inner for inner in re.findall(r"\(([^()]*)\)", sentence) if not ELSEWHERE.search(inner)]
    return parts


def value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def claims(text: str) -> list[tuple[str, str, float]]:
    found = []
    for clause in clauses(text):
        for pattern, key in CLAIMS:
            found += [(m.group(0), key, float(m.group(1))) for m in re.finditer(pattern, clause)]
    return found


def test_the_claim_reader_on_written_headers():
    """The reader takes a preset's own values and leaves measurements and other settings alone."""
    text = ("GRPO on the tiny model: groups of 8, lr 3e-4, clip 1e-4, KL 0.04, 10 SDE steps at a = 0.7, CFG 4.5, "
            "LoRA r 32 / alpha 64, 4 prompts per iteration. Measured: lr 2e-4 lost accuracy (groups of 4 in the "
            "paper)")
    assert claims(text) == [("groups of 8", "algorithm.group_size", 8.0), ("lr 3e-4", "train.lr", 3e-4),
                            ("clip 1e-4", "train.clip_range", 1e-4), ("KL 0.04", "train.kl_beta", 0.04),
                            ("10 SDE steps", "sampler.num_steps", 10.0), ("a = 0.7", "sampler.noise_level", 0.7),
                            ("CFG 4.5", "sampler.guidance_scale", 4.5), ("LoRA r 32", "train.lora.rank", 32.0),
                            ("LoRA r 32 / alpha 64", "train.lora.alpha", 64.0),
                            ("4 prompts per iteration", "train.prompts_per_iter", 4.0)]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_value_a_header_names_is_the_config_s(path):
    cfg = load_config(path)
    wrong = [f"header says {said!r}, config has {key}={value(cfg, key)}" for said, key, want in claims(header(path))
             if value(cfg, key) is None or abs(float(value(cfg, key)) - want) > 1e-9 * max(1.0, abs(want))]
    assert not wrong, wrong


@pytest.mark.parametrize("path", [p for p in CONFIGS if not p.name.startswith("tiny")
                                  and RECIPE.search(header(p))], ids=lambda p: p.name)
def test_a_full_size_recipe_preset_states_its_prompts_per_iteration(path):
    pattern, key = next(c for c in CLAIMS if c[1] == "train.prompts_per_iter")
    said = [float(m.group(1)) for m in re.finditer(pattern, header(path))]  # wherever it is said, it is this preset's
    assert said, f"{path.name}: the header does not say how many prompts an iteration takes"
    assert set(said) == {float(load_config(path).train.prompts_per_iter)}, said
