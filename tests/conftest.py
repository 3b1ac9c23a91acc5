import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two threads alone; under pytest-xdist the cores are shared among the workers (oversubscribed threads only wait).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def tiny_cfg():
    from flowrl.config import load_config

    return load_config(None, ["log.progress=false"])


@pytest.fixture(scope="session")
def tiny_adapter(tiny_cfg):
    from flowrl.models import SD3Adapter

    return SD3Adapter.from_config(tiny_cfg.model, "cpu")


def make_cfg(tmp_path, *overrides):
    from flowrl.config import load_config

    return load_config(None, [f"log.output_dir={tmp_path}", "log.run_name=t", "log.progress=false",
                              "log.sample_every=0", "log.save_every=0", *overrides])
