"""Shared CLIP-family plumbing for the reward models: image preprocessing paths and an HF CLIPModel wrapper.

Preprocessing paths (all take (N, 3, H, W) float in [0, 1]; each as its reward's released code preprocesses):
- ``pil``: the references' uint8 -> PIL path through transformers' ``CLIPImageProcessorPil`` (shortest side
  bicubic resize, centre crop, OpenAI mean/std); bit-equal to open_clip's validation transform.
- ``tensor_bilinear``: flow_grpo's CLIP-score path, a float-tensor ``Resize(size)`` (bilinear, antialiased),
  centre crop, normalise (differentiable, no quantisation).
- ``letterbox``: HPSv2's path, resize the longer side to ``size`` (bicubic, antialiased) and pad with black.
"""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .loading import resolve_pretrained_dir, to_pil

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESS_MODES = ("pil", "tensor_bilinear", "letterbox")


def normalize(x: torch.Tensor, mean=OPENAI_MEAN, std=OPENAI_STD) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def letterbox(images: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size): longer side to ``size`` (bicubic, antialias), the rest padded
    with 0 (black, before normalisation), left/top getting pad // 2."""
    import torchvision.transforms.functional as TF

    x = images.float()
    h, w = x.shape[-2:]
    scale = size / max(h, w)
    if scale != 1.0:
        x = TF.resize(x, [round(h * scale), round(w * scale)], interpolation=TF.InterpolationMode.BICUBIC,
                      antialias=True)
    ph, pw = size - x.shape[-2], size - x.shape[-1]
    return torch.nn.functional.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)


def pil_processor(size: int):
    """transformers' PIL-backend CLIP image processor at ``size`` (the laion / openai CLIP settings)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}, resample=3)


def clip_pixels(images: torch.Tensor, size: int, mode: str = "pil", processor=None) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> normalised (N, 3, size, size) pixel values along one of PREPROCESS_MODES."""
    import torchvision.transforms.functional as TF

    if mode == "pil":
        processor = processor or pil_processor(size)
        return processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
    if mode == "tensor_bilinear":
        x = TF.resize(images.float(), size, interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
        return normalize(TF.center_crop(x, [size, size]))
    if mode == "letterbox":
        return normalize(letterbox(images, size))
    raise RewardError(f"preprocess {mode!r}: choose one of {', '.join(PREPROCESS_MODES)}")


def _features(out) -> torch.Tensor:
    """transformers 5 returns a model output whose ``pooler_output`` is the projected embedding; 4.x a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class HFClip:
    """A transformers ``CLIPModel`` with its tokenizer and PIL image processor, for embedding images and prompts.

    ``model``: a local folder or hub id (``from_pretrained``), or a ``CLIPModel`` instance. ``processor``: a
    folder or hub id holding the processor files; when absent the processor is built offline (the CLIP BPE
    tokenizer from open_clip's bundled vocabulary, and a PIL image processor at the model's image size)."""

    def __init__(self, reward: str, model, processor: str | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, processor_fallback: bool = False):
        from transformers import CLIPModel

        self.device = torch.device(device)
        if isinstance(model, str):
            try:
                model, info = CLIPModel.from_pretrained(resolve_pretrained_dir(reward, model), dtype=dtype,
                                                        output_loading_info=True)
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(f"{reward}: cannot load the CLIPModel {model!r} "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
            # from_pretrained only warns about missing weights and initialises them at random: refuse instead
            missing = list(info.get("missing_keys", []))
            mismatched = list(info.get("mismatched_keys", []))
            if missing or mismatched:
                first = ", ".join(map(str, (missing or mismatched)[:4]))
                raise RewardError(f"{reward}: the checkpoint does not match the CLIPModel layout: {len(missing)} "
                                  f"missing and {len(mismatched)} mismatched weights (first: {first})")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.size = int(self.model.config.vision_config.image_size)
        try:
            self.tokenizer, self.image_processor = self._processor(reward, processor)
        except RewardError:
            if not processor_fallback:
                raise
            # the named processor is unavailable here; build the same one offline (CLIP BPE, bicubic, crop)
            self.tokenizer, self.image_processor = self._processor(reward, None)

    def _processor(self, reward: str, processor: str | None):
        if processor:
            from transformers import CLIPProcessor

            try:
                proc = CLIPProcessor.from_pretrained(resolve_pretrained_dir(reward, processor, "the processor files"))
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(f"{reward}: cannot load the CLIP processor {processor!r} ({exc})") from exc
            return proc.tokenizer, proc.image_processor
        from flowrl.tokenizer import build_clip_tokenizer

        max_len = int(self.model.config.text_config.max_position_embeddings)
        return build_clip_tokenizer(model_max_length=max_len), pil_processor(self.size)

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor, mode: str = "pil") -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> L2-normalised projected image embeddings (N, D)."""
        pixels = clip_pixels(images, self.size, mode, self.image_processor if mode == "pil" else None)
        feats = _features(self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype)))
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def embed_text(self, prompts: list[str]) -> torch.Tensor:
        """prompts -> L2-normalised projected text embeddings (N, D) (padded and truncated to the context)."""
        tok = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.tokenizer.model_max_length,
                             return_tensors="pt")
        feats = _features(self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                                       attention_mask=tok["attention_mask"].to(self.device)))
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())
