"""The shapes demo's commands: pretraining the embedded tiny image and video models and the tiny CLIP. They
join ``flowrl``'s command line through the registry (``COMMANDS``), so the core CLI knows nothing of them."""

from __future__ import annotations

import json

from ..cli_types import non_negative_int, non_negative_number, positive_int, positive_number, seed, share, unit_interval


def cmd_pretrain_tiny(args) -> int:
    from .pretrain import pretrain_tiny

    pretrain_tiny(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                  save_every=args.save_every, grid_every=args.grid_every, export_dir=args.export_dir,
                  decay_from=args.decay_from, lr_final=args.lr_final, init_from=args.init_from,
                  eval_every=args.eval_every)
    return 0


def cmd_pretrain_tiny_video(args) -> int:
    from .pretrain_video import pretrain_tiny_video

    pretrain_tiny_video(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                        save_every=args.save_every, eval_every=args.eval_every, export_dir=args.export_dir,
                        decay_from=args.decay_from, lr_final=args.lr_final, shift=args.shift,
                        init_from=args.init_from, motion_weight=args.motion_weight,
                        high_noise_expert=args.high_noise_expert, boundary=args.boundary,
                        patch_size=tuple(args.patch_size) if args.patch_size else None)
    return 0


def cmd_pretrain_tiny_edit(args) -> int:
    from .pretrain_edit import pretrain_tiny_edit

    pretrain_tiny_edit(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                       save_every=args.save_every, eval_every=args.eval_every, export_dir=args.export_dir,
                       instruction_dropout=args.instruction_dropout, missed=args.missed,
                       over_edited=args.over_edited)
    return 0


def cmd_pretrain_tiny_clip(args) -> int:
    from .tiny_clip import pretrain_tiny_clip

    print(json.dumps(pretrain_tiny_clip(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                                        export_dir=args.export_dir)))
    return 0


def _optimisation_arguments(parser, *, steps: int, batch: int, resumable: bool) -> None:
    """The options every pretraining command shares."""
    parser.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps in all (a resumed run continues "
                        "to this count)")
    parser.add_argument("--batch", type=positive_int, default=batch, help="images (or clips) per optimizer step")
    parser.add_argument("--lr", type=positive_number, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the data and the initial weights")
    if resumable:
        parser.add_argument("--save-every", type=positive_int, default=250, help="steps between resumable state saves")


def add_commands(sub) -> None:
    """Add the pretraining subcommands to ``flowrl``'s subparsers."""
    pt = sub.add_parser("pretrain-tiny", help="pretrain the embedded tiny model on the shapes domain (CPU, resumable)")
    pt.add_argument("--work-dir", default="runs/pretrain-tiny", help="state, grids; rerun to resume")
    _optimisation_arguments(pt, steps=4000, batch=32, resumable=True)
    pt.add_argument("--grid-every", type=positive_int, default=500, help="steps between sample grids")
    pt.add_argument("--export-dir", default=None, help="default: assets/tiny_shapes")
    pt.add_argument("--decay-from", type=non_negative_int, default=None,
                    help="step at which a cosine learning-rate decay starts (ends at --steps); default constant")
    pt.add_argument("--lr-final", type=non_negative_number, default=0.1, help="final learning rate as a fraction of --lr")
    pt.add_argument("--init-from", default=None,
                    help="an exported tiny shapes model folder (e.g. assets/tiny_shapes) to continue pretraining: its "
                         "weights start the run and the EMA, with a fresh optimizer; the export records it")
    pt.add_argument("--eval-every", type=non_negative_int, default=0,
                    help="held-out accuracy of the EMA weights (24 captions x 4 seeds) every that many steps, "
                         "printed and kept in <work-dir>/progress.jsonl; 0 = none")
    pt.set_defaults(func=cmd_pretrain_tiny)
    pv = sub.add_parser("pretrain-tiny-video", help="pretrain the embedded tiny video model on the moving-shapes "
                        "domain (CPU, resumable)")
    pv.add_argument("--work-dir", default="runs/pretrain-tiny-video", help="state, grids, progress; rerun to resume")
    _optimisation_arguments(pv, steps=6000, batch=32, resumable=True)
    pv.add_argument("--eval-every", type=non_negative_int, default=1000, help="held-out readout and video grid every N steps")
    pv.add_argument("--export-dir", default=None, help="default: assets/tiny_moving_shapes")
    pv.add_argument("--decay-from", type=non_negative_int, default=None,
                    help="step at which a cosine learning-rate decay starts (ends at --steps); default constant")
    pv.add_argument("--lr-final", type=non_negative_number, default=0.1, help="final learning rate as a fraction of --lr")
    pv.add_argument("--shift", type=positive_number, default=1.0, help="time shift of the training sigmas and the exported "
                    "scheduler (3 puts more training at high noise, where the layout is decided)")
    pv.add_argument("--init-from", help="warm start: the transformer of an earlier run's state folder "
                    "(<work-dir>/state) or exported model folder; its text encoder too when the shapes match")
    pv.add_argument("--motion-weight", type=non_negative_number, default=0.0,
                    help="extra weight on the frame-to-frame differences of the flow-matching target")
    pv.add_argument("--patch-size", type=positive_int, nargs=3, metavar=("T", "H", "W"),
                    help="the transformer's patch (default 1 4 4); 4 4 4 puts the four frames in every token")
    pv.add_argument("--high-noise-expert", help="an exported model folder: train a Wan 2.2-style low-noise expert "
                    "for it (sigmas below --boundary, its text encoder frozen) and export the two-expert model")
    pv.add_argument("--boundary", type=unit_interval, default=0.875, help="the two experts' boundary in sigma (Wan "
                    "2.2 text-to-video: 0.875)")
    pv.set_defaults(func=cmd_pretrain_tiny_video)
    pe = sub.add_parser("pretrain-tiny-edit", help="pretrain the embedded tiny image-editing model (FLUX.1 Kontext "
                        "architecture) on shapes edit pairs (CPU, resumable)")
    pe.add_argument("--work-dir", default="runs/pretrain-tiny-edit", help="state, grids, progress; rerun to resume")
    _optimisation_arguments(pe, steps=3000, batch=32, resumable=True)
    pe.add_argument("--eval-every", type=non_negative_int, default=500, help="held-out edit accuracy of the EMA weights (72 "
                    "requests x 2 seeds) and a grid every N steps, kept in <work-dir>/progress.jsonl; 0 = none")
    pe.add_argument("--export-dir", default=None, help="default: assets/tiny_shapes_edit")
    pe.add_argument("--instruction-dropout", type=share, default=0.0,
                    help="share of instructions replaced by the empty one, so that the model can be sampled with "
                         "classifier-free guidance (the shipped model: 0)")
    pe.add_argument("--missed", type=share, default=0.0,
                    help="share of pairs whose target is the unchanged source, as in an imperfect editing dataset")
    pe.add_argument("--over-edited", type=share, default=0.0,
                    help="share of pairs whose target makes the edit and lets the replaced colour leak into an "
                         "attribute the instruction did not ask for (the shipped model: --missed 0.3 --over-edited 0.1)")
    pe.set_defaults(func=cmd_pretrain_tiny_edit)
    pc = sub.add_parser("pretrain-tiny-clip", help="train the tiny shapes CLIP (open_clip architecture) on the CPU")
    _optimisation_arguments(pc, steps=1500, batch=64, resumable=False)
    pc.add_argument("--export-dir", default=None, help="default: assets/tiny_clip")
    pc.set_defaults(func=cmd_pretrain_tiny_clip)
