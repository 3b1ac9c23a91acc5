"""The trainer: setup, then the loop. Each iteration asks the algorithm (flowrl/algorithms) for prompts, a plan
and advantages; the rollout runner rolls out and scores; the algorithm's objective is minimised by the one
optimisation loop (flowrl/optimise.py); callbacks (flowrl/callbacks.py) write metrics, plots and the held-out
evaluation around it.

Every random draw comes from a generator seeded by (train.seed, iteration), so a run is reproducible on the
CPU and ``resume`` continues it exactly.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import report
from .algorithms import AlgorithmContext, make_algorithm
from .attention import attention_kernels
from .callbacks import HeldOutMonitor, MetricsWriter, NoSignalStop, RewardCurvePlot, TrackerLog
from .checkpoint import (checkpoint_is_lora, find_checkpoint, find_resume_checkpoint, load_run_state,
                         save_checkpoint)
from .config import Config
from .distributed import Processes
from .errors import ConfigError, FlowRLError, Stopped
from .models import load_adapter
from .objectives import TrainingParts, UpdateBatch
from .optimise import optimise
from .policy import Policy
from .prompts import PromptSource
from .registry import EVALUATORS, resolve
from .rewards import build_reward_set
from .rollout_runner import RolloutOptions, RolloutRunner
from .rundir import RunFolder
from .sampling import Sampler, kernel_options, peak_memory_mb, resolve_device
from .throughput import rates


class Trainer:
    """Setup plus the loop: loads the model, the algorithm, rewards and the run folder, then runs iterations.

    Args:
        cfg: a loaded config (:func:`flowrl.config.load_config`).
        config_name: names the run folder when ``log.run_name`` is empty (``<config_name>-<time>``).
        run_dir: the run folder itself, instead of ``log.output_dir / log.run_name``.
        callbacks: your own :class:`~flowrl.callbacks.Callback` objects, called after the built-in ones (metrics,
            held-out evaluation, plots, trackers): ``on_train_begin(trainer)``, ``on_iteration_end(trainer, it,
            row)`` (return a string to stop after this iteration) and ``on_train_end(trainer)``.

    Example:
        ```python
        from flowrl.config import load_config
        from flowrl.trainer import Trainer

        run_dir = Trainer(load_config("configs/tiny_jpeg.yaml", ["train.iterations=2"])).train()
        ```
    """

    def __init__(self, cfg: Config, config_name: str = "run", run_dir: str | Path | None = None,
                 callbacks: list | None = None):
        from .sharding import from_launch

        from_launch(cfg)  # an FSDP accelerate config turns train.fsdp on
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.train.seed)
        from .sharding import check_context

        self.procs = Processes(self.device, context=cfg.train.context_parallel.degree)
        check_context(cfg, self.procs.processes)
        if self.procs.world > cfg.sampler.rollout_batches:
            raise ConfigError(f"sampler.rollout_batches={cfg.sampler.rollout_batches}: {self.procs.world} processes each "
                              f"roll out whole prompt batches; set sampler.rollout_batches to at least "
                              f"{self.procs.world} (a multiple of it keeps the processes evenly loaded)")
        # --- everything that can fail on bad input happens before a model loads or the run folder is touched
        self.prompts = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model)
        self.rewards = build_reward_set(cfg.rewards)
        evaluator = resolve(EVALUATORS, cfg.log.eval, "log.eval")() if cfg.log.eval != "none" else None
        self.algorithm = make_algorithm(cfg)
        self.algorithm.check_inputs(self.rewards, self.prompts)
        self.rewards.check_metadata(self.prompts.prompts, self.prompts.metadata)  # e.g. GenEval's clauses
        references = {name: find_checkpoint(path)  # a missing teacher fails before any work
                      for name, path in self.algorithm.reference_checkpoints().items()}
        for name, ckpt in references.items():  # a teacher's layout must fit the student's weights
            if checkpoint_is_lora(ckpt) and not cfg.train.lora.enabled:
                raise ConfigError(f"{cfg.algorithm.name}: the reference {ckpt}{f' ({name})' if name else ''} holds "
                                  "LoRA weights and this run trains every weight (train.lora.enabled=false); give a "
                                  "full checkpoint, or train with LoRA of the teacher's layout")
        if cfg.train.fsdp.enabled:  # the mesh must fit the launch, the options the device
            from .sharding import check_options

            check_options(cfg, self.device, self.procs.processes)
        resume_ckpt = find_resume_checkpoint(cfg, run_dir) if cfg.resume else None
        if resume_ckpt is not None:
            from .sharded_checkpoint import check_resume

            check_resume(resume_ckpt, cfg, self.procs.processes)
        self.start_iteration = 0
        if resume_ckpt is not None:
            self.start_iteration = int(json.loads((resume_ckpt / "state.json").read_text())["iteration"]) + 1
            if cfg.train.iterations <= self.start_iteration:
                raise ConfigError(f"resume: {resume_ckpt} ends at iteration {self.start_iteration} and "
                                  f"train.iterations={cfg.train.iterations}; raise train.iterations to continue the run")
        self.folder = RunFolder(self.procs.broadcast(RunFolder.plan(cfg, config_name, run_dir, resume_ckpt).path))
        self.run_dir = self.folder.path
        if resume_ckpt is not None and cfg.train.micro_batch == "auto":
            self._saved_micro_batch(self.run_dir)  # a damaged micro_batch.json: one line before a model loads
        # --- the model, the policy and what trains it
        if cfg.train.fsdp.enabled:  # only the main process reads the trained transformer's weights
            from .models.common import sharded_loading

            meta = not self.procs.is_main and getattr(cfg.model, "train_expert", "high_noise") == "high_noise"
            with sharded_loading(meta_transformer=meta):
                self.adapter = load_adapter(cfg.model, self.device)
        else:
            self.adapter = load_adapter(cfg.model, self.device)
        self.latent_shape = self.adapter.latent_shape(cfg.model.resolution)
        if cfg.sampler.noise_lowpass > min(self.latent_shape[-2:]):
            raise ConfigError(f"sampler.noise_lowpass={cfg.sampler.noise_lowpass}: the latent is only "
                              f"{self.latent_shape[-2]} x {self.latent_shape[-1]}; use at most {min(self.latent_shape[-2:])}")
        self.policy = Policy(cfg, self.adapter, self.device, self.procs)
        if self.algorithm.keeps_old_policy:
            self.policy.enable_old_policy()
        self.accelerator = self.policy.accelerator
        # ODE sampling on the rollout grid (AdaGRPO's anchors) and on the evaluation grid (grids, held-out)
        self.rollout_sampler = Sampler(cfg, self.adapter, num_steps=cfg.sampler.num_steps)
        self.eval_sampler = Sampler(cfg, self.adapter)
        if self.procs.distributed:  # held-out evaluations and grids: each process samples a share of the prompts
            from .distributed import ShardedSampler

            self.eval_sampler = ShardedSampler(self.eval_sampler, self.procs, equal_shares=cfg.train.fsdp.enabled)
        self.sigmas, self.negative = self.rollout_sampler.sigmas, self.rollout_sampler.negative
        self.context = AlgorithmContext(self.prompts, self.rewards, self.rollout_sampler)
        for name, path in references.items():
            self.policy.load_anchor(path, cfg, name)
        self.algorithm.attach(self.policy, self.context)
        options = kernel_options(cfg)
        self.objective = self.algorithm.make_objective(TrainingParts(
            cfg, self.adapter, self.policy, self.procs, self.sigmas, self.negative, options))
        if cfg.train.update_composition == "rollout" and not hasattr(self.objective, "group_key"):
            raise ConfigError(f"train.update_composition=rollout: {cfg.algorithm.name} does not recompute the "
                              "rollout's transitions; set train.update_composition=micro_batch")
        self.runner = RolloutRunner(self.adapter, self.rewards, self.procs,
                                    RolloutOptions.from_config(cfg, options, self.objective.needs_sampling_mean),
                                    self.sigmas, self.latent_shape, self.negative)
        from .throughput import FlopMeter, device_peak_tflops

        # model FLOPs per phase, each input shape counted once (flowrl/throughput.py): every transformer that runs
        transformers = [self.adapter.transformer, getattr(self.adapter, "frozen_expert", None), self.policy.frozen]
        self.meter = FlopMeter([m for m in transformers if m is not None])
        self.peak_tflops = device_peak_tflops(self.device, cfg.train.peak_tflops)
        if resume_ckpt is not None:
            load_run_state(resume_ckpt, self.policy, self.algorithm, cfg)
        if self.procs.is_main:  # one process writes the run folder
            self.folder.open(cfg, self.start_iteration if resume_ckpt is not None else None,
                             self.accelerator if cfg.log.trackers else None)
        if cfg.train.micro_batch == "auto":
            cfg.train.micro_batch = self._auto_micro_batch(resume_ckpt is not None)
        self.procs.barrier()
        self.callbacks = ([MetricsWriter()] + ([HeldOutMonitor(evaluator, cfg)] if evaluator is not None else [])
                          + [RewardCurvePlot()] + ([TrackerLog()] if cfg.log.trackers else [])
                          + ([NoSignalStop(cfg.log.stop_without_signal)] if cfg.log.stop_without_signal else [])
                          + list(callbacks or []))
        # the work spent so far (a resumed run continues its counts), in every row and curve point
        self.work = {"nfe_rollout_cum": 0, "rollouts_cum": 0, "seconds_cum": 0.0}
        rows = report.read_metrics(self.folder.metrics)
        if rows:
            self.work = {k: rows[-1].get(k, 0) for k in self.work}
        self._stop_signal = None

    @staticmethod
    def _saved_micro_batch(run_dir: Path) -> int | None:
        """The micro-batch a resumed run chose when it started (micro_batch.json), checked: a whole number >= 1,
        or one line saying what to do."""
        path = run_dir / "micro_batch.json"
        if not path.is_file():
            return None
        try:
            value = json.loads(path.read_text(encoding="utf-8"))["micro_batch"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"resume: {path} is unreadable ({type(exc).__name__}); delete it to choose the "
                              "micro-batch again, or set train.micro_batch to the run's number") from exc
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"resume: {path} holds micro_batch={value!r}, not a whole number >= 1; delete it to "
                              "choose the micro-batch again, or set train.micro_batch to the run's number")
        return value

    def _auto_micro_batch(self, resuming: bool) -> int:
        """``train.micro_batch=auto``: the micro-batch chosen when the run started (micro_batch.json in the run
        folder), or, on a new run, the largest that flowrl memory's estimate fits in the device's memory."""
        saved = self._saved_micro_batch(self.run_dir) if resuming else None
        path = self.run_dir / "micro_batch.json"
        if saved is not None:
            return saved
        from .memory import auto_micro_batch

        chosen = None
        if self.procs.is_main:  # the main process chooses, and every process takes its choice
            chosen, why = auto_micro_batch(self.cfg, self.device, self.procs.processes)
            report.atomic_write_bytes(path, json.dumps(why, indent=1).encode())
        return self.procs.broadcast(chosen)

    # ------------------------------------------------------------------------------------------ the loop
    def train(self) -> Path:
        """Run the remaining iterations (all, or after the resumed checkpoint), with evaluations, checkpoints and
        the final held-out evaluation.

        Returns:
            The run folder.
        """
        cfg = self.cfg
        bar = tqdm(range(self.start_iteration, cfg.train.iterations), desc="train",
                   disable=not (cfg.log.progress and self.procs.is_main),
                   initial=self.start_iteration, total=cfg.train.iterations)
        # the reward worker ends with training; the attention kernels hold for every rollout, update and sample
        with self.runner, self._sigterm_stops_after_the_iteration(), attention_kernels(cfg.train.attention_backend):
            if self.start_iteration == 0:
                self.sample_grid(0)
            for callback in self.callbacks:
                callback.on_train_begin(self)
            for it in bar:
                row = self.iteration(it)
                bar.set_postfix(reward=f"{row['reward_mean/total']:.4f}", kl=f"{row['approx_kl']:.1e}")
                stops = [s for s in (c.on_iteration_end(self, it, row) for c in self.callbacks) if s]
                for reason in stops:
                    bar.write(reason)
                last = it == cfg.train.iterations - 1 or bool(stops)
                if last or (cfg.log.sample_every and (it + 1) % cfg.log.sample_every == 0):
                    self.sample_grid(it + 1)
                stop_signal = self.procs.any(self._stop_signal is not None)  # a SIGTERM that reached any process
                if last or stop_signal or (cfg.log.save_every and (it + 1) % cfg.log.save_every == 0):
                    ckpt = self.save(it)
                    stop_signal = self.procs.any(self._stop_signal is not None)  # or one that came during the save
                if stop_signal and not last:
                    bar.close()
                    raise Stopped(f"stopped by SIGTERM after iteration {it}; checkpoint {ckpt}; continue with "
                                  f"resume=latest log.run_name={self.run_dir.name} log.output_dir={self.run_dir.parent}")
                if last:
                    break
        with attention_kernels(cfg.train.attention_backend):
            for callback in self.callbacks:
                callback.on_train_end(self)
        if self._stop_signal is not None:  # it came during the last iteration or its save: the run is whole
            raise Stopped(f"stopped by SIGTERM at the end of the run, which is complete (its last checkpoint: {ckpt})")
        return self.run_dir

    def iteration(self, it: int) -> dict:
        """One rollout, scoring and update.

        Args:
            it: the iteration (seeds every draw with ``train.seed``).
        Returns:
            The iteration's metrics row (what ``metrics.jsonl`` gets).
        """
        cfg, algo = self.cfg, self.algorithm
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + it)
        plan = algo.plan(it, random.Random(cfg.train.seed * 1_000_003 + it), self.sigmas)
        row: dict = {"iteration": it}
        t0 = time.perf_counter()
        self.adapter.transformer.eval()
        prompts, metadata, roots = algo.choose_prompts(self.context, it, gen, row)
        algo.remember_prompts(prompts, metadata)
        cond = self.adapter.encode_prompts(prompts)
        with self.policy.old_weights(), self.meter.phase("rollout"):  # the old policy samples, where one is kept
            tree, scores, timing = self.runner(cond, plan, gen, prompts, metadata, roots)
        row.update(timing)
        t2 = time.perf_counter()
        if not torch.isfinite(scores.total).any():
            raise FlowRLError(f"iteration {it}: every reward was NaN/inf; check the reward function")
        node_adv, keep, adv_stats = algo.reward_advantages(tree, scores, self.rewards.weights, it, prompts)
        algo.observe_rewards(prompts, tree, scores.total)
        masks = algo.select_edges(tree, gen)
        adv_stats["pruned_edges"] = sum(int((m & ~k).sum()) for m, k in zip(masks, keep))
        masks = [m & k for m, k in zip(masks, keep)]
        with self.meter.phase("update"):
            train_stats = optimise(self.objective, UpdateBatch(tree, cond, node_adv, masks), self.policy, self.procs,
                                   cfg.train, gen, it)
        if self.policy.old is not None:
            self.policy.follow_old(algo.old_decay(it))
        algo.observe_update(train_stats)
        t3 = time.perf_counter()
        row.update(scores.summary())
        leaves = int(tree.leaf_group.numel())
        self.work["nfe_rollout_cum"] += tree.nfe + row.get("curriculum/nfe", 0)
        self.work["seconds_cum"] += t3 - t0
        self.work["rollouts_cum"] += leaves + row.get("curriculum/images", 0)  # images scored
        row.update(adv_stats)
        row.update(train_stats)
        row.update({
            "nfe_rollout": tree.nfe, "transformer_calls_rollout": tree.transformer_calls,
            "leaves": leaves, **{f"plan/{k}": v for k, v in plan.accounting().items()},
            **{f"plan/{k}": v for k, v in plan.notes.items()},
            "micro_batch": cfg.train.micro_batch, "seconds_train": t3 - t2,
            "peak_memory_mb": peak_memory_mb(self.device), **self.policy.memory_mb(),
            **rates(self.meter.take(), {"rollout": timing["seconds_rollout"], "update": t3 - t2}, leaves,
                    self.procs.processes, self.peak_tflops),
            **self.work,
        })
        return row

    # ------------------------------------------------------------------------------------------ outputs
    def sample_grid(self, it: int) -> Path | None:
        cfg = self.cfg
        prompts = cfg.data.sample_prompts or self.prompts.prompts[:4]
        seeds = cfg.data.sample_seeds
        with self.policy.ema_weights():
            images = self.eval_sampler(prompts, seeds)
        if not self.procs.is_main:
            return None
        return report.save_grid(images, len(seeds), self.run_dir / "samples" / f"iter_{it:05d}.png", row_labels=prompts,
                                title=f"iteration {it} (ODE, {cfg.sampler.eval_num_steps} steps; seeds {seeds})")

    def save(self, it: int) -> Path:
        """The main process writes the checkpoint (every process holds the same weights and state); the others
        wait for it, so a resume that follows reads it whole. Sharded, every process writes its shards."""
        p = self.policy
        path = self.run_dir / "checkpoints" / f"iter_{it:05d}"
        if p.sharded:
            from .sharded_checkpoint import save_sharded_checkpoint

            return save_sharded_checkpoint(path, p, self.adapter, self.procs, it,
                                           extra={"algorithm_state": self.algorithm.state_dict()},
                                           keep=self.cfg.log.keep_checkpoints)
        if self.procs.is_main:
            path = save_checkpoint(path, self.adapter, p.module, p.optimizer, it, lora=p.lora, ema=p.ema,
                                   extra={"algorithm_state": self.algorithm.state_dict()},
                                   keep=self.cfg.log.keep_checkpoints,
                                   tensors={"old_policy": p.old} if p.old is not None else None)
        self.procs.barrier()
        return path

    @contextmanager
    def _sigterm_stops_after_the_iteration(self):
        """SIGTERM (what schedulers send before killing a job) finishes the current iteration, saves a
        checkpoint and stops; the default handler comes back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum, frame):
            self._stop_signal = signum

        previous = signal.signal(signal.SIGTERM, note)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
