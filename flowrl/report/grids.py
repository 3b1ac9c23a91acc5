"""Sample grids: images as labelled PNG grids, videos as frame-strip PNGs plus GIF and MP4 grids."""

from __future__ import annotations

from pathlib import Path

import torch

from .files import atomic_path, save_figure


def side_by_side(left: torch.Tensor, right: torch.Tensor, per_row: int) -> torch.Tensor:
    """Two row-major image sets with ``per_row`` images per row -> rows of ``left | right`` (2 * per_row)."""
    rows = left.shape[0] // per_row
    return torch.cat([torch.cat([left[i * per_row:(i + 1) * per_row], right[i * per_row:(i + 1) * per_row]])
                      for i in range(rows)])


def save_grid(images: torch.Tensor, nrow: int, path: Path, min_size: int = 64,
              row_labels: list[str] | None = None, title: str | None = None) -> Path:
    """images (N, 3, H, W) in [0, 1], row-major, -> PNG grid (nearest-upscaled so tiny images stay visible).
    Videos (N, F, 3, H, W): the PNG shows each sample's frames as a strip, and the grid as a video is written
    beside it (``<name>.gif`` and ``<name>.mp4``)."""
    if images.ndim == 5:
        save_video_grid(images, nrow, [path.with_suffix(".gif"), path.with_suffix(".mp4")], min_size)
        n, f = images.shape[:2]
        strips = images.permute(0, 2, 3, 1, 4).reshape(n, images.shape[2], images.shape[3], f * images.shape[4])
        return save_grid(strips, nrow, path, min_size, row_labels, (title or "") + f" ({f} frames per sample)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torchvision.utils import make_grid

    h = images.shape[-1]
    if h < min_size:
        images = torch.nn.functional.interpolate(images, scale_factor=min_size // h, mode="nearest")
    grid = make_grid(images.clamp(0, 1), nrow=nrow, padding=2, pad_value=1.0)
    rows = (images.shape[0] + nrow - 1) // nrow
    fig_w = max(3.0, grid.shape[2] / 80) + (2.2 if row_labels else 0)
    fig, ax = plt.subplots(figsize=(fig_w, max(1.5, grid.shape[1] / 80) + 0.4))
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    if row_labels:
        step = grid.shape[1] / rows
        ax.set_yticks([step * (i + 0.5) for i in range(len(row_labels))])
        ax.set_yticklabels([lbl if len(lbl) < 40 else lbl[:37] + "..." for lbl in row_labels], fontsize=7)
    else:
        ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def save_video_grid(videos: torch.Tensor, nrow: int, paths: list[Path], min_size: int = 64, fps: int = 8) -> list[Path]:
    """videos (N, F, 3, H, W) in [0, 1] -> videos whose frame k is the grid of every sample's frame k, one per
    path: an animated GIF (Pillow) or, for ``.mp4``, H.264 through PyAV; each written to a temporary name and
    renamed."""
    from torchvision.utils import make_grid

    frames = []  # (H, W, 3) uint8 grids, built once for every format
    for k in range(videos.shape[1]):
        x = videos[:, k].clamp(0, 1)
        if x.shape[-1] < min_size:
            x = torch.nn.functional.interpolate(x, scale_factor=min_size // x.shape[-1], mode="nearest")
        grid = make_grid(x, nrow=nrow, padding=2, pad_value=1.0)
        frames.append((grid.permute(1, 2, 0) * 255).round().byte().numpy())
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            if path.suffix == ".mp4":
                _write_mp4(frames, tmp, fps)
            else:
                from PIL import Image

                images = [Image.fromarray(f) for f in frames]
                images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / fps),
                               loop=0)
    return paths


def _write_mp4(frames: list, path: Path, fps: int) -> None:
    import av
    import numpy as np

    h, w = frames[0].shape[:2]
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = w + w % 2, h + h % 2  # yuv420p needs even sizes
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        for f in frames:
            f = np.pad(f, ((0, h % 2), (0, w % 2), (0, 0)), constant_values=255)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
