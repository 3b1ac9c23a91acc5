"""Reward models on a Qwen2-VL or Qwen2.5-VL backbone (HPSv3, VideoReward, EditReward): the backbone without its
language-model head, one reward head or several (read at special tokens), checkpoint loading in either transformers
layout, and Qwen2-VL's resize rule."""

from __future__ import annotations

import math

import torch

from flowrl.errors import RewardError

from .loading import load_strict, read_state_dict

PIXELS = 256 * 28 * 28  # min_pixels = max_pixels of HPSv3's images and VideoReward's frames


def resized_side(height: int, width: int, pixels: int = PIXELS, factor: int = 28) -> tuple[int, int]:
    """Qwen2-VL's resize rule with min_pixels = max_pixels = ``pixels``: sides rounded to multiples of ``factor``,
    scaled (down, floored; or up, ceiled) so that the area meets the bound."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class QwenVLRewardModel(torch.nn.Module):
    """A Qwen2-VL / Qwen2.5-VL backbone (the config's ``model_type`` picks it; without its language-model head) and
    a reward head read at special tokens: HPSv3's ``ranknet`` head (Linear(h, 1024), ReLU, Dropout, Linear(1024, 16),
    ReLU, Linear(16, outputs)) or VideoReward's plain ``linear`` head (Linear(h, outputs), no bias), in fp32. With
    ``heads`` > 1 there are that many heads (``rm_heads.head_<i>``, EditReward's), each read on its own input."""

    def __init__(self, config, head: str = "ranknet", outputs: int = 2, heads: int = 1):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_config(config)
        hidden = config.text_config.hidden_size if hasattr(config, "text_config") else config.hidden_size

        def build():
            if head == "ranknet":
                return torch.nn.Sequential(torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                                           torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs))
            return torch.nn.Linear(hidden, outputs, bias=False)

        if heads == 1:
            self.rm_head = build()
        else:
            self.rm_heads = torch.nn.ModuleDict({f"head_{i}": build() for i in range(heads)})

    def forward(self, inputs: dict, token_ids: list[int], head: int | None = None) -> torch.Tensor:
        """Args:
            inputs: the processor's batch (input_ids (B, L), attention_mask, pixel values and grids).
            token_ids: the reward tokens' ids, K of them; each row holds each exactly once.
            head: which of several heads reads them (None: the one head).
        Returns:
            (B, K, outputs): the head at each reward token, in the order of ``token_ids``.
        """
        hidden = self.backbone(**inputs).last_hidden_state  # (B, L, h)
        module = self.rm_head if head is None else self.rm_heads[f"head_{head}"]
        logits = module(hidden.float())  # (B, L, outputs)
        picked = []
        for tid in token_ids:
            at = inputs["input_ids"] == tid
            if not torch.equal(at.sum(1), torch.ones_like(at.sum(1))):
                raise RewardError("every input must hold each reward token exactly once")
            picked.append(logits[at])  # (B, outputs)
        return torch.stack(picked, dim=1)


def remap_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2-VL reward checkpoint's names (either transformers layout) -> :class:`QwenVLRewardModel`'s."""
    out = {}
    for key, value in state.items():
        if key.startswith("lm_head."):
            continue  # the language-model head is not used for scoring
        for old, new in (("model.language_model.", "backbone.language_model."), ("model.visual.", "backbone.visual."),
                         ("model.", "backbone.language_model."), ("visual.", "backbone.visual.")):
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def load_reward_model(config_folder: str, weights, head: str, outputs: int, heads: int = 1) -> QwenVLRewardModel:
    """A :class:`QwenVLRewardModel` of the folder's architecture with the checkpoint's weights (either transformers
    layout; a language model whose vocabulary was resized for the reward tokens keeps the checkpoint's size)."""
    from transformers import AutoConfig

    try:  # random initialisation of billions of parameters that the checkpoint overwrites anyway: skipped
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = QwenVLRewardModel(AutoConfig.from_pretrained(config_folder), head, outputs, heads)
    state = remap_keys(read_state_dict(weights))
    embed = state.get("backbone.language_model.embed_tokens.weight")
    current = model.backbone.language_model.embed_tokens
    if embed is not None and embed.shape != current.weight.shape and embed.shape[1] == current.weight.shape[1]:
        model.backbone.language_model.embed_tokens = torch.nn.Embedding(*embed.shape, padding_idx=current.padding_idx)
    load_strict(model, state, str(weights))
    return model


def load_qwen_vl_reward(reward: str, checkpoint: str | None, base: str, repo_id: str, filename: str,
                        tokens: tuple[str, ...], head: str, outputs: int, dtype: str, device: str, heads: int = 1):
    """The processor (with the reward tokens added), the tokens' ids and the model on ``device`` for a Qwen2-VL or
    Qwen2.5-VL reward model with ``heads`` reward heads: ``base`` gives the architecture and processor,
    ``checkpoint`` (or ``filename`` from ``repo_id``)
    the weights; the backbone in ``dtype`` (bf16 or fp32), the head in fp32.

    Returns:
        ``(processor, token_ids, model)``.
    """
    from transformers import AutoProcessor

    from .loading import resolve_file, resolve_pretrained_dir

    if dtype not in ("bf16", "fp32"):
        raise RewardError(f"{reward}: dtype must be bf16 or fp32, not {dtype!r}")
    folder = resolve_pretrained_dir(reward, base, "Qwen2-VL's config.json and processor files")
    weights = resolve_file(reward, checkpoint, repo_id, filename)
    processor = AutoProcessor.from_pretrained(folder)
    tok = processor.tokenizer
    if any(t not in tok.get_vocab() for t in tokens):
        tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    model = load_reward_model(folder, weights, head, outputs, heads)
    if dtype == "bf16":
        model.backbone.to(torch.bfloat16)
    model = model.to(torch.device(device)).eval().requires_grad_(False)
    return processor, [tok.convert_tokens_to_ids(t) for t in tokens], model
