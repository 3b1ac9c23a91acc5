"""Every family's facts live in its adapter: no core module names a family, and a plug-in family gets its own
resolution rule, memory estimate and context-parallel answer from its class."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.models.sd3 import SD3Adapter
from flowrl.registry import MODEL_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
FAMILY_WORDS = re.compile(r"(?i)(?<![a-z])(sd3\w*|sd35\w*|flux\w*|qwen\w*|wan(2\w*|21\w*|22\w*)?|hunyuan\w*|ltx\w*|"
                          r"z_?image\w*)(?![a-z])")
# where family names belong: the adapters, the demo domain built on two of them, the registry's name tables and the
# real-size benchmark tools that build each published architecture
EXEMPT = ("flowrl/models/", "flowrl/shapes/", "flowrl/registry.py", "flowrl/gpu_bench.py", "flowrl/gpu_check.py",
          "flowrl/cli/bench.py")


def family_mentions(path: Path) -> list[str]:
    """Identifiers and non-prose string constants (keys, ids, class names: no whitespace) naming a family.
    Docstrings, comments and prose messages may mention families as examples."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and not re.search(r"\s", node.value):
            names.append(node.value)
        elif isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.alias):
            names.append(node.name)
        found += [f"{path.name}:{getattr(node, 'lineno', 0)} {n!r}" for n in names
                  if FAMILY_WORDS.search(n)]
    return found


def test_no_core_module_names_a_model_family():
    files = [p for p in (ROOT / "flowrl").rglob("*.py") if not str(p.relative_to(ROOT)).startswith(EXEMPT)]
    assert len(files) > 40
    mentions = [m for p in files for m in family_mentions(p)]
    assert not mentions, "family facts outside the adapters:\n" + "\n".join(mentions)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""SD3 in a docstring is fine."""\nX = {"flux": 1}\nif family == "qwenimage":\n    pass\n'
                     'wan_experts = 2\nmsg = "prose about Wan is fine"\n')
    hits = family_mentions(probe)
    assert sorted(h.split(" ", 1)[1] for h in hits) == ["'flux'", "'qwenimage'", "'wan_experts'"]


class WidePatchAdapter(SD3Adapter):
    """A plug-in family in the style of docs/extending.md's, declaring its own facts."""

    family = "wide_patch_sd3"
    published_architectures = {"example/wide-patch": (dict(SD3Adapter.published_architectures[
        "stabilityai/stable-diffusion-3.5-medium"][0], num_layers=2), 1)}

    @classmethod
    def resolution_multiple(cls, model_cfg) -> int:
        return 48

    @classmethod
    def context_parallel_plan(cls):
        return None

    @classmethod
    def fsdp_units(cls):
        return ("PatchEmbed", "JointTransformerBlock")  # its own units, not the class's declaration


@pytest.fixture
def plugin_family():
    MODEL_FAMILIES.register("wide_patch_sd3", WidePatchAdapter)
    yield "wide_patch_sd3"
    MODEL_FAMILIES.pop("wide_patch_sd3")


def test_a_plug_in_family_gets_its_own_resolution_rule(plugin_family):
    with pytest.raises(ConfigError, match="not a multiple of 48"):
        load_config(None, [f"model.family={plugin_family}", "model.pretrained=example/wide-patch", "model.resolution=64"])
    assert load_config(None, [f"model.family={plugin_family}", "model.pretrained=example/wide-patch",
                              "model.resolution=96"]).model.resolution == 96
    # the built-in SD3 rule (16 px per patch at real size) would have accepted 64
    load_config(None, ["model.pretrained=sd3.5-medium", "model.resolution=64"])


def test_a_plug_in_family_gets_its_own_memory_estimate(plugin_family):
    from flowrl.memory import architecture, state_bytes

    cfg = load_config(None, [f"model.family={plugin_family}", "model.pretrained=example/wide-patch",
                             "model.resolution=96", "train.lora.enabled=false"])
    arch = architecture(cfg.model)
    assert arch.class_name == "SD3Transformer2DModel" and arch.config["num_layers"] == 2 and arch.experts == 1
    parts, counts = state_bytes(cfg, arch, 1)
    full = architecture(load_config(None, ["model.pretrained=sd3.5-medium"]).model)
    assert full.config["num_layers"] == 24
    assert 0 < counts["parameters"] < 0.2 * sum(p.numel() for p in _meta(full).parameters())
    assert parts["weights"] == counts["parameters"] * 4  # full fine-tuning: fp32 masters


def _meta(arch):
    from flowrl.memory import build_on_meta

    return build_on_meta(arch)


def test_a_plug_in_family_gets_its_own_context_parallel_answer(plugin_family):
    from flowrl.sharding import check_context, families_with_context_parallel

    cfg = load_config(None, [f"model.family={plugin_family}", "model.pretrained=example/wide-patch",
                             "model.resolution=96", "train.context_parallel.ulysses=2"])
    with pytest.raises(ConfigError, match="wide_patch_sd3 family's transformer has no context-parallel plan"):
        check_context(cfg, 2)
    assert plugin_family not in families_with_context_parallel()
    # the families whose diffusers transformer declares a plan, each adapter answering for itself
    assert {"flux", "flux2", "qwenimage", "wan"} <= set(families_with_context_parallel())
    assert "sd3" not in families_with_context_parallel()


def test_ltx2_declares_its_frames_rule_memory_tokens_and_context_parallel_answer():
    """LTX-2's 8x temporal VAE (4x in the tiny model): model.num_frames is checked before loading; its memory latent
    is the packed video tokens then audio frames; its transformer has a diffusers plan that flowrl refuses, saying
    why."""
    from flowrl.models import ADAPTERS
    from flowrl.models.published import LTX2_19B
    from flowrl.sharding import check_context, families_with_context_parallel

    with pytest.raises(ConfigError, match=r"48 frames is not 8k \+ 1 .* use 41 or 49"):
        load_config(None, ["model.family=ltx2", "model.pretrained=ltx-2", "model.resolution=512", "model.num_frames=48"])
    with pytest.raises(ConfigError, match=r"7 frames is not 4k \+ 1 .* use 5 or 9"):
        load_config(None, ["model.family=ltx2", "model.resolution=32", "model.num_frames=7"])
    cfg = load_config(None, ["model.family=ltx2", "model.pretrained=ltx-2", "model.resolution=512",
                             "model.num_frames=121"])
    # 121 frames -> 16 latent frames of 16 x 16 tokens; 121 / 24 s x 16000 / 160 / 4 = 126.04 -> 126 audio frames
    assert ADAPTERS["ltx2"].memory_latent_shape(cfg.model, LTX2_19B) == (16 * 16 * 16 + 126, 128)
    with pytest.raises(ConfigError, match="no context-parallel plan .diffusers' plan splits the video tokens only"):
        check_context(load_config(None, ["model.family=ltx2", "train.context_parallel.ulysses=2"]), 2)
    assert "ltx2" not in families_with_context_parallel()
    from flowrl.sampling import check_noise_lowpass

    with pytest.raises(ConfigError, match="packed tokens .133, 4.*sampler.noise_lowpass=0"):
        check_noise_lowpass(load_config(None, ["model.family=ltx2", "sampler.noise_lowpass=2"]), (133, 4))


def test_extra_transformers_and_the_padding_sigma_come_from_the_adapter():
    from flowrl.models import load_adapter

    cfg = load_config(None, ["model.family=wan", "model.tiny.experts=2", "model.train_expert=low_noise"])
    adapter = load_adapter(cfg.model)
    (second,) = adapter.extra_transformers()
    assert second is adapter.frozen_expert and not any(p.requires_grad for p in second.parameters())
    assert adapter.pad_sigma() * 1000 < adapter.boundary  # the low-noise expert draws below the boundary
    one = load_adapter(load_config(None, []).model)
    assert one.extra_transformers() == [] and one.pad_sigma() == 0.5
    assert torch.is_tensor(one.default_sigmas(4, 32))


def test_a_family_declares_its_fsdp_units():
    """Each adapter answers which modules FSDP2 shards one at a time; the sharding code shards exactly those (one
    process here: a mesh of one)."""
    import torch
    from diffusers import SD3Transformer2DModel

    from flowrl.models import ADAPTERS
    from flowrl.sharding import repeated_blocks

    assert ADAPTERS["sd3"].fsdp_units() == tuple(SD3Transformer2DModel._repeated_blocks or
                                                 SD3Transformer2DModel._no_split_modules)
    assert "HunyuanVideo15TransformerBlock" in ADAPTERS["hunyuanvideo15"].fsdp_units()
    assert ADAPTERS["ltx2"].fsdp_units() == ("LTX2VideoTransformerBlock",)
    assert ADAPTERS["flux-kontext"].fsdp_units() == ADAPTERS["flux"].fsdp_units()
    with torch.device("meta"):
        model = SD3Transformer2DModel(num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                      caption_projection_dim=16, pooled_projection_dim=8, sample_size=8, patch_size=2,
                                      in_channels=4, out_channels=4, pos_embed_max_size=8)
    declared = repeated_blocks(model, WidePatchAdapter.fsdp_units())
    assert [type(m).__name__ for m in declared] == ["PatchEmbed", "JointTransformerBlock", "JointTransformerBlock"]
    assert [type(m).__name__ for m in repeated_blocks(model)] == ["JointTransformerBlock"] * 2  # the class's own
