"""Loading a config: YAML with ``key.sub=value`` overrides, the data paths, the method's published defaults
and the cross-field checks, all before any work starts; saving one."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from ..errors import ConfigError
from .base import _build, check_seeds
from .sections import Config, RewardSpec


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def parse_override(text: str) -> tuple[list, object]:
    """``a.b[1].c=value`` -> (['a', ('b', 1), 'c'], value), the value parsed as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts: list = []
    for p in key.split("."):
        m = _INDEXED.match(p)
        parts.append((m.group(1), int(m.group(2))) if m else p)
    return parts, value


def apply_override(data: dict, text: str) -> dict:
    """Set one override in the raw config mapping; ``name[i]`` indexes a list entry (``rewards[0].name=shapes``;
    ``rewards[1].name=...`` appends a second reward)."""
    parts, value = parse_override(text)
    cur = data
    for k, p in enumerate(parts):
        last = k == len(parts) - 1
        if isinstance(p, tuple):
            name, idx = p
            lst = cur.get(name)
            if lst is None and name == "rewards":  # the default reward list, so rewards[0].weight=2 works alone
                lst = [{"name": RewardSpec().name}]
            lst = list(lst or [])
            if idx > len(lst):
                raise ConfigError(f"override {text!r}: {name} has {len(lst)} entries; index {idx} would leave a gap")
            if idx == len(lst):
                lst.append({})
            cur[name] = lst
            if last:
                lst[idx] = value
            else:
                if not isinstance(lst[idx], dict):
                    lst[idx] = {}
                cur = lst[idx]
        elif last:
            cur[p] = _merge(cur[p], value) if isinstance(value, dict) and isinstance(cur.get(p), dict) else value
        else:
            if not isinstance(cur.get(p), dict):
                cur[p] = {}
            cur = cur[p]
    return data


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (plain YAML keeps the later one, so a
    second ``train:`` block would silently replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one and merge the settings into it")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or defaults), apply overrides, validate; raises ConfigError with one clear line."""
    data: dict = {}
    if path is not None:
        from ..resources import find_config

        found = find_config(path)
        if found is None:
            raise ConfigError(f"config file not found: {path} (nor a shipped preset of that name; "
                              "see `flowrl presets`)")
        path = found
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    for text in overrides or []:
        data = apply_override(data, text)
    data.setdefault("algorithm", {})  # the default algorithm's own options class, not the bare base
    cfg = _build(Config, data)
    if cfg.data.prompt_file:
        cfg.data.prompt_file = str(_resolve_data_path(cfg.data.prompt_file, path))
    if cfg.data.dataset and any(cfg.data.dataset.endswith(s) for s in (".parquet", ".jsonl", ".json", ".csv", ".arrow")):
        cfg.data.dataset = str(_resolve_data_path(cfg.data.dataset, path))  # a file: found as prompt files are
    return validate(cfg)


def _resolve_data_path(name: str, config_path: Path | None) -> Path:
    """A relative data path as written in a config: from the current folder, else beside the config file, else
    in the shipped assets (``assets/prompts/animals.txt``), so a preset runs from any folder."""
    from ..resources import assets_dir

    p = Path(name).expanduser()
    if p.is_absolute() or p.exists():
        return p
    candidates = []
    if config_path is not None:
        candidates.append(Path(config_path).parent / p)
    parts = p.parts[1:] if p.parts and p.parts[0] == "assets" else p.parts
    candidates.append(assets_dir().joinpath(*parts))
    return next((c for c in candidates if c.exists()), p)


def resolved(cfg: Config) -> Config:
    """The config with its method's published defaults where it leaves those keys out (a key the config sets
    wins): the advantage settings of the released code (BranchGRPO's ddof 1, eps 1e-8) and whether the update
    back-propagates through CFG's unconditional half. A copy; ``cfg`` is left as it is."""
    from ..registry import algorithm_class

    method = algorithm_class(cfg.algorithm.name)
    advantage = {k: v for k, v in getattr(method, "advantage_defaults", {}).items()
                 if k not in cfg.advantage.model_fields_set}
    train = ({} if "cfg_unconditional_grad" in cfg.train.model_fields_set
             else {"cfg_unconditional_grad": bool(getattr(method, "cfg_unconditional_grad", False))})
    return cfg.model_copy(update={"advantage": cfg.advantage.model_copy(update=advantage),
                                  "train": cfg.train.model_copy(update=train)})


def validate(cfg: Config) -> Config:
    """Cross-field checks that a single field's range cannot express, the algorithm's own among them: all of
    them run here, at load, before a model is loaded or a file written. Returns the config resolved
    (:func:`resolved`); ``cfg`` itself is not changed."""
    from ..registry import algorithm_class

    cfg = resolved(cfg)
    if not cfg.rewards:
        raise ConfigError("rewards: list at least one reward, e.g. rewards=[{name: jpeg_compressibility}]")
    if cfg.advantage.combine == "per_reward" and cfg.advantage.zero_variance in ("tracker", "drop_refill"):
        raise ConfigError("advantage.combine=per_reward: the prompt tracker of zero_variance tracker|drop_refill "
                          "follows the summed reward; use advantage.combine=sum")
    lo, hi = cfg.advantage.tracker_reward_range if len(cfg.advantage.tracker_reward_range) == 2 else (0, 0)
    if not lo < hi:
        raise ConfigError(f"advantage.tracker_reward_range {cfg.advantage.tracker_reward_range} must be [low, high] "
                          "with low < high")
    if len(cfg.train.betas) != 2 or not all(0 <= b < 1 for b in cfg.train.betas):
        raise ConfigError(f"train.betas: {cfg.train.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    if (cfg.log.early_stop_patience or cfg.log.early_stop_drop) and not (cfg.log.eval_every and cfg.log.eval != "none"):
        raise ConfigError("log.early_stop_patience / log.early_stop_drop watch the held-out curve; set log.eval (e.g. "
                          "shapes) and log.eval_every (e.g. 10)")
    if cfg.rewards and all(r.weight == 0 for r in cfg.rewards):
        raise ConfigError("rewards: every reward has weight 0, so the run has nothing to learn from; give one a "
                          "non-zero weight (rewards[0].weight=1)")
    for key, seeds in (("data.sample_seeds", cfg.data.sample_seeds), ("log.eval_seeds", cfg.log.eval_seeds)):
        if not seeds:
            raise ConfigError(f"{key}: list at least one seed, e.g. [0, 1, 2, 3]")
        check_seeds(seeds, key)
    if cfg.guard.enabled:
        check_seeds(cfg.guard.seeds, "guard.seeds")
        if len(set(cfg.guard.seeds)) < 2:
            raise ConfigError(f"guard.seeds: {cfg.guard.seeds} gives each prompt fewer than two samples, so the "
                              "guard's diversity signal could not see a collapse; list at least two seeds, e.g. "
                              "[0, 1, 2, 3]")
        if cfg.guard.prompt_set and cfg.guard.prompts:
            raise ConfigError("guard.prompts and guard.prompt_set both name the guard's prompts; keep one")
    m = cfg.model
    from ..registry import MODEL_NAMES, adapter_class

    # an embedded model's adapter checks its exact geometry at load; otherwise the family's own rule
    factor = 1 if m.pretrained in MODEL_NAMES else adapter_class(m.family).resolution_multiple(m)
    if m.resolution % factor:
        lo = m.resolution - m.resolution % factor
        raise ConfigError(f"model.resolution: {m.resolution} px is not a multiple of {factor} (the latent patch "
                          f"grid of this model); use {lo or factor} or {lo + factor}")
    frames = None if m.pretrained in MODEL_NAMES else adapter_class(m.family).frames_multiple(m)
    if frames and (m.num_frames - 1) % frames:
        lo = m.num_frames - (m.num_frames - 1) % frames
        raise ConfigError(f"model.num_frames: {m.num_frames} frames is not {frames}k + 1 (the VAE's {frames}x temporal "
                          f"compression); use {lo} or {lo + frames}")
    for key, value, package, extra in (("train.optimizer", cfg.train.optimizer == "adamw_8bit", "bitsandbytes", "bitsandbytes"),
                                       ("train.attention_backend", cfg.train.attention_backend == "xformers", "xformers",
                                        "xformers"),
                                       ("train.attention_backend", cfg.train.attention_backend == "flash", "flash_attn",
                                        "flash-attn")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}: needs the {extra} package (pip install 'flowrl-tree[{extra}]' or pip install "
                              f"{extra}); or set it back to its default")
    if cfg.train.update_composition == "rollout":
        for key, bad, fix in (("train.fsdp.enabled", cfg.train.fsdp.enabled, "train.fsdp.enabled=false"),
                              ("train.context_parallel.degree", cfg.train.context_parallel.degree > 1,
                               "train.context_parallel.degree=1"),
                              ("train.cfg", cfg.sampler.guidance_scale > 1 and not cfg.train.cfg, "train.cfg=true")):
            if bad:
                raise ConfigError(f"train.update_composition=rollout: recomputing the rollout's calls needs the "
                                  f"update to call the transformer as the rollout did, which {key} prevents; set "
                                  f"{fix} or train.update_composition=micro_batch")
    if cfg.train.grpo_guard and cfg.sampler.kernel != "flow_grpo":
        raise ConfigError(f"train.grpo_guard: GRPO-Guard normalises Flow-SDE transitions; set sampler.kernel=flow_grpo "
                          f"(not {cfg.sampler.kernel}) or train.grpo_guard=false")
    if cfg.sampler.noise_lowpass_skip_dc and cfg.sampler.noise_lowpass < 2:
        raise ConfigError(f"sampler.noise_lowpass_skip_dc: needs sampler.noise_lowpass of at least 2 (it is "
                          f"{cfg.sampler.noise_lowpass}), or sampler.noise_lowpass_skip_dc=false")
    if cfg.sampler.noise_lowpass and cfg.sampler.kernel == "cps":
        raise ConfigError("sampler.noise_lowpass: the cps kernel has no score correction to restrict; use "
                          "sampler.kernel=flow_grpo or dance, or sampler.noise_lowpass=0")
    if cfg.train.kl_untrained_beta > 0 and cfg.sampler.noise_level <= 0:
        raise ConfigError("train.kl_untrained_beta: the KL of an untrained step uses the SDE transition at "
                          "sampler.noise_level, which is 0; set sampler.noise_level > 0 or train.kl_untrained_beta=0")
    if (cfg.train.kl_beta > 0 or cfg.train.kl_untrained_beta > 0) and cfg.train.kl_reference == "ema" \
            and not cfg.train.ema.enabled:
        raise ConfigError("train.kl_reference=ema: the reference is the EMA of the weights; set "
                          "train.ema.enabled=true or train.kl_reference=initial")
    if cfg.train.kl_beta > 0 and cfg.train.kl_std == "flow_grpo" and cfg.sampler.kernel == "cps":
        raise ConfigError("train.kl_std=flow_grpo: the cps kernel's std has no sqrt(|dt|) factor to remove; "
                          "use train.kl_std=transition")
    algorithm_class(cfg.algorithm.name).validate(cfg)  # the universal checks, then the algorithm's own
    return cfg


def to_dict(cfg) -> dict:
    """The resolved config as plain data; the algorithm section holds only its own algorithm's options."""
    return cfg.model_dump()


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
