"""``flowrl pretrain-tiny-clip``: train the tiny open_clip-architecture CLIP contrastively on the shapes domain."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .domain import all_specs, render, split_specs
from .pretrain import check_replaceable, fresh_sibling, replace_folder, shapes_batch


@torch.no_grad()
def retrieval_accuracy(model, tokenizer, seeds=range(4)) -> dict:
    """Image -> text top-1 over all 224 prompts, on held-out-prompt images and on training-prompt images."""
    import numpy as np

    from ..rewards.clip import preprocess

    model.eval()
    prompts = [s.prompt for s in all_specs()]
    txt = model.encode_text(tokenizer(prompts), normalize=True)
    train, held = split_specs()
    out = {}
    for name, specs in (("heldout", held), ("train", train[:48])):
        imgs = np.stack([render(s, 32, 10_000 + 97 * i + k) for i, s in enumerate(specs) for k in seeds])
        x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255
        emb = model.encode_image(preprocess(x, 32), normalize=True)
        pred = (emb @ txt.T).argmax(-1)
        truth = torch.tensor([prompts.index(s.prompt) for s in specs for _ in seeds])
        out[f"retrieval_top1_{name}"] = round(float((pred == truth).float().mean()), 4)
    return out


def pretrain_tiny_clip(steps: int = 1500, batch: int = 64, lr: float = 1e-3, seed: int = 0,
                       export_dir: str | Path | None = None, progress: bool = True) -> dict:
    import open_clip
    from safetensors.torch import save_file

    from ..rewards.clip import TINY_CLIP_DIR, build_open_clip, preprocess, tiny_clip_config

    out = Path(export_dir) if export_dir else TINY_CLIP_DIR
    check_replaceable(out, "--export-dir")  # before any work: an export never replaces a folder it did not write
    torch.manual_seed(seed)
    config = tiny_clip_config()
    model = build_open_clip(config)
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=config["text_cfg"]["context_length"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    train_specs, _ = split_specs()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc="tiny clip", disable=not progress)
    for step in bar:
        x0, prompts = shapes_batch(train_specs, batch, rng, 32)
        img = model.encode_image(preprocess((x0 + 1) / 2, 32), normalize=True)
        txt = model.encode_text(tokenizer(prompts), normalize=True)
        logits = model.logit_scale.exp() * img @ txt.T
        # duplicates of a caption in the batch are positives too: soft targets over equal captions
        same = torch.tensor([[a == b for b in prompts] for a in prompts], dtype=torch.float32)
        target = same / same.sum(-1, keepdim=True)
        loss = 0.5 * (torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 100)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)
        bar.set_postfix(loss=f"{float(loss):.3f}")
    wall = time.perf_counter() - t0
    scores = retrieval_accuracy(model, tokenizer)
    tmp = fresh_sibling(out)
    save_file({k: v.detach().half().contiguous() for k, v in model.state_dict().items()},
              str(tmp / "open_clip_model.safetensors"))
    meta = {"model_cfg": config, "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073],
                                                    "std": [0.26862954, 0.26130258, 0.27577711]},
            "training": {"command": f"flowrl pretrain-tiny-clip --steps {steps} --batch {batch} --lr {lr} --seed {seed}",
                         "wall_time_s": round(wall, 1), "final_loss": float(loss),
                         "params": sum(p.numel() for p in model.parameters()), **scores}}
    (tmp / "open_clip_config.json").write_text(json.dumps(meta, indent=1))
    replace_folder(tmp, out, "--export-dir")
    return {"exported": str(out), "wall_time_min": round(wall / 60, 1), **scores}
