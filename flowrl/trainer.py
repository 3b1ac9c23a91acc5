"""The GRPO trainer: the loop and nothing else. Each iteration asks the algorithm (flowrl/algorithms) for
prompts, a plan, advantages, edges and work items; rolls out and scores; and takes clipped policy steps.

Every random draw comes from a generator seeded by (train.seed, iteration), so a run is reproducible on the
CPU and ``resume`` continues it exactly.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import report
from .algorithms import AlgorithmContext, Unit, make_algorithm
from .checkpoint import (
    find_checkpoint,
    latest_checkpoint,
    load_full_into,
    load_lora_into,
    load_trainer_state,
    save_checkpoint,
)
from .config import Config
from .distributed import Processes
from .engine import Tree, kernel_options, packed_rollouts
from .errors import ConfigError, FlowRLError, Stopped
from .losses import gaussian_kl_same_std, guard_log_ratio, kl_std, ppo_clip_loss
from .models import load_adapter
from .policy import Policy
from .rundir import RunFolder
from .prompts import PromptSource
from .registry import EVALUATORS, resolve
from .rewards import build_reward_set
from .rewards.registry import RewardScores
from .samplers.kernels import step as kernel_step
from .sampling import Sampler, peak_memory_mb, resolve_device


class Trainer:
    def __init__(self, cfg: Config, config_name: str = "run", run_dir: str | Path | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.train.seed)
        self.procs = Processes(self.device)
        if self.procs.world > cfg.sampler.rollout_batches:
            raise ConfigError(f"sampler.rollout_batches={cfg.sampler.rollout_batches}: {self.procs.world} processes each "
                              f"roll out whole prompt batches; set sampler.rollout_batches to at least "
                              f"{self.procs.world} (a multiple of it keeps the processes evenly loaded)")
        # --- everything that can fail on bad input happens before a model loads or the run folder is touched
        self.prompts = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model)
        self.rewards = build_reward_set(cfg.rewards)
        self.evaluator = resolve(EVALUATORS, cfg.log.eval, "log.eval")() if cfg.log.eval != "none" else None
        self.algorithm = make_algorithm(cfg)
        resume_ckpt = self._find_resume(cfg, run_dir) if cfg.resume else None
        self.start_iteration = 0
        if resume_ckpt is not None:
            self.start_iteration = int(json.loads((resume_ckpt / "state.json").read_text())["iteration"]) + 1
            if cfg.train.iterations <= self.start_iteration:
                raise ConfigError(f"resume: {resume_ckpt} ends at iteration {self.start_iteration} and "
                                  f"train.iterations={cfg.train.iterations}; raise train.iterations to continue the run")
        self.folder = RunFolder(self.procs.broadcast(RunFolder.plan(cfg, config_name, run_dir, resume_ckpt).path))
        self.run_dir, self.metrics_path, self.curve_path = self.folder.path, self.folder.metrics, self.folder.curve
        # --- the model and the policy
        self.adapter = load_adapter(cfg.model, self.device)
        self.latent_shape = self.adapter.latent_shape(cfg.model.resolution)
        if cfg.sampler.noise_lowpass > min(self.latent_shape[-2:]):
            raise ConfigError(f"sampler.noise_lowpass={cfg.sampler.noise_lowpass}: the latent is only "
                              f"{self.latent_shape[-2]} x {self.latent_shape[-1]}; use at most {min(self.latent_shape[-2:])}")
        self.policy = Policy(cfg, self.adapter, self.device)
        if self.algorithm.keeps_old_policy:
            self.policy.enable_old_policy()
        self.accelerator = self.policy.accelerator
        # ODE sampling on the rollout grid (AdaGRPO's anchors) and on the evaluation grid (grids, held-out)
        self.rollout_sampler = Sampler(cfg, self.adapter, num_steps=cfg.sampler.num_steps)
        self.eval_sampler = Sampler(cfg, self.adapter)
        if self.procs.distributed:  # held-out evaluations and grids: each process samples a share of the prompts
            from .distributed import ShardedSampler

            self.eval_sampler = ShardedSampler(self.eval_sampler, self.procs)
        self.sigmas, self.negative = self.rollout_sampler.sigmas, self.rollout_sampler.negative
        self.context = AlgorithmContext(self.prompts, self.rewards, self.rollout_sampler)
        if resume_ckpt is not None:
            self._load(resume_ckpt)
        if self.procs.is_main:  # one process writes the run folder
            self.folder.open(cfg, self.start_iteration if resume_ckpt is not None else None,
                             self.accelerator if cfg.log.trackers else None)
        self.procs.barrier()
        self._cumulative = {"nfe_rollout_cum": 0, "rollouts_cum": 0, "seconds_cum": 0.0}
        rows = report.read_metrics(self.metrics_path)
        if rows:
            self._cumulative = {k: rows[-1].get(k, 0) for k in self._cumulative}
        self._stop_signal = None
        self.best = self._read_best()  # the held-out curve's best point, the same on every process

    # ------------------------------------------------------------------------------------------ resume
    @staticmethod
    def _find_resume(cfg: Config, run_dir) -> Path:
        if cfg.resume == "latest":
            base = Path(run_dir) if run_dir else (Path(cfg.log.output_dir) / cfg.log.run_name if cfg.log.run_name else None)
            if base is None:
                raise ConfigError("resume=latest needs log.run_name (the run to continue)")
            ckpt = latest_checkpoint(base)
            if ckpt is None:
                raise ConfigError(f"resume=latest: no intact checkpoint under {base}/checkpoints")
            return ckpt
        try:
            return find_checkpoint(cfg.resume)
        except FlowRLError as exc:
            raise ConfigError(f"resume: {exc}") from exc

    def _load(self, ckpt: Path) -> None:
        (load_lora_into if self.cfg.train.lora.enabled else load_full_into)(self.policy.module, ckpt, self.cfg)
        state = load_trainer_state(ckpt)
        try:
            self.policy.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise FlowRLError(f"{ckpt}: its optimizer state does not fit this model ({str(exc).splitlines()[0]}); "
                              "resume with the run's own config.yaml") from exc
        if self.policy.ema is not None and "ema" in state:
            self.policy.ema.load_state_dict(state["ema"])
        if self.policy.old is not None and "old_policy" in state:
            self.policy.old = [t.to(p.device) for t, p in zip(state["old_policy"], self.policy.params)]
        self.algorithm.load_state_dict(json.loads((ckpt / "state.json").read_text()).get("algorithm_state", {}))

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

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> Path:
        cfg = self.cfg
        bar = tqdm(range(self.start_iteration, cfg.train.iterations), desc="train",
                   disable=not (cfg.log.progress and self.procs.is_main),
                   initial=self.start_iteration, total=cfg.train.iterations)
        if self.start_iteration == 0:
            self.sample_grid(0)
            if self.evaluator is not None:
                self.evaluate("before")
            self.curve_point(0)
        with self._sigterm_stops_after_the_iteration():
            for it in bar:
                row = self.iteration(it)
                stop_early = None
                if cfg.log.eval_every and ((it + 1) % cfg.log.eval_every == 0 or it == cfg.train.iterations - 1):
                    stop_early = self.curve_point(it + 1)
                bar.set_postfix(reward=f"{row['reward_mean/total']:.4f}", kl=f"{row['approx_kl']:.1e}")
                last = it == cfg.train.iterations - 1 or stop_early is not None
                if stop_early:
                    bar.write(stop_early)
                    self.best["stopped_early"] = stop_early
                    self._write_best()
                if last or (cfg.log.sample_every and (it + 1) % cfg.log.sample_every == 0):
                    self.sample_grid(it + 1)
                stop_signal = self.procs.any(self._stop_signal is not None)  # a SIGTERM that reached any process
                if last or stop_signal or (cfg.log.save_every and (it + 1) % cfg.log.save_every == 0):
                    ckpt = self.save(it)
                if stop_signal and not last:
                    bar.close()
                    raise Stopped(f"stopped by SIGTERM after iteration {it}; checkpoint {ckpt}; continue with "
                                  f"resume=latest log.run_name={self.run_dir.name} log.output_dir={self.run_dir.parent}")
                if last:
                    break
        self.restore_best()
        if self.procs.is_main:
            report.plot_reward_curve(self.run_dir)
        if self.evaluator is not None and self.start_iteration < cfg.train.iterations:
            self.evaluate("after")
            if self.procs.is_main:
                report.plot_reward_curve(self.run_dir)  # again, with the held-out panel
        if cfg.log.trackers:
            self.accelerator.end_training()
        return self.run_dir

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, when: str) -> dict:
        """The held-out evaluation (log.eval) of the (EMA) policy, written to eval.json, and a before | after
        grid of the evaluator's chosen samples. Every process samples its share; the main process writes."""
        with self.policy.ema_weights():
            result, grid, labels = self.evaluator(self.eval_sampler, self.cfg.log.eval_seeds, grid=True)
        if not self.procs.is_main:
            return result
        path = self.run_dir / "eval.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[when] = result
        report.atomic_write_bytes(path, json.dumps(data, indent=1).encode())
        before_path = self.run_dir / "heldout_before.pt"
        if when == "before":
            torch.save(grid, before_path)
        elif before_path.is_file():
            before = torch.load(before_path, weights_only=True)
            cols = grid.shape[0] // len(labels)
            b = data.get("before", {})
            title = (f"held-out prompts: left before | right after   all-correct {b.get('all', float('nan')):.2f} -> "
                     f"{result.get('all', float('nan')):.2f}")
            if "background_noise" in result:  # reward hacking in miniature: texture the checker ignores
                title += f"   background noise {b.get('background_noise', float('nan')):.1f} -> {result['background_noise']:.1f}"
            report.save_grid(report.side_by_side(before, grid, cols), 2 * cols, self.run_dir / "before_after.png",
                             row_labels=labels, title=title)
        return result

    def curve_point(self, done: int) -> str | None:
        """One held-out point (the first ``log.eval_curve_seeds`` evaluation seeds) appended to eval_curve.jsonl
        with the work spent so far, so runs can be compared per rollout and per training second. A new best
        (``log.best_metric``) is kept in checkpoints/best (``log.keep_best``); returns why the run should stop
        early (``log.early_stop_*``), else None."""
        cfg = self.cfg
        if self.evaluator is None or not cfg.log.eval_every:
            return None
        with self.policy.ema_weights():  # every process samples its share of the prompts and reads every image
            result = self.evaluator(self.eval_sampler, cfg.log.eval_seeds[: cfg.log.eval_curve_seeds])
        result = self.procs.broadcast(result)  # the main process's numbers decide everywhere
        value = result.get(cfg.log.best_metric)
        if not isinstance(value, (int, float)):
            numbers = sorted(k for k, v in result.items() if isinstance(v, (int, float)))
            raise ConfigError(f"log.best_metric: the {cfg.log.eval} evaluator has no number "
                              f"{cfg.log.best_metric!r}; use one of {', '.join(numbers)}")
        if self.best is None or value > self.best["value"]:
            self.best = {"iteration": done, "metric": cfg.log.best_metric, "value": value, "since": 0}
            if cfg.log.keep_best and self.procs.is_main:  # the weights just evaluated (EMA where enabled)
                p = self.policy
                with p.ema_weights():
                    save_checkpoint(self.run_dir / "checkpoints" / "best", self.adapter, p.module, p.optimizer,
                                    done - 1, lora=p.lora, extra={"best": self.best}, keep=cfg.log.keep_checkpoints)
        else:
            self.best["since"] += 1
        best = self.best
        self._write_best()
        if self.procs.is_main:
            report.append_metrics(self.curve_path, {"iteration": done, **self._cumulative, **result})
        name = cfg.log.best_metric
        if cfg.log.early_stop_drop and best["value"] - value > cfg.log.early_stop_drop:
            return (f"stopping early at iteration {done}: held-out {name} {value:.4f} fell more than "
                    f"{cfg.log.early_stop_drop} below its best {best['value']:.4f} (iteration {best['iteration']})")
        if cfg.log.early_stop_patience and best["since"] >= cfg.log.early_stop_patience:
            return (f"stopping early at iteration {done}: no new best held-out {name} in {best['since']} curve points "
                    f"(best {best['value']:.4f} at iteration {best['iteration']})")
        return None

    def _read_best(self) -> dict | None:
        path = self.run_dir / "best.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _write_best(self) -> None:
        if self.procs.is_main:
            report.atomic_write_bytes(self.run_dir / "best.json", json.dumps(self.best, indent=1).encode())

    def restore_best(self) -> None:
        """End the run with the best curve point's weights when they beat the last point's (``log.keep_best``):
        they become the policy (EMA reset to them) for the 'after' evaluation, and the run says so."""
        self.procs.barrier()  # the main process has written checkpoints/best
        best, ckpt = self.best, self.run_dir / "checkpoints" / "best"
        if not (self.cfg.log.keep_best and best and ckpt.is_dir()):
            return
        last = report.read_metrics(self.curve_path)[-1]
        if last["iteration"] == best["iteration"] or last[best["metric"]] >= best["value"]:
            return  # a last point that ties the best keeps the trained weights: the earlier ones do not beat it
        (load_lora_into if self.policy.lora else load_full_into)(self.policy.module, ckpt, self.cfg)
        self.policy.reset_ema()
        self.best["ended_with"] = True  # `--checkpoint RUN_DIR` (sample, eval, export) then means these weights
        self._write_best()
        if self.procs.is_main:
            print(f"the run ends with its best held-out weights: {best['metric']} {best['value']:.4f} at iteration "
                  f"{best['iteration']} (last point {last[best['metric']]:.4f} at iteration {last['iteration']}); they "
                  f"are in {ckpt}", file=sys.stderr)

    # ------------------------------------------------------------------------------------------ one iteration
    def iteration(self, it: int) -> dict:
        cfg, algo = self.cfg, self.algorithm
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + it)
        plan = algo.plan(it, random.Random(cfg.train.seed * 1_000_003 + it), self.sigmas)
        row: dict = {"iteration": it}
        t0 = time.perf_counter()
        self.adapter.transformer.eval()
        prompts, metadata, roots = algo.choose_prompts(self.context, it, gen, row)
        cond = self.adapter.encode_prompts(prompts)
        with self.policy.old_weights():  # the old policy samples, where the algorithm keeps one
            tree, scores, timing = self._rollout_and_score(cond, plan, gen, prompts, metadata, roots)
        row.update(timing)
        t2 = time.perf_counter()
        if not torch.isfinite(scores.total).any():
            raise FlowRLError(f"iteration {it}: every reward was NaN/inf; check the reward function")
        node_adv, keep, adv_stats = algo.advantages(tree, scores.total, it, prompts)
        if cfg.advantage.combine == "per_reward" and len(self.rewards.items) > 1:
            node_adv, keep = per_reward_advantages(algo, tree, scores, self.rewards.weights, it)
        algo.observe_rewards(prompts, tree, scores.total)
        masks = algo.select_edges(tree, gen)
        adv_stats["pruned_edges"] = sum(int((m & ~k).sum()) for m, k in zip(masks, keep))
        masks = [m & k for m, k in zip(masks, keep)]
        if algo.forward_process:
            train_stats = self.forward_process_update(tree, cond, node_adv, gen)
        else:
            train_stats = self.update(tree, cond, node_adv, masks, gen)
        if self.policy.old is not None:
            self.policy.follow_old(algo.old_decay(it))
        algo.observe_update(train_stats)
        t3 = time.perf_counter()
        for name, values in [("total", scores.total)] + list(scores.components.items()):
            ok = values[torch.isfinite(values)]
            row[f"reward_mean/{name}"] = float(ok.mean()) if ok.numel() else float("nan")
            row[f"reward_std/{name}"] = float(ok.std(correction=0)) if ok.numel() else float("nan")
        leaves = int(tree.leaf_group.numel())
        self._cumulative["nfe_rollout_cum"] += tree.nfe + row.get("curriculum/nfe", 0)
        self._cumulative["seconds_cum"] += t3 - t0
        self._cumulative["rollouts_cum"] += leaves + row.get("curriculum/images", 0)  # images scored
        row.update(adv_stats)
        row.update(train_stats)
        row.update({
            "nfe_rollout": tree.nfe, "transformer_calls_rollout": tree.transformer_calls,
            "leaves": leaves, **{f"plan/{k}": v for k, v in plan.accounting().items()},
            **{f"plan/{k}": v for k, v in plan.notes.items()},
            "seconds_train": t3 - t2,
            "peak_memory_mb": peak_memory_mb(self.device), **self._cumulative,
        })
        if self.procs.is_main:
            report.append_metrics(self.metrics_path, row)
            if (it + 1) % 5 == 0 or it == 0:
                report.plot_reward_curve(self.run_dir)
        if cfg.log.trackers:  # accelerate logs from the main process only
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=it)
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

        # One batch draws from the iteration's generator; several draw each from its own generator forked from it,
        # so a batch's tree does not depend on which process rolls it out (batches are dealt round-robin).
        gens = [gen] if k == 1 else [torch.Generator().manual_seed(int(s))
                                     for s in torch.randint(1 << 62, (k,), generator=gen)]
        if cfg.sampler.noise_device == "device" and self.device.type != "cpu":  # noise drawn where it is used
            gens = [torch.Generator(self.device).manual_seed(int(torch.randint(1 << 62, (1,), generator=g)))
                    for g in gens]
        mine = self.procs.share(list(range(k)))
        trees, pending = {}, {}
        t_rollout = 0.0
        options = dict(kernel=cfg.sampler.kernel, noise_level=cfg.sampler.noise_level, max_batch=cfg.sampler.max_batch,
                       guidance_scale=cfg.sampler.guidance_scale, negative=self.negative,
                       log_prob_reduce=cfg.train.log_prob_reduce, kernel_options=kernel_options(cfg),
                       store_mean=cfg.train.grpo_guard)

        def done(j, part):  # decode batch j's leaves and score them (in the reward thread with async_reward)
            images = self.adapter.decode(part.leaves)
            rows = (part.leaf_group + bounds[j]).tolist()
            pending[j] = self._reward_pool.submit(score, images, rows) if use_async else score(images, rows)
            trees[j] = part

        # My batches through one driver: packed, each starts `stagger` rounds after the one before and shares its
        # calls; unpacked, each starts when the one before has finished (a stagger no plan reaches).
        stagger = (cfg.sampler.pack_stagger or math.ceil(plan.num_steps / max(len(mine), 1))
                   if cfg.sampler.pack_rollouts else sys.maxsize)
        start = time.perf_counter()
        packed_rollouts(self.adapter, cond, [(bounds[j], bounds[j + 1], gens[j]) for j in mine], plan, self.sigmas,
                        self.latent_shape, stagger=stagger, roots=roots, on_done=lambda n, part: done(mine[n], part),
                        **options)
        t_rollout = time.perf_counter() - start  # with the decodes (and the scoring, taken off below where sync)
        trees = [trees[j] for j in mine]
        pending = [pending[j] for j in mine]
        start = time.perf_counter()
        results = [p.result() if use_async else p for p in pending]
        wait = time.perf_counter() - start if use_async else sum(r[1] for r in results)
        scored = sum(r[1] for r in results)
        if not use_async:  # the scoring ran inside the rollout loop
            t_rollout -= scored
        if self.procs.distributed:  # every process gets every batch's tree and scores, in batch order
            dev = self.adapter.device  # (a process may hold no batch when an iteration has fewer prompts)
            parts = self.procs.gather([(j, t.to("cpu"), r[0]) for j, t, r in zip(mine, trees, results)])
            parts.sort(key=lambda part: part[0])
            trees = [t.to(dev) for _, t, _ in parts]
            results = [(scores, 0.0) for _, _, scores in parts]
        return Tree.concat(trees), RewardScores.concat([r[0] for r in results]), {
            "seconds_rollout": t_rollout, "seconds_reward": scored, "seconds_reward_wait": wait,
            "seconds_reward_hidden": max(0.0, scored - wait), "rollout_batches": k}

    # ------------------------------------------------------------------------------------------ update
    def _edge_terms(self, tree: Tree, units: list[Unit], cond, node_adv):
        """Forward one micro-batch of parent states; returns per-edge (E,) log_prob, old, adv, kl, step index."""
        cfg = self.cfg
        dev = self.device
        p_rnd = torch.tensor([u.depth for u in units])  # (U,) round and position of each parent state
        p_pos = torch.tensor([u.parent for u in units])
        x = tree.gather(tree.latents, p_rnd, p_pos).to(dev)  # (U, *latent)
        parent_index = tree.gather(tree.index, p_rnd, p_pos)
        sig = tree.sigmas[parent_index].to(dev)
        rows = tree.gather(tree.group, p_rnd, p_pos).to(dev)
        v, v_ref = self._velocities(x, sig, cond.index(rows), cfg.train.kl_beta > 0)  # (U, *latent) each
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
        adv = adv.to(dev).clamp(-cfg.advantage.clip, cfg.advantage.clip)
        options = kernel_options(cfg)
        sigma_at_one = float(tree.sigmas[1])
        fused = self._fused_objective()
        loss_and_ratio = (torch.empty(len(child), device=dev), torch.empty(len(child), device=dev)) if fused else None
        for lv in level.unique().tolist():  # the kernels take one noise level per call
            m = (level == lv).nonzero().flatten()
            md = m.to(dev)
            if fused:  # log-prob, ratio, clip and KL in one compiled function
                loss_m, ratio_m, logp[md], kl[md] = fused(
                    x[pos[md]], v[pos[md]], s[m].to(dev), s_next[m].to(dev), prev[md], old[m].to(dev), adv[md],
                    None if v_ref is None else v_ref[pos[md]], kernel=cfg.sampler.kernel, noise_level=lv,
                    sigma_at_one=sigma_at_one, clip_range=cfg.train.clip_range, reduce=cfg.train.log_prob_reduce,
                    kl_std_mode=cfg.train.kl_std, kernel_options=options)
                loss_and_ratio[0][md], loss_and_ratio[1][md] = loss_m, ratio_m
                continue
            out = kernel_step(cfg.sampler.kernel, x[pos[md]], v[pos[md]], s[m], s_next[m], noise_level=lv,
                              sigma_at_one=sigma_at_one, prev_sample=prev[md], reduce=cfg.train.log_prob_reduce,
                              **options)
            logp[md] = out.log_prob
            if cfg.train.grpo_guard:  # the normalised log-ratio, carried as old + (logp - old + bias) * s
                mean_old = tree.gather(tree.mean, rnd[m], child[m]).to(dev)
                logp[md] = old[m].to(dev) + guard_log_ratio(out.log_prob, old[m].to(dev), out.mean, mean_old, out.std)
            if v_ref is not None:
                kl[md] = self._kl_to_reference(out, x[pos[md]], v_ref[pos[md]], s[m], s_next[m], prev[md], lv,
                                               sigma_at_one, options)
        step_index = parent_index[pos.cpu()]
        return logp, old.to(dev), adv, kl, step_index, loss_and_ratio

    def untrained_states(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """(round, position) of every child node whose edge the plan leaves untrained (an ODE step of the
        rollout): its parent is the state, the child's grid index the step's end. (K,), (K,)."""
        rounds, pos = [], []
        for r in range(1, tree.num_rounds + 1):
            p = torch.nonzero(~tree.trained[r]).flatten()
            rounds.append(torch.full_like(p, r))
            pos.append(p)
        return torch.cat(rounds), torch.cat(pos)

    def _untrained_kl(self, tree: Tree, cond, rounds: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
        """Per state (K,): the KL between the trained and the reference policy's full-rank SDE transitions at
        sampler.noise_level from the parents of the given untrained edges (train.kl_untrained_beta)."""
        cfg, dev = self.cfg, self.device
        parent = tree.gather(tree.parent, rounds, child)
        x = tree.gather(tree.latents, rounds - 1, parent).to(dev)  # (K, *latent)
        s = tree.sigmas[tree.gather(tree.index, rounds - 1, parent)]
        s_next = tree.sigmas[tree.gather(tree.index, rounds, child)]
        rows = tree.gather(tree.group, rounds - 1, parent).to(dev)
        v, v_ref = self._velocities(x, s.to(dev), cond.index(rows), True)  # (K, *latent) each
        nxt = tree.gather(tree.latents, rounds, child).to(dev)  # scored only because the kernel asks for a sample
        level, sigma_at_one = cfg.sampler.noise_level, float(tree.sigmas[1])
        out = kernel_step(cfg.sampler.kernel, x, v, s, s_next, noise_level=level, sigma_at_one=sigma_at_one,
                          prev_sample=nxt)
        return self._kl_to_reference(out, x, v_ref, s, s_next, nxt, level, sigma_at_one, {})  # full rank: no options

    def _velocities(self, x: torch.Tensor, sigma: torch.Tensor, cond, with_reference: bool):
        """(v, v_ref or None) at the states x (N, *latent): the policy's velocity with its graph, and the KL
        reference's without one. The reference goes first: an EMA reference swaps the weights in place, which must
        not touch v's graph."""
        g = self.cfg.sampler.guidance_scale if self.cfg.train.cfg else 1.0
        v_ref = None
        if with_reference:
            with torch.no_grad(), self.policy.reference(), self.accelerator.autocast():
                v_ref = self.adapter.velocity(x, sigma, cond, g, self.negative)
        with self.accelerator.autocast():
            v = self.adapter.velocity(x, sigma, cond, g, self.negative)
        return v, v_ref

    def _kl_to_reference(self, out, x, v_ref, s, s_next, prev, noise_level: float, sigma_at_one: float,
                         options: dict) -> torch.Tensor:
        """Per transition (N,): the Gaussian KL between the policy's step ``out`` (kernel_step's result from x) and
        the reference's step with velocity v_ref, over the same std (train.kl_std)."""
        cfg, dev = self.cfg, self.device
        ref = kernel_step(cfg.sampler.kernel, x, v_ref, s, s_next, noise_level=noise_level, sigma_at_one=sigma_at_one,
                          prev_sample=prev, **options)
        std = kl_std(cfg.train.kl_std, out.std, s.to(dev), s_next.to(dev))
        return gaussian_kl_same_std(out.mean, ref.mean, std)

    def _fused_objective(self):
        """The compiled per-edge objective where ``train.fused_loss`` asks for it and the rows are edges (GRPO-Guard
        rewrites the log-ratio, so it keeps the eager path); else None."""
        cfg = self.cfg
        if not (cfg.train.fused_loss and self.algorithm.per_edge_rows and not cfg.train.grpo_guard):
            return None
        from .losses import compiled_edge_objective

        return compiled_edge_objective()

    def update(self, tree: Tree, cond, node_adv, masks, gen: torch.Generator) -> dict:
        """PPO-clip update over the algorithm's work items (a parent state with its trained edges, or a chunk
        of one-edge units); the algorithm turns per-edge log-ratios into loss rows (per edge or per chunk)."""
        cfg, algo = self.cfg, self.algorithm
        opt = self.policy.optimizer
        self.adapter.transformer.train()
        items = algo.work_items(tree, node_adv, masks, gen)
        weights = algo.loss_weights(tree, masks)
        if cfg.train.grpo_guard:  # GRPO-Guard's per-step reweighting: each step's loss divided by its |dt|
            dt = (tree.sigmas[:-1] - tree.sigmas[1:]).abs().tolist()
            weights = {i: (weights or {}).get(i, 1.0) / d for i, d in enumerate(dt) if d > 0}
        stats = {"trained_edges": sum(len(u.children) for it in items for u in it), "nfe_train": 0, "optimizer_steps": 0,
                 "clipfrac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_std": 0.0, "policy_loss": 0.0,
                 "kl_loss": 0.0, "grad_norm": 0.0, "ratio_max_abs_dev_first_update": 0.0, "work_items": len(items)}
        if not items:
            return stats
        ratios, clipped, kls, pls, approx, steps, grad_norms, ukls = [], [], [], [], [], [], [], []
        untrained = self.untrained_states(tree) if cfg.train.kl_untrained_beta > 0 else None
        first = True
        for _ in range(cfg.train.inner_epochs):
            order = torch.randperm(len(items), generator=gen).tolist()
            n_mb = min(cfg.train.num_minibatches, len(order))
            for mb in range(n_mb):
                mb_items = [items[i] for i in order[mb::n_mb]]
                n_rows = sum(algo.item_rows(it) for it in mb_items)  # the whole minibatch's, on every process
                opt.zero_grad(set_to_none=True)
                mb_ratios = []
                for group in _micro_batches(self.procs.share(mb_items), cfg.train.micro_batch):
                    units = [u for it in group for u in it]
                    logp, old, adv, kl, step, fused = self._edge_terms(tree, units, cond, node_adv)
                    if fused is not None:  # per-edge rows, computed whole by the compiled objective
                        loss_r, ratio = fused
                    else:
                        log_ratio, adv, kl, step = algo.loss_rows(group, logp, old, adv, kl, step)  # (E,) -> (R,)
                        loss_r, ratio = ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), adv,
                                                      cfg.train.clip_range)
                    row_loss = loss_r + cfg.train.kl_beta * kl
                    if weights is not None:  # (R,) the weight of each row's step
                        row_loss = row_loss * torch.tensor([weights[int(i)] for i in step], device=row_loss.device)
                    self.accelerator.backward(row_loss.sum() / n_rows)
                    stats["nfe_train"] += len(units)
                    mb_ratios.append(ratio.detach())
                    clipped.append(((ratio.detach() - 1).abs() > cfg.train.clip_range).float())
                    kls.append(kl.detach())
                    pls.append(loss_r.detach())
                    approx.append(0.5 * (logp.detach() - old) ** 2)
                    steps.append(step)
                if cfg.train.kl_untrained_beta > 0 and len(untrained[0]):  # states of the untrained steps
                    pick = torch.randperm(len(untrained[0]), generator=gen)[:cfg.train.kl_untrained_states]
                    mine = torch.tensor(self.procs.share(pick.tolist()), dtype=torch.long)
                    if len(mine):
                        ukl = self._untrained_kl(tree, cond, untrained[0][mine], untrained[1][mine])
                        self.accelerator.backward(cfg.train.kl_untrained_beta * ukl.sum() / len(pick))
                        stats["nfe_train"] += len(mine)
                        ukls.append(ukl.detach())
                self.procs.sum_gradients(self.policy.params)
                if first:
                    dev_first = float((torch.cat(mb_ratios) - 1).abs().max()) if mb_ratios else 0.0
                    stats["ratio_max_abs_dev_first_update"] = max(self.procs.gather([dev_first]))
                    first = False
                ratios += mb_ratios
                grad_norms.append(float(self.accelerator.clip_grad_norm_(self.policy.params, cfg.train.max_grad_norm)))
                opt.step()
                stats["optimizer_steps"] += 1
                if self.policy.ema is not None and stats["optimizer_steps"] % cfg.train.ema.update_every == 0:
                    self.policy.ema.step(self.policy.params)
        # every process's rows, so the statistics are the whole update's
        ratios, clipped, approx, kls, pls, steps = self.procs.gather_rows(ratios, clipped, approx, kls, pls, steps)
        stats["nfe_train"] = self.procs.sum(stats["nfe_train"])
        r = torch.cat(ratios).cpu()
        d = torch.cat(steps)
        stats.update({
            "clipfrac": float(torch.cat(clipped).mean()), "approx_kl": float(torch.cat(approx).mean()),
            "ratio_mean": float(r.mean()), "ratio_std": float(r.std(correction=0)),
            "policy_loss": float(torch.cat(pls).mean()), "kl_loss": float(torch.cat(kls).mean()),
            "grad_norm": sum(grad_norms) / len(grad_norms), "mean_abs_log_ratio": float(r.log().abs().mean()),
        })
        if untrained is not None:  # this process's states (the mean differs little across processes)
            stats["kl_untrained"] = float(torch.cat(ukls).mean()) if ukls else 0.0
        for step_idx in d.unique().tolist():
            stats[f"ratio_mean/step{step_idx}"] = float(r[d == step_idx].mean())
        if not math.isfinite(stats["grad_norm"]):
            raise FlowRLError("non-finite gradient norm; lower train.lr or use fp32 (train.mixed_precision=no)")
        return stats

    def forward_process_update(self, tree: Tree, cond, node_adv, gen: torch.Generator) -> dict:
        """Training on the forward process (DiffusionNFT): every clean leaf is re-noised at the algorithm's grid
        timesteps and the algorithm's per-sample loss is minimised, with the old policy's velocity beside the
        trained one's (and the reference's for train.kl_beta); minibatches and micro-batches as in :meth:`update`."""
        cfg, algo, policy = self.cfg, self.algorithm, self.policy
        dev = self.device
        self.adapter.transformer.train()
        x0_all = tree.leaves.to(dev)  # (L, *latent) clean samples
        adv_all = tree.leaf_values(node_adv).float().clamp(-cfg.advantage.clip, cfg.advantage.clip)  # (L,)
        rows_all = tree.leaf_group
        t_all = algo.training_timesteps(x0_all.shape[0], self.sigmas, gen)  # (L, k) re-noising sigmas
        items = [(i, j) for i in range(t_all.shape[0]) for j in range(t_all.shape[1])]
        dims = tuple(range(1, x0_all.ndim))
        stats = {"trained_edges": 0, "work_items": len(items), "nfe_train": 0, "optimizer_steps": 0,
                 "clipfrac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_std": 0.0,
                 "ratio_max_abs_dev_first_update": 0.0}
        losses, kls, gaps, grad_norms = [], [], [], []
        for _ in range(cfg.train.inner_epochs):
            order = torch.randperm(len(items), generator=gen).tolist()
            n_mb = min(cfg.train.num_minibatches, len(order))
            for mb in range(n_mb):
                mb_items = [items[k] for k in order[mb::n_mb]]
                # the whole minibatch's re-noising draws, on every process, so an item's noise is its own
                mb_eps = torch.randn((len(mb_items), *x0_all.shape[1:]), generator=gen)  # (M, *latent)
                numbered = self.procs.share(list(enumerate(mb_items)))
                policy.optimizer.zero_grad(set_to_none=True)
                for a in range(0, len(numbered), cfg.train.micro_batch):
                    chunk = [item for _, item in numbered[a: a + cfg.train.micro_batch]]
                    li = torch.tensor([i for i, _ in chunk])
                    t = t_all[li, torch.tensor([j for _, j in chunk])].to(dev)  # (B,)
                    x0 = x0_all[li.to(dev)]
                    eps = mb_eps[[n for n, _ in numbered[a: a + cfg.train.micro_batch]]].to(dev)  # (B, *latent)
                    tt = t.view(-1, *([1] * (x0.ndim - 1)))
                    x_t = (1 - tt) * x0 + tt * eps  # (B, *latent) on the forward process
                    rows = cond.index(rows_all[li].to(cond.embeds.device))
                    with torch.no_grad(), self.accelerator.autocast():  # before v: the swaps are in place
                        with policy.old_weights():
                            v_old = self.adapter.velocity(x_t, t, rows)
                        v_ref = None
                        if cfg.train.kl_beta > 0:
                            with policy.reference():
                                v_ref = self.adapter.velocity(x_t, t, rows)
                    with self.accelerator.autocast():
                        v = self.adapter.velocity(x_t, t, rows)
                    loss = algo.forward_process_terms(x0, x_t, t, v, v_old, adv_all[li].to(dev))  # (B,)
                    kl = ((v - v_ref) ** 2).mean(dim=dims) if v_ref is not None else torch.zeros_like(loss)
                    self.accelerator.backward((loss + cfg.train.kl_beta * kl).sum() / len(mb_items))
                    stats["nfe_train"] += len(chunk)
                    losses.append(loss.detach())
                    kls.append(kl.detach())
                    gaps.append(((v.detach() - v_old) ** 2).mean(dim=dims))
                self.procs.sum_gradients(policy.params)
                grad_norms.append(float(self.accelerator.clip_grad_norm_(policy.params, cfg.train.max_grad_norm)))
                policy.optimizer.step()
                stats["optimizer_steps"] += 1
                if policy.ema is not None and stats["optimizer_steps"] % cfg.train.ema.update_every == 0:
                    policy.ema.step(policy.params)
        losses, kls, gaps = self.procs.gather_rows(losses, kls, gaps)
        stats["nfe_train"] = self.procs.sum(stats["nfe_train"])
        stats.update({"policy_loss": float(torch.cat(losses).mean()), "kl_loss": float(torch.cat(kls).mean()),
                      "grad_norm": sum(grad_norms) / len(grad_norms), "mean_abs_log_ratio": 0.0,
                      "old_policy_gap": float(torch.cat(gaps).mean())})  # mean (v - v_old)^2: how far the old lags
        if not math.isfinite(stats["grad_norm"]):
            raise FlowRLError("non-finite gradient norm; lower train.lr or use fp32 (train.mixed_precision=no)")
        return stats

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
        wait for it, so a resume that follows reads it whole."""
        p = self.policy
        path = self.run_dir / "checkpoints" / f"iter_{it:05d}"
        if self.procs.is_main:
            path = save_checkpoint(path, self.adapter, p.module, p.optimizer, it, lora=p.lora, ema=p.ema,
                                   extra={"algorithm_state": self.algorithm.state_dict()},
                                   keep=self.cfg.log.keep_checkpoints,
                                   tensors={"old_policy": p.old} if p.old is not None else None)
        self.procs.barrier()
        return path


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


def per_reward_advantages(algorithm, tree: Tree, scores, weights: dict[str, float], it: int):
    """DanceGRPO's multi-reward rule: A = sum_i w_i A_i, each A_i normalised within its own groups from reward i
    alone (so a reward on a large scale cannot drown a small one). Edges kept by every component stay kept."""
    total, keep = None, None
    for name, values in scores.components.items():
        values = torch.where(scores.invalid, torch.nan, values)  # a leaf invalid in any reward is out of all
        adv, k, _ = algorithm.advantages(tree, values, it)
        total = [weights[name] * a for a in adv] if total is None else [t + weights[name] * a for t, a in zip(total, adv)]
        keep = k if keep is None else [x & y for x, y in zip(keep, k)]
    return total, keep
