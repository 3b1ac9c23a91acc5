"""The trainer: setup, then the loop. Each iteration asks the algorithm (flowrl/algorithms) for prompts, a plan
and advantages; the rollout runner rolls out and scores; the algorithm's objective is minimised by the one
optimisation loop (flowrl/optimise.py); callbacks (flowrl/callbacks.py) write metrics, plots and the held-out
evaluation around it.

Every random draw comes from a generator seeded by (train.seed, iteration), so a run is reproducible on the
CPU and ``resume`` continues it exactly.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import report
from .algorithms import AlgorithmContext, make_algorithm
from .attention import attention_kernels
from .callbacks import built_in_callbacks
from .candidate_pool import CandidatePool, check_pool
from .checkpoint import load_run_state, reference_checkpoints, resume_checkpoint, resume_start, save_run_checkpoint
from .config import Config, iteration_seed
from .distributed import Processes, ShardedSampler
from .editing import check_prompts_fit, prepend_sources
from .errors import FlowRLError, Stopped
from .guard import check_guard_inputs
from .memory import run_micro_batch, saved_micro_batch
from .models import load_adapter
from .objectives import TrainingParts, UpdateBatch
from .optimise import check_update_composition, optimise
from .policy import Policy
from .prompts import PromptSource
from .registry import EVALUATORS
from .rewards import build_reward_set
from .rollout_runner import RolloutOptions, RolloutRunner
from .rundir import RunFolder
from .sampling import Sampler, check_noise_lowpass, kernel_options, peak_memory_mb, resolve_device, sigmas_for
from .sharding import check_context, check_options, launch_config
from .stop_signal import SigtermNoted
from .throughput import FlopMeter, WorkCounts, device_peak_tflops, rates


def progress_kl(row: dict, train_cfg) -> dict:
    """The progress bar's KL: the measured KL to the reference that the run pays for (``kl_loss``, and at the
    untrained steps ``kl_untrained``) where a KL penalty is on; else PPO's approximate KL between the update's
    policy and the rollout's (0 by construction on the first of one minibatch, so shown only as ``approx_kl``)."""
    out = {}
    if train_cfg.kl_beta > 0 and "kl_loss" in row:
        out["kl_ref"] = f"{row['kl_loss']:.1e}"
    if train_cfg.kl_untrained_beta > 0 and "kl_untrained" in row:
        out["kl_untrained"] = f"{row['kl_untrained']:.1e}"
    if not out and "approx_kl" in row:
        out["approx_kl"] = f"{row['approx_kl']:.1e}"
    return out


class Trainer:
    """Setup plus the loop: loads the model, the algorithm, rewards and the run folder, then runs iterations.

    Args:
        cfg: a loaded config (:func:`flowrl.config.load_config`).
        config_name: names the run folder when ``log.run_name`` is empty (``<config_name>-<time>``).
        run_dir: the run folder itself, instead of ``log.output_dir / log.run_name``.
        callbacks: your own :class:`~flowrl.callbacks.Callback` objects, called after the built-in ones (metrics,
            held-out evaluation, plots, trackers): ``on_train_begin(trainer)``, ``on_iteration_end(trainer, it,
            row)`` (return a string to stop after this iteration) and ``on_train_end(trainer)``.

    Example: ``Trainer(load_config("configs/tiny_jpeg.yaml", ["train.iterations=2"])).train()`` returns the run
    folder; the Python quickstart page goes on to read its metrics and sample from its weights.
    """

    def __init__(self, cfg: Config, config_name: str = "run", run_dir: str | Path | None = None,
                 callbacks: list | None = None):
        self.cfg = cfg = launch_config(cfg)  # under an FSDP accelerate launch, a copy with train.fsdp on
        self.device = resolve_device(cfg.device)
        # LoRA's initial weights, and what a family's transformer draws while it trains, come from torch's global
        # generator: the run seeds it (the same state on every process; a tiny model's builder seeds it again for
        # its own build, and the memory probe, on the main process only, restores it after its own seeding)
        torch.manual_seed(cfg.train.seed)
        self._setup(cfg, config_name, run_dir, callbacks)

    def _setup(self, cfg: Config, config_name: str, run_dir, callbacks) -> None:
        """The run's parts, in the order that refuses bad input before a model loads or the run folder is touched:
        the task (prompts, rewards, algorithm), the run folder, the model and policy, the objective and rollout
        runner, then the run folder opened."""
        # --- everything that can fail on bad input happens before a model loads or the run folder is touched
        self.procs = Processes(self.device, context=cfg.train.context_parallel.degree)
        check_context(cfg, self.procs.processes)
        self.procs.check_rollout_batches(cfg.sampler.rollout_batches)
        self.prompts, self.rewards, evaluator, self.algorithm = self._setup_task()
        references = reference_checkpoints(self.algorithm.reference_checkpoints(), cfg.train.lora.enabled,
                                           cfg.algorithm.name)
        resume_ckpt = resume_checkpoint(cfg, run_dir, self.procs.processes)
        self.start_iteration = 0 if resume_ckpt is None else resume_start(resume_ckpt, cfg.train.iterations)
        self.folder = RunFolder(self.procs.broadcast(RunFolder.plan(cfg, config_name, run_dir, resume_ckpt).path))
        self.run_dir = self.folder.path
        if resume_ckpt is not None and cfg.train.micro_batch == "auto":
            saved_micro_batch(self.run_dir)  # a damaged micro_batch.json: one line before a model loads
        # --- the model (sharded, only the main process reads the trained weights), the policy and what trains it
        self.adapter = load_adapter(cfg.model, self.device, self.procs.is_main if cfg.train.fsdp.enabled else None)
        self.latent_shape = self.adapter.latent_shape(cfg.model.resolution)
        self.policy = self._setup_policy()
        self.accelerator = self.policy.accelerator
        # ODE sampling on the rollout grid (AdaGRPO's anchors), and on the evaluation grid (grids, held-out), where
        # several processes each sample a share of the prompts
        self.rollout_sampler = Sampler(cfg, self.adapter, num_steps=cfg.sampler.num_steps)
        self.eval_sampler = ShardedSampler.shared(Sampler(cfg, self.adapter), self.procs, cfg.train.fsdp.enabled)
        self.sigmas, self.negative = self.rollout_sampler.sigmas, self.rollout_sampler.negative
        self.context = AlgorithmContext(self.prompts, self.rewards, self.rollout_sampler)
        for name, path in references.items():
            self.policy.load_anchor(path, cfg, name)
        self.algorithm.attach(self.policy, self.context)
        options = kernel_options(cfg)
        self.objective = self.algorithm.make_objective(TrainingParts(
            cfg, self.adapter, self.policy, self.procs, self.sigmas, self.negative, options, self.rewards))
        check_update_composition(self.objective, cfg)
        self.runner = RolloutRunner(self.adapter, self.rewards, self.procs,
                                    RolloutOptions.from_config(cfg, options, self.objective.needs_sampling_mean),
                                    self.sigmas, self.latent_shape, self.negative)
        self.pool = None
        if cfg.sampler.pool.size:  # refused in one line, before the run folder, where the plan cannot use it
            first = self.start_iteration
            check_pool(cfg, self.algorithm.plan(first, random.Random(iteration_seed(cfg.train.seed, first)),
                                                self.sigmas), None, self.procs.distributed)
            self.pool = CandidatePool(cfg, self.adapter, sigmas_for(cfg, self.adapter, cfg.sampler.pool.num_steps),
                                      self.latent_shape, self.rewards, self.negative, self.procs)
        # model FLOPs per phase, each input shape counted once (flowrl/throughput.py): every transformer that runs
        self.meter = FlopMeter([self.adapter.transformer, *self.adapter.extra_transformers(),
                                self.policy.frozen])
        self.peak_tflops = device_peak_tflops(self.device, cfg.train.peak_tflops)
        if resume_ckpt is not None:
            load_run_state(resume_ckpt, self.policy, self.algorithm, cfg)
        if self.procs.is_main:  # one process writes the run folder, and one run: a second writer is refused here
            self.folder.lock()
            self.folder.open(cfg, self.start_iteration if resume_ckpt is not None else None,
                             self.accelerator if cfg.log.trackers else None)
        # what is derived lives beside the config, which stays as given: the update's micro-batch, resolved
        self.micro_batch = run_micro_batch(cfg, self.run_dir, self.device, self.procs, resume_ckpt is not None)
        self.train_options = cfg.train.model_copy(update={"micro_batch": self.micro_batch})
        self.procs.barrier()
        self.callbacks = built_in_callbacks(cfg, evaluator) + list(callbacks or [])
        self.work = WorkCounts((report.read_metrics(self.folder.metrics) or [None])[-1])
        self._sigterm = SigtermNoted()

    # ------------------------------------------------------------------------------------------ setup steps
    def _setup_task(self) -> tuple:
        """The prompts, the rewards, the held-out evaluator and the algorithm, each checked against the others (e.g.
        GenEval's clauses), and the FSDP options against the launch and the device."""
        cfg = self.cfg
        prompts = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model)
        rewards = build_reward_set(cfg.rewards)
        evaluator = EVALUATORS.resolve(cfg.log.eval)() if cfg.log.eval != "none" else None
        algorithm = make_algorithm(cfg)
        algorithm.check_inputs(rewards, prompts)
        rewards.check_metadata(prompts.prompts, prompts.metadata)
        check_guard_inputs(cfg)
        check_prompts_fit(cfg, prompts.prompts)
        if cfg.train.fsdp.enabled:
            check_options(cfg, self.device, self.procs.processes)
        return prompts, rewards, evaluator, algorithm

    def _setup_policy(self) -> Policy:
        """The trained weights, their optimizer, and the old policy where the algorithm keeps one."""
        check_noise_lowpass(self.cfg, self.latent_shape)
        policy = Policy(self.cfg, self.adapter, self.device, self.procs)
        if self.algorithm.keeps_old_policy:
            policy.enable_old_policy()
        return policy

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
        with self.runner, self._sigterm, attention_kernels(cfg.train.attention_backend):
            if self.start_iteration == 0:
                self.sample_grid(0)
            for callback in self.callbacks:
                callback.on_train_begin(self)
            for it in bar:
                row = self.iteration(it)
                bar.set_postfix({"reward": f"{row['reward_mean/total']:.4f}", **progress_kl(row, cfg.train)})
                stops = [s for s in (c.on_iteration_end(self, it, row) for c in self.callbacks) if s]
                for reason in stops:
                    bar.write(reason)
                last = it == cfg.train.iterations - 1 or bool(stops)
                if last or (cfg.log.sample_every and (it + 1) % cfg.log.sample_every == 0):
                    self.sample_grid(it + 1)
                stop_signal = self.procs.any(self._sigterm.received is not None)  # a SIGTERM that reached any process
                if last or stop_signal or (cfg.log.save_every and (it + 1) % cfg.log.save_every == 0):
                    ckpt = self.save(it)
                    stop_signal = self.procs.any(self._sigterm.received is not None)  # or one that came during the save
                if stop_signal and not last:
                    bar.close()
                    raise Stopped(f"stopped by SIGTERM after iteration {it}; checkpoint {ckpt}; continue with "
                                  f"resume=latest log.run_name={self.run_dir.name} log.output_dir={self.run_dir.parent}")
                if last:
                    break
        with attention_kernels(cfg.train.attention_backend):
            for callback in self.callbacks:
                callback.on_train_end(self)
        self.folder.unlock()
        if self._sigterm.received is not None:  # it came during the last iteration or its save: the run is whole
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
        gen = torch.Generator().manual_seed(iteration_seed(cfg.train.seed, it))
        plan = algo.plan(it, random.Random(iteration_seed(cfg.train.seed, it)), self.sigmas)
        row: dict = {"iteration": it}
        t0 = time.perf_counter()
        self.adapter.transformer.eval()
        prompts, metadata, roots = algo.choose_prompts(self.context, it, gen, row)
        algo.remember_prompts(prompts, metadata)
        cond = self.adapter.encode_prompts(prompts)
        # the old policy samples, where one is kept and the algorithm samples with it at this iteration
        with self.policy.old_weights(algo.samples_with_old_policy(it)), self.meter.phase("rollout"):
            noise = None
            if self.pool is not None:  # the cheap pass chooses the initial noises (its evaluations count as rollout)
                check_pool(cfg, plan, roots, self.procs.distributed)
                noise, pool_stats = self.pool(cond, gen, prompts, metadata,
                                              roots or [plan.roots_per_prompt] * len(prompts),
                                              self.runner.my_batches(len(prompts)))
                row.update(pool_stats)
            tree, scores, timing = self.runner(cond, plan, gen, prompts, metadata, roots, initial_noise=noise)
        row.update(timing)
        if self.pool is not None:
            row.update(self.pool.agreement(tree, scores.total))
            row["pool/seconds_share"] = row["pool/seconds"] / (row["pool/seconds"] + timing["seconds_rollout"])
        t2 = time.perf_counter()
        if not torch.isfinite(scores.total).any():
            raise FlowRLError(f"iteration {it}: every reward was NaN/inf; check the reward function")
        node_adv, keep, adv_stats = algo.reward_advantages(tree, scores, self.rewards.weights, it, prompts)
        algo.observe_rewards(prompts, tree, scores.total)
        masks = algo.select_edges(tree, gen)
        adv_stats["pruned_edges"] = sum(int((m & ~k).sum()) for m, k in zip(masks, keep))
        masks = [m & k for m, k in zip(masks, keep)]
        with self.meter.phase("update"):
            batch = UpdateBatch(tree, cond, node_adv, masks, prompts, metadata, algo.preference_pairs(tree, scores))
            train_stats = optimise(self.objective, batch, self.policy, self.procs, self.train_options, gen, it)
        if self.policy.old is not None:
            self.policy.follow_old(algo.old_decay(it))
        algo.observe_update(train_stats)
        t3 = time.perf_counter()
        leaves = int(tree.leaf_group.numel())
        evaluations = self.meter.take_rows()  # every sample through a transformer forward, per phase
        row.update({**scores.summary(), **adv_stats, **train_stats,
            "nfe_rollout": tree.nfe, "transformer_calls_rollout": tree.transformer_calls,
            "leaves": leaves, **{f"plan/{k}": v for k, v in plan.accounting().items()},
            **{f"plan/{k}": v for k, v in plan.notes.items()},
            "micro_batch": self.micro_batch, "seconds_train": t3 - t2,
            "peak_memory_mb": peak_memory_mb(self.device), **self.policy.memory_mb(),
            **rates(self.meter.take(), {"rollout": timing["seconds_rollout"], "update": t3 - t2}, leaves,
                    self.procs.processes, self.peak_tflops),
            # the curriculum's extra rollouts (AdaGRPO) count as work too
            "evaluations_rollout": evaluations.get("rollout", 0), "evaluations_update": evaluations.get("update", 0),
            **self.work.add(tree.nfe + row.get("curriculum/nfe", 0), leaves + row.get("curriculum/images", 0),
                            t3 - t0, sum(evaluations.values())),
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
        shown = prepend_sources(images, prompts, len(seeds))  # edit requests: the source first in each row
        note = "; first column: the source" if shown is not images else ""
        return report.save_grid(shown, shown.shape[0] // len(prompts), self.run_dir / "samples" / f"iter_{it:05d}.png",
                                row_labels=prompts,
                                title=f"iteration {it} (ODE, {cfg.sampler.eval_num_steps} steps; seeds {seeds}{note})")

    def save(self, it: int) -> Path:
        """Iteration ``it``'s checkpoint, complete on disk for every process when this returns."""
        return save_run_checkpoint(self.run_dir, it, self.policy, self.adapter, self.procs,
                                   self.algorithm.state_dict(), self.cfg.log.keep_checkpoints)
