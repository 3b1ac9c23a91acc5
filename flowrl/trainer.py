"""The GRPO trainer: rollout -> rewards -> advantages -> edge selection -> clipped policy update.

One iteration, with every random draw from a generator seeded by (train.seed, iteration), so a run is
reproducible on the CPU and ``resume`` continues it exactly.
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import report
from .algorithms import build_plan, edge_advantages, select_edges
from .checkpoint import latest_checkpoint, load_lora_into, load_trainer_state, save_checkpoint
from .config import Config, save_config
from .engine import Tree, rollout
from .errors import ConfigError, FlowRLError
from .losses import gaussian_kl_same_std, ppo_clip_loss
from .models import SD3Adapter
from .prompts import DEFAULT_TINY_PROMPTS, PromptSource
from .rewards import build_reward_set
from .rewards.registry import RewardScores
from .samplers import RolloutPlan, StepSpec, make_sigmas
from .samplers.kernels import flow_grpo_noise_scale, step as kernel_step
from .samplers.schedules import dynamic_shift_mu
from .trackers import BetaTracker, CapabilityEMA, superflow_group_sizes


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is available; use device=cpu")
    return torch.device(name)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def sigmas_for(cfg: Config, adapter, num_steps: int) -> torch.Tensor:
    s = cfg.sampler
    mu = None
    sched_cfg = dict(adapter.pipe.scheduler.config)
    if s.schedule == "dynamic_shift" or sched_cfg.get("use_dynamic_shifting", False):
        seq = adapter.image_seq_len(cfg.model.resolution)
        mu = dynamic_shift_mu(seq, sched_cfg.get("base_image_seq_len", 256), sched_cfg.get("max_image_seq_len", 4096),
                              sched_cfg.get("base_shift", 0.5), sched_cfg.get("max_shift", 1.15))
    return make_sigmas(s.schedule, num_steps, shift=s.shift, mu=mu, scheduler_config=sched_cfg)


def add_lora(transformer, lora_cfg, default_targets: list[str]) -> None:
    from peft import LoraConfig

    targets = lora_cfg.targets or default_targets
    present = {name for name, _ in transformer.named_modules()}
    if not any(any(n.endswith(t) for n in present) for t in targets):
        raise ConfigError(f"train.lora.targets: none of {targets} name a module of this transformer")
    transformer.add_adapter(LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, init_lora_weights="gaussian",
                                       target_modules=targets, lora_dropout=0.0))


@dataclass
class Unit:
    """One parent state with the trained edges (children) leaving it."""

    depth: int  # round of the parent (its trained edges create nodes of round depth + 1)
    parent: int
    children: list[int]  # positions in round depth + 1


class Trainer:
    def __init__(self, cfg: Config, config_name: str = "run", run_dir: str | Path | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.train.seed)
        # --- everything that can fail on bad input happens before the run directory exists
        self.prompts = PromptSource.from_config(cfg.data, cfg.train.seed, DEFAULT_TINY_PROMPTS
                                                if cfg.model.pretrained in (None, "", "tiny") else None)
        self.rewards = build_reward_set(cfg.rewards)
        a = cfg.algorithm
        t = a.tracker
        if a.name == "superflow" and t.min_group > t.max_group:
            raise ConfigError(f"algorithm.tracker.min_group ({t.min_group}) must not exceed max_group ({t.max_group})")
        if t.reward_range[1] <= t.reward_range[0]:
            raise ConfigError(f"algorithm.tracker.reward_range {t.reward_range} must be [low, high] with low < high")
        self.tracker = (BetaTracker(t.rho, reward_range=tuple(t.reward_range), rho_mode=t.rho_mode, d_half=t.d_half,
                                    rho_min=t.rho_min)
                        if a.name == "superflow" or cfg.advantage.zero_variance == "tracker" else None)
        self.capability = CapabilityEMA(a.curriculum.ema_alpha) if a.name == "ada_grpo" else None
        self._last_divergence = None
        resume_dir = None
        if cfg.resume:
            resume_dir = self._find_resume(cfg, run_dir)
            run_dir = resume_dir.parent.parent
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # AcceleratorState is a process-wide singleton; a second Trainer in one process (tests, bench, notebooks)
        # with another precision must start from a fresh one. The distributed (partial) state is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, cpu=self.device.type == "cpu",
                                       log_with=cfg.log.trackers or None)
        self.adapter = SD3Adapter.from_config(cfg.model, self.device)
        self.latent_shape = self.adapter.latent_shape(cfg.model.resolution)
        transformer = self.adapter.transformer
        if cfg.train.lora.enabled:
            transformer.requires_grad_(False)
            add_lora(transformer, cfg.train.lora, self.adapter.lora_targets)
        else:
            transformer.requires_grad_(True)
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        for p in self.params:  # trainable weights stay fp32 (mixed precision autocasts the forward)
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                           weight_decay=cfg.train.weight_decay, eps=cfg.train.adam_eps,
                                           fused=self.device.type == "cuda")
        self.adapter.transformer, self.optimizer = self.accelerator.prepare(transformer, self.optimizer)
        self.ema = None
        if cfg.train.ema.enabled:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(self.params, decay=cfg.train.ema.decay)  # decay min((1+n)/(10+n), d) = Flow-GRPO's
        self.sigmas = sigmas_for(cfg, self.adapter, cfg.sampler.num_steps)
        self.negative = None
        if cfg.sampler.guidance_scale > 1.0:
            self.negative = self.adapter.encode_prompts([cfg.sampler.negative_prompt])
        self.start_iteration = 0
        if resume_dir is not None:
            self._load(resume_dir)
        # --- the run directory
        if run_dir is None:
            name = cfg.log.run_name or f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir = Path(cfg.log.output_dir) / name
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.curve_path = self.run_dir / "eval_curve.jsonl"  # curve rows count iterations done (0 = before)
        if resume_dir is not None:
            report.truncate_metrics(self.metrics_path, self.start_iteration)
            report.truncate_metrics(self.curve_path, self.start_iteration + 1)
        else:
            self.metrics_path.unlink(missing_ok=True)
            self.curve_path.unlink(missing_ok=True)
        if cfg.log.trackers:
            self.accelerator.init_trackers(self.run_dir.name)
        self._cumulative = {"nfe_rollout_cum": 0, "rollouts_cum": 0, "seconds_cum": 0.0}
        rows = report.read_metrics(self.metrics_path)
        if rows:
            self._cumulative = {k: rows[-1].get(k, 0) for k in self._cumulative}

    # ------------------------------------------------------------------------------------------ resume
    @staticmethod
    def _find_resume(cfg: Config, run_dir) -> Path:
        if cfg.resume == "latest":
            base = Path(run_dir) if run_dir else (Path(cfg.log.output_dir) / cfg.log.run_name if cfg.log.run_name else None)
            if base is None:
                raise ConfigError("resume=latest needs log.run_name (the run to continue)")
            ckpt = latest_checkpoint(base)
            if ckpt is None:
                raise ConfigError(f"resume=latest: no checkpoint under {base}/checkpoints")
            return ckpt
        path = Path(cfg.resume)
        if (path / "checkpoints").is_dir():
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise ConfigError(f"resume: no checkpoint under {path}/checkpoints")
            return ckpt
        if not (path / "state.json").is_file():
            raise ConfigError(f"resume: {path} is neither a run directory nor a checkpoint folder")
        return path

    def _load(self, ckpt: Path) -> None:
        if self.cfg.train.lora.enabled:
            load_lora_into(self.accelerator.unwrap_model(self.adapter.transformer), ckpt)
        else:
            from safetensors.torch import load_file

            files = sorted((ckpt / "transformer").glob("*.safetensors"))
            if not files:
                raise FlowRLError(f"{ckpt}: no transformer weights to resume full fine-tuning from")
            sd = {}
            for f in files:
                sd.update(load_file(str(f)))
            self.accelerator.unwrap_model(self.adapter.transformer).load_state_dict(sd)
        state = load_trainer_state(ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        self.start_iteration = int(state["iteration"]) + 1
        saved = json.loads((ckpt / "state.json").read_text()).get("algorithm_state", {})
        if self.tracker is not None and "tracker" in saved:
            self.tracker.load_state_dict(saved["tracker"])
        if self.capability is not None and "capability" in saved:
            self.capability.load_state_dict(saved["capability"])
        self._last_divergence = saved.get("last_divergence")

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> Path:
        cfg = self.cfg
        bar = tqdm(range(self.start_iteration, cfg.train.iterations), desc="train", disable=not cfg.log.progress,
                   initial=self.start_iteration, total=cfg.train.iterations)
        if self.start_iteration == 0:
            self.sample_grid(0)
            if cfg.log.eval != "none":
                self.evaluate("before")
            self.curve_point(0)
        for it in bar:
            row = self.iteration(it)
            if cfg.log.eval_every and ((it + 1) % cfg.log.eval_every == 0 or it == cfg.train.iterations - 1):
                self.curve_point(it + 1)
            bar.set_postfix(reward=f"{row['reward_mean/total']:.4f}", kl=f"{row['approx_kl']:.1e}")
            last = it == cfg.train.iterations - 1
            if last or (cfg.log.sample_every and (it + 1) % cfg.log.sample_every == 0):
                self.sample_grid(it + 1)
            if last or (cfg.log.save_every and (it + 1) % cfg.log.save_every == 0):
                self.save(it)
        report.plot_reward_curve(self.run_dir)
        if cfg.log.eval != "none" and self.start_iteration < cfg.train.iterations:
            self.evaluate("after")
            report.plot_reward_curve(self.run_dir)  # again, with the held-out panel
        if cfg.log.trackers:
            self.accelerator.end_training()
        return self.run_dir

    # ------------------------------------------------------------------------------------------ evaluation
    GRID_PROMPTS = 6
    GRID_COLUMNS = 4

    def evaluate(self, when: str) -> dict:
        """Held-out accuracy (shapes) written to eval.json; a before | after grid on held-out prompts."""
        import json

        from .prompts import prompt_set

        cfg = self.cfg
        seeds = cfg.log.eval_seeds
        result, all_images = self._heldout(seeds, return_images=True)
        # the grid reuses the evaluation's own samples: held-out prompts spread over shapes, the first seeds
        held = prompt_set("shapes-heldout")
        picks = list(range(0, len(held), max(1, len(held) // self.GRID_PROMPTS)))[: self.GRID_PROMPTS]
        prompts = [held[i] for i in picks]
        cols = min(self.GRID_COLUMNS, len(seeds))
        images = torch.cat([all_images[i * len(seeds): i * len(seeds) + cols] for i in picks])
        path = self.run_dir / "eval.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[when] = result
        report.atomic_write_bytes(path, json.dumps(data, indent=1).encode())
        before_path = self.run_dir / "heldout_before.pt"
        if when == "before":
            torch.save(images, before_path)
        elif before_path.is_file():
            before = torch.load(before_path, weights_only=True)
            b, a = data.get("before", {}), result
            title = (f"held-out prompts: left before | right after   all-correct {b.get('all', float('nan')):.2f} -> "
                     f"{a['all']:.2f}")
            report.save_grid(report.side_by_side(before, images, cols), 2 * cols, self.run_dir / "before_after.png",
                             row_labels=prompts, title=title)
        return result

    def _heldout(self, seeds: list[int], return_images: bool = False):
        """Held-out shapes accuracy of the (EMA) policy, ODE on the evaluation grid: the full evaluation and the
        curve points differ only in their seeds."""
        from .evaluate import shapes_accuracy

        with self.ema_weights():
            return shapes_accuracy(self.adapter, self.sigmas_eval(), seeds, self.cfg.sampler.guidance_scale,
                                   self.negative, max_batch=self.cfg.algorithm.max_batch, return_images=return_images)

    def curve_point(self, done: int) -> None:
        """One held-out point (the first ``log.eval_curve_seeds`` evaluation seeds) appended to eval_curve.jsonl
        with the work spent so far, so runs can be compared per rollout and per training second."""
        cfg = self.cfg
        if cfg.log.eval == "none" or not cfg.log.eval_every:
            return
        result = self._heldout(cfg.log.eval_seeds[: cfg.log.eval_curve_seeds])
        report.append_metrics(self.curve_path,
                              {"iteration": done, **self._cumulative, "all": result["all"], "reward": result["reward"],
                               "images": result["images"]})

    def iteration(self, it: int) -> dict:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + it)
        plan = build_plan(cfg, it, random.Random(cfg.train.seed * 1_000_003 + it), self.sigmas)
        row: dict = {"iteration": it}
        t0 = time.perf_counter()
        self.adapter.transformer.eval()
        prompts, metadata, roots = self._choose_prompts(it, gen, row)
        cond = self.adapter.encode_prompts(prompts)
        tree, scores, timing = self._rollout_and_score(cond, plan, gen, prompts, metadata, roots)
        row.update(timing)
        t2 = time.perf_counter()
        leaf_group = tree.leaf_group
        if not torch.isfinite(scores.total).any():
            raise FlowRLError(f"iteration {it}: every reward was NaN/inf; check the reward function")
        leaf_prompts = [prompts[g] for g in leaf_group.tolist()]
        baselines = None
        if self.tracker is not None:  # tracker values before this iteration's update, in reward units
            lo, hi = cfg.algorithm.tracker.reward_range
            baselines = torch.tensor([lo + (hi - lo) * self.tracker.value(p) for p in leaf_prompts])
        capability = (self.capability.mean, self.capability.var ** 0.5) if self.capability is not None else None
        node_adv, keep, adv_stats = edge_advantages(cfg, tree, scores.total, it, baselines, capability)
        if cfg.advantage.combine == "per_reward" and len(self.rewards.items) > 1:
            node_adv, keep = per_reward_advantages(cfg, tree, scores, self.rewards.weights, it)
        if cfg.advantage.zero_variance == "drop_refill":
            keep = [k & m for k, m in zip(keep, self._refill_masks(tree, scores.total, adv_stats))]
        if self.tracker is not None:
            for g, p in enumerate(prompts):
                self.tracker.update(p, scores.total[leaf_group == g], self._last_divergence)
        masks = select_edges(cfg, tree, gen)
        adv_stats["pruned_edges"] = sum(int((m & ~k).sum()) for m, k in zip(masks, keep))
        masks = [m & k for m, k in zip(masks, keep)]
        train_stats = self.update(tree, cond, node_adv, masks, gen)
        self._last_divergence = train_stats.get("mean_abs_log_ratio")
        t3 = time.perf_counter()
        for name, values in [("total", scores.total)] + list(scores.components.items()):
            ok = values[torch.isfinite(values)]
            row[f"reward_mean/{name}"] = float(ok.mean()) if ok.numel() else float("nan")
            row[f"reward_std/{name}"] = float(ok.std(correction=0)) if ok.numel() else float("nan")
        self._cumulative["nfe_rollout_cum"] += tree.nfe + row.get("curriculum/nfe", 0)
        self._cumulative["seconds_cum"] += t3 - t0
        self._cumulative["rollouts_cum"] += int(leaf_group.numel()) + row.get("curriculum/images", 0)  # images scored
        row.update(adv_stats)
        row.update(train_stats)
        row.update({
            "nfe_rollout": tree.nfe, "transformer_calls_rollout": tree.transformer_calls,
            "leaves": int(leaf_group.numel()), **{f"plan/{k}": v for k, v in plan.accounting().items()},
            **{f"plan/{k}": v for k, v in plan.notes.items()},
            "seconds_train": t3 - t2,
            "peak_memory_mb": peak_memory_mb(self.device), **self._cumulative,
        })
        report.append_metrics(self.metrics_path, row)
        if cfg.log.trackers:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=it)
        if (it + 1) % 5 == 0 or it == 0:
            report.plot_reward_curve(self.run_dir)
        return row

    # ------------------------------------------------------------------------------------------ rollout + reward
    def _rollout_and_score(self, cond, plan, gen, prompts, metadata, roots):
        """Roll out the prompts in ``sampler.rollout_batches`` batches and score each batch's leaves; with
        ``async_reward`` a batch is scored in a worker thread while the next one is rolled out.

        Returns (tree, scores, timing): seconds_rollout (rollout + decode), seconds_reward (scorer time, summed
        over batches), seconds_reward_wait (time the trainer waited for scores after the last rollout) and
        seconds_reward_hidden = seconds_reward - seconds_reward_wait (the time the overlap saved)."""
        from concurrent.futures import ThreadPoolExecutor

        cfg = self.cfg
        n = len(prompts)
        k = min(cfg.sampler.rollout_batches, n)
        bounds = [round(i * n / k) for i in range(k + 1)]
        use_async = cfg.sampler.async_reward and k > 1
        if use_async and getattr(self, "_reward_pool", None) is None:
            self._reward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-reward")

        def score(images, rows):
            start = time.perf_counter()
            out = self.rewards(images, [prompts[g] for g in rows], [metadata[g] for g in rows])
            return out, time.perf_counter() - start

        trees, pending = [], []
        t_rollout = 0.0
        for a, b in zip(bounds[:-1], bounds[1:]):
            start = time.perf_counter()
            idx = torch.arange(a, b)
            part = rollout(self.adapter, cond.index(idx.to(cond.embeds.device)), plan, self.sigmas, self.latent_shape,
                           kernel=cfg.sampler.kernel, noise_level=cfg.sampler.noise_level, generator=gen,
                           max_batch=cfg.algorithm.max_batch, guidance_scale=cfg.sampler.guidance_scale,
                           negative=self.negative, log_prob_reduce=cfg.train.log_prob_reduce,
                           roots=roots[a:b] if roots else None)
            images = self.adapter.decode(part.leaves)
            t_rollout += time.perf_counter() - start
            rows = (part.leaf_group + a).tolist()
            pending.append(self._reward_pool.submit(score, images, rows) if use_async else score(images, rows))
            trees.append(part)
        start = time.perf_counter()
        results = [p.result() if use_async else p for p in pending]
        wait = time.perf_counter() - start if use_async else sum(r[1] for r in results)
        scored = sum(r[1] for r in results)
        return Tree.concat(trees), RewardScores.concat([r[0] for r in results]), {
            "seconds_rollout": t_rollout, "seconds_reward": scored, "seconds_reward_wait": wait,
            "seconds_reward_hidden": max(0.0, scored - wait), "rollout_batches": k}

    # ------------------------------------------------------------------------------------------ prompts
    def _choose_prompts(self, it: int, gen: torch.Generator, row: dict) -> tuple[list[str], list[dict], list[int] | None]:
        """This iteration's prompts (and per-prompt group sizes for superflow).

        - superflow: prompts drawn without replacement with probability ∝ the tracker's priority
          sqrt(v (1 - v)); group size from the priority bin.
        - ada_grpo: ``curriculum.candidates`` prompts, one ODE anchor each, scored; the capability EMA is
          updated and the prompts whose anchor score is nearest it are kept.
        - drop_refill: ``refill_extra`` more prompts than ``prompts_per_iter``.
        """
        cfg, a = self.cfg, self.cfg.algorithm
        n = cfg.train.prompts_per_iter
        if a.name == "superflow":
            pool = self.prompts
            w = torch.tensor([self.tracker.priority(p) for p in pool.prompts], dtype=torch.float64)
            idx = torch.multinomial(w, min(n, len(w)), replacement=False, generator=gen).tolist()
            prompts, metadata = [pool.prompts[i] for i in idx], [pool.metadata[i] for i in idx]
            t = a.tracker
            roots = superflow_group_sizes([self.tracker.priority(p) for p in prompts], t.min_group, t.max_group, t.bins)
            row["group_size_mean"] = sum(roots) / len(roots)
            return prompts, metadata, roots
        if a.name == "ada_grpo":
            cand, meta = self.prompts.batch(it, a.curriculum.candidates)
            t0 = time.perf_counter()
            anchors = sample_images(self.adapter, cand, [cfg.train.seed * 1_000_003 + it], self.sigmas,
                                    self.latent_shape, cfg.sampler.guidance_scale, self.negative, cfg.algorithm.max_batch)
            scores = self.rewards(anchors, cand, meta).total
            self.capability.update(scores[torch.isfinite(scores)])
            keep = self.capability.closest(torch.nan_to_num(scores, nan=float("inf")), n)
            row.update({"curriculum/anchor_score_mean": float(scores.nanmean()), "curriculum/capability": self.capability.mean,
                        "curriculum/seconds": time.perf_counter() - t0,
                        # the candidates' ODE anchors are rollout work too (counted in nfe_rollout_cum)
                        "curriculum/nfe": len(cand) * cfg.sampler.num_steps, "curriculum/images": len(cand)})
            return [cand[i] for i in keep], [meta[i] for i in keep], None
        extra = cfg.advantage.refill_extra if cfg.advantage.zero_variance == "drop_refill" else 0
        prompts, metadata = self.prompts.batch(it, n + extra)
        return prompts, metadata, None

    def _refill_masks(self, tree: Tree, rewards: torch.Tensor, stats: dict) -> list[torch.Tensor]:
        """drop_refill: train the first ``prompts_per_iter`` prompts whose rewards vary; the rest are dropped."""
        groups = tree.leaf_group
        varied = []
        for g in groups.unique().tolist():
            r = rewards[(groups == g) & torch.isfinite(rewards)]
            if r.numel() > 1 and float(r.std(correction=0)) >= self.cfg.advantage.zero_std_threshold:
                varied.append(g)
        kept = set(varied[: self.cfg.train.prompts_per_iter])
        stats["groups_dropped"] = int(groups.unique().numel()) - len(kept)
        stats["groups_refilled"] = len([g for g in kept if g >= self.cfg.train.prompts_per_iter])
        return [torch.tensor([int(g) in kept for g in grp.tolist()], dtype=torch.bool) for grp in tree.group]

    # ------------------------------------------------------------------------------------------ update
    def _units(self, tree: Tree, node_adv, masks) -> list[Unit]:
        """Group trained edges by parent state: each distinct parent is evaluated once for all its edges.
        Edges with zero advantage carry no policy gradient and are skipped unless a KL term needs them."""
        keep_zero = self.cfg.train.kl_beta > 0
        units = []
        for d in range(1, tree.num_rounds + 1):
            sel = masks[d]
            if not keep_zero:
                sel = sel & (node_adv[d] != 0)
            children = torch.nonzero(sel).flatten()
            if children.numel() == 0:
                continue
            by_parent: dict[int, list[int]] = {}
            for c, p in zip(children.tolist(), tree.parent[d][children].tolist()):
                by_parent.setdefault(p, []).append(c)
            units += [Unit(d - 1, p, cs) for p, cs in by_parent.items()]
        return units

    def _noise_aware_weights(self, tree: Tree, masks) -> dict[int, float]:
        """TempFlow's per-step loss weight: the transition std sigma_t sqrt(dt) of each trained step, divided
        by its mean over the trained steps (so the weights average 1). Keyed by the parent's grid index."""
        per_step: dict[int, float] = {}
        for r in range(1, tree.num_rounds + 1):
            for c in torch.nonzero(masks[r]).flatten().tolist():
                per_step.setdefault(int(tree.index[r - 1][tree.parent[r][c]]), float(tree.std[r][c]))
        mean = sum(per_step.values()) / max(len(per_step), 1)
        return {k: v / mean for k, v in per_step.items()} if mean > 0 else {k: 1.0 for k in per_step}

    def _sigma_t_weights(self, tree: Tree, masks) -> dict[int, float]:
        """SuperFlow's step-level advantage eta * sigma_t * A as a per-step loss weight (the PPO-clip loss is
        linear in a positive scale of A): sigma_t = a sqrt(sigma / (1 - sigma_r)), sigma_r = sigma_1 at sigma = 1."""
        a, eta = self.cfg.sampler.noise_level, self.cfg.algorithm.tracker.step_eta
        out = {}
        for i in range(tree.num_steps):
            out[i] = eta * flow_grpo_noise_scale(float(tree.sigmas[i]), float(tree.sigmas[1]), a) if eta > 0 else 1.0
        return out

    def _edge_terms(self, tree: Tree, units: list[Unit], cond, node_adv):
        """Forward one micro-batch of parent states; returns per-edge (log_prob, old, adv, kl, step index)."""
        cfg = self.cfg
        dev = self.device
        p_rnd = torch.tensor([u.depth for u in units])  # (U,) round and position of each parent state
        p_pos = torch.tensor([u.parent for u in units])
        x = tree.gather(tree.latents, p_rnd, p_pos).to(dev)  # (U, C, H, W)
        parent_index = tree.gather(tree.index, p_rnd, p_pos)
        sig = tree.sigmas[parent_index].to(dev)
        rows = tree.gather(tree.group, p_rnd, p_pos).to(dev)
        g = cfg.sampler.guidance_scale if cfg.train.cfg else 1.0
        with self.accelerator.autocast():
            v = self.adapter.velocity(x, sig, cond.index(rows), g, self.negative)  # (U, C, H, W)
        v_ref = None
        if cfg.train.kl_beta > 0:
            with torch.no_grad(), self.adapter.reference(), self.accelerator.autocast():
                v_ref = self.adapter.velocity(x, sig, cond.index(rows), g, self.negative)
        # expand parents to their child edges: (E,) per-edge parent slot, child round and position
        pos = torch.tensor([i for i, u in enumerate(units) for _ in u.children], device=dev)
        rnd = torch.tensor([u.depth + 1 for u in units for _ in u.children])
        child = torch.tensor([c for u in units for c in u.children])
        prev = tree.gather(tree.latents, rnd, child).to(dev)
        old = tree.gather(tree.log_prob, rnd, child)
        adv = tree.gather(node_adv, rnd, child).float()
        level = tree.gather(tree.level, rnd, child)
        s = tree.sigmas[parent_index[pos.cpu()]]
        s_next = tree.sigmas[tree.gather(tree.index, rnd, child)]
        logp = torch.empty(len(child), device=dev)
        kl = torch.zeros(len(child), device=dev)
        sigma_at_one = float(tree.sigmas[1])
        for lv in level.unique().tolist():  # the kernels take one noise level per call
            m = (level == lv).nonzero().flatten()
            md = m.to(dev)
            out = kernel_step(cfg.sampler.kernel, x[pos[md]], v[pos[md]], s[m], s_next[m], noise_level=lv,
                              sigma_at_one=sigma_at_one, prev_sample=prev[md], reduce=cfg.train.log_prob_reduce)
            logp[md] = out.log_prob
            if v_ref is not None:
                ref = kernel_step(cfg.sampler.kernel, x[pos[md]], v_ref[pos[md]], s[m], s_next[m], noise_level=lv,
                                  sigma_at_one=sigma_at_one, prev_sample=prev[md])
                kl[md] = gaussian_kl_same_std(out.mean, ref.mean, out.std)
        step_index = parent_index[pos.cpu()]
        return logp, old.to(dev), adv.to(dev).clamp(-cfg.advantage.clip, cfg.advantage.clip), kl, step_index

    def _chunk_items(self, tree: Tree, node_adv, gen: torch.Generator) -> list[list[Unit]]:
        """Chunk-GRPO work items: per leaf path, the selected chunks of its trained transitions, each a list of
        one-edge units (high noise first). Leaves with zero advantage are skipped unless a KL term needs them."""
        from . import chunks as ch

        c = self.cfg.algorithm.chunk
        rounds = [r for r in range(1, tree.num_rounds + 1) if bool(tree.trained[r].any())]
        leaf_round, leaf_pos = tree.leaf_positions()
        items = []
        for lr, lp in zip(leaf_round.tolist(), leaf_pos.tolist()):
            path = [0] * (lr + 1)  # node position at every round of this leaf's path
            path[lr] = lp
            for r in range(lr, 0, -1):
                path[r - 1] = int(tree.parent[r][path[r]])
            if node_adv[lr][lp] == 0 and self.cfg.train.kl_beta == 0:
                continue
            n = len(rounds)
            curve = ch.relative_l1(torch.stack([tree.latents[r][path[r]] for r in [rounds[0] - 1] + rounds]))
            if c.mode == "fixed":
                sizes = ch.fixed_chunks(c.sizes, n)
            elif c.mode == "uniform":
                sizes = ch.uniform_chunks(c.size, n)
            else:
                sizes = ch.adaptive_chunks(curve.tolist(), c.min_size)
            weights = ch.chunk_weights(curve, sizes, c.weight_norm) if c.sampling == "weighted" else None
            n_train = int(len(sizes) * self.cfg.algorithm.timestep_fraction)
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            for j in ch.select_chunks(len(sizes), n_train, gen, weights):
                items.append([Unit(r - 1, path[r - 1], [path[r]]) for r in rounds[starts[j]:starts[j] + sizes[j]]])
        return items

    def update(self, tree: Tree, cond, node_adv, masks, gen: torch.Generator) -> dict:
        """PPO-clip update. Work items are parent units (a parent state with all its trained edges; one loss
        row per edge) or, for chunk_grpo, chunks (several one-edge units; one loss row per chunk, whose ratio is
        the geometric mean of its step ratios)."""
        from .chunks import chunk_log_ratio

        cfg = self.cfg
        self.adapter.transformer.train()
        by_chunk = cfg.algorithm.name == "chunk_grpo"
        items = self._chunk_items(tree, node_adv, gen) if by_chunk else [[u] for u in self._units(tree, node_adv, masks)]
        weights = {"noise_aware": self._noise_aware_weights, "sigma_t": self._sigma_t_weights}.get(
            cfg.algorithm.loss_weight, lambda *_: None)(tree, masks)
        stats = {"trained_edges": sum(len(u.children) for it in items for u in it), "nfe_train": 0, "optimizer_steps": 0,
                 "clipfrac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_std": 0.0, "policy_loss": 0.0,
                 "kl_loss": 0.0, "grad_norm": 0.0, "ratio_max_abs_dev_first_update": 0.0}
        if by_chunk:
            stats["trained_chunks"] = len(items)
        if not items:
            return stats
        ratios, clipped, kls, pls, approx, depths, grad_norms = [], [], [], [], [], [], []
        first = True
        for _ in range(cfg.train.inner_epochs):
            order = torch.randperm(len(items), generator=gen).tolist()
            n_mb = min(cfg.train.num_minibatches, len(order))
            for mb in range(n_mb):
                mb_items = [items[i] for i in order[mb::n_mb]]
                n_rows = len(mb_items) if by_chunk else sum(len(it[0].children) for it in mb_items)
                self.optimizer.zero_grad(set_to_none=True)
                mb_ratios = []
                for group in _micro_batches(mb_items, cfg.train.micro_batch):
                    units = [u for it in group for u in it]
                    logp, old, adv, kl, depth = self._edge_terms(tree, units, cond, node_adv)
                    if by_chunk:  # (E,) edges -> (C,) chunks
                        cid = torch.tensor([k for k, it in enumerate(group) for _ in it], device=logp.device)
                        first_edge = torch.tensor([0] + [len(it) for it in group[:-1]]).cumsum(0).to(logp.device)
                        log_ratio = chunk_log_ratio(logp, old, cid, len(group))
                        loss_r, ratio = ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), adv[first_edge],
                                                      cfg.train.clip_range)
                        kl = chunk_log_ratio(kl, torch.zeros_like(kl), cid, len(group))
                        depth = depth[first_edge.cpu()]
                    else:
                        loss_r, ratio = ppo_clip_loss(logp, old, adv, cfg.train.clip_range)
                    row_loss = loss_r + cfg.train.kl_beta * kl
                    if weights is not None:  # (E,) noise-aware weight of each edge's step
                        row_loss = row_loss * torch.tensor([weights[int(i)] for i in depth], device=row_loss.device)
                    self.accelerator.backward(row_loss.sum() / n_rows)
                    stats["nfe_train"] += len(units)
                    mb_ratios.append(ratio.detach())
                    clipped.append(((ratio.detach() - 1).abs() > cfg.train.clip_range).float())
                    kls.append(kl.detach())
                    pls.append(loss_r.detach())
                    approx.append(0.5 * (logp.detach() - old) ** 2)
                    depths.append(depth)
                if first:
                    stats["ratio_max_abs_dev_first_update"] = float((torch.cat(mb_ratios) - 1).abs().max())
                    first = False
                ratios += mb_ratios
                gn = self.accelerator.clip_grad_norm_(self.params, cfg.train.max_grad_norm)
                grad_norms.append(float(gn))
                self.optimizer.step()
                stats["optimizer_steps"] += 1
                if self.ema is not None and stats["optimizer_steps"] % cfg.train.ema.update_every == 0:
                    self.ema.step(self.params)
        r = torch.cat(ratios).cpu()
        d = torch.cat(depths)
        stats.update({
            "clipfrac": float(torch.cat(clipped).mean()), "approx_kl": float(torch.cat(approx).mean()),
            "ratio_mean": float(r.mean()), "ratio_std": float(r.std(correction=0)),
            "policy_loss": float(torch.cat(pls).mean()), "kl_loss": float(torch.cat(kls).mean()),
            "grad_norm": sum(grad_norms) / len(grad_norms), "mean_abs_log_ratio": float(r.log().abs().mean()),
        })
        for step_idx in d.unique().tolist():
            stats[f"ratio_mean/step{step_idx}"] = float(r[d == step_idx].mean())
        if not math.isfinite(stats["grad_norm"]):
            raise FlowRLError("non-finite gradient norm; lower train.lr or use fp32 (train.mixed_precision=no)")
        return stats

    # ------------------------------------------------------------------------------------------ outputs
    def sample_grid(self, it: int) -> Path:
        cfg = self.cfg
        prompts = cfg.data.sample_prompts or self.prompts.prompts[:4]
        seeds = cfg.data.sample_seeds
        with self.ema_weights():
            images = sample_images(self.adapter, prompts, seeds, self.sigmas_eval(), self.latent_shape,
                                   cfg.sampler.guidance_scale, self.negative, cfg.algorithm.max_batch)
        return report.save_grid(images, len(seeds), self.run_dir / "samples" / f"iter_{it:05d}.png", row_labels=prompts,
                                title=f"iteration {it} (ODE, {cfg.sampler.eval_num_steps} steps; seeds {seeds})")

    def sigmas_eval(self) -> torch.Tensor:
        return sigmas_for(self.cfg, self.adapter, self.cfg.sampler.eval_num_steps)

    def ema_weights(self):
        from contextlib import contextmanager

        @contextmanager
        def swap():
            if self.ema is None:
                yield
                return
            self.ema.store(self.params)
            self.ema.copy_to(self.params)
            try:
                yield
            finally:
                self.ema.restore(self.params)

        return swap()

    def save(self, it: int) -> Path:
        model = self.accelerator.unwrap_model(self.adapter.transformer)
        algo_state = {"last_divergence": self._last_divergence}
        if self.tracker is not None:
            algo_state["tracker"] = self.tracker.state_dict()
        if self.capability is not None:
            algo_state["capability"] = self.capability.state_dict()
        return save_checkpoint(self.run_dir / "checkpoints" / f"iter_{it:05d}", model, self.optimizer, it,
                               lora=self.cfg.train.lora.enabled, ema=self.ema, extra={"algorithm_state": algo_state},
                               keep=self.cfg.log.keep_checkpoints)


def _micro_batches(items: list[list[Unit]], max_units: int):
    """Consecutive groups of work items holding at most ``max_units`` parent states (at least one item)."""
    group, size = [], 0
    for it in items:
        if group and size + len(it) > max_units:
            yield group
            group, size = [], 0
        group.append(it)
        size += len(it)
    if group:
        yield group


def per_reward_advantages(cfg, tree: Tree, scores, weights: dict[str, float], it: int):
    """DanceGRPO's multi-reward rule: A = sum_i w_i A_i, each A_i normalised within its own groups from reward i
    alone (so a reward on a large scale cannot drown a small one). Edges kept by every component stay kept."""
    total, keep = None, None
    for name, values in scores.components.items():
        values = torch.where(scores.invalid, torch.nan, values)  # a leaf invalid in any reward is out of all
        adv, k, _ = edge_advantages(cfg, tree, values, it)
        total = [weights[name] * a for a in adv] if total is None else [t + weights[name] * a for t, a in zip(total, adv)]
        keep = k if keep is None else [x & y for x, y in zip(keep, k)]
    return total, keep


@torch.no_grad()
def sample_images(adapter, prompts: list[str], seeds: list[int], sigmas: torch.Tensor, latent_shape,
                  guidance_scale: float = 1.0, negative=None, max_batch: int = 64) -> torch.Tensor:
    """ODE samples for every (prompt, seed), row-major by prompt: (P * S, 3, H, W) in [0, 1]."""
    adapter.transformer.eval()
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    noise = noise.repeat(len(prompts), 1, 1, 1)  # (P*S, C, H, W), prompt-major
    cond = adapter.encode_prompts([p for p in prompts for _ in seeds])
    plan = RolloutPlan([StepSpec(sde=False) for _ in range(len(sigmas) - 1)], roots_per_prompt=1)
    tree = rollout(adapter, cond, plan, sigmas, latent_shape, kernel="ode", noise_level=0.0,
                   generator=torch.Generator(), max_batch=max_batch, guidance_scale=guidance_scale,
                   negative=negative, initial_noise=noise)
    return adapter.decode(tree.leaves).cpu()
