"""Run-directory reports, by concern: run-folder files and metrics rows (:mod:`.files`), the reward curve
(:mod:`.plots`), image and video grids (:mod:`.grids`), and multi-run comparison and ranking (:mod:`.runs`)."""

from .files import (append_metrics, atomic_path, atomic_write_bytes, finite_json, read_metrics, save_figure,
                    truncate_metrics, write_csv)
from .grids import save_grid, save_video_grid, side_by_side
from .plots import plot_guard, plot_reward_curve, smooth
from .runs import compare_runs, format_rank_table, plot_rank, rank_runs

__all__ = ["append_metrics", "atomic_path", "atomic_write_bytes", "finite_json", "compare_runs", "format_rank_table", "plot_guard", "plot_rank", "plot_reward_curve",
           "rank_runs", "read_metrics", "save_figure", "save_grid", "save_video_grid", "side_by_side", "smooth",
           "truncate_metrics", "write_csv"]
