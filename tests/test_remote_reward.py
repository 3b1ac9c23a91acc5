"""The remote scorer on 127.0.0.1: the same scores as in process, server errors reported, a dead server a clear
error (not a hang)."""

import subprocess
import sys
import threading
import time

import pytest
import torch
from flowrl.rewards import build_reward
from flowrl.rewards.remote import make_server

from flowrl.errors import RewardError
from flowrl.shapes.domain import render, split_specs


@pytest.fixture()
def server():
    servers = []

    def start(name, args=None):
        srv = make_server(name, args, "127.0.0.1", 0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def shapes_batch():
    specs = split_specs()[1][:4]
    images = torch.stack([torch.from_numpy(render(s, 32, seed=i)).permute(2, 0, 1) / 255 for i, s in enumerate(specs)])
    return images, [s.prompt for s in specs]


def test_remote_equals_in_process(server):
    images, prompts = shapes_batch()
    for name in ("shapes", "jpeg_incompressibility"):
        _, url = server(name)
        remote = build_reward("remote", url=url, timeout=10)
        assert torch.equal(torch.as_tensor(remote(images, prompts), dtype=torch.float64),
                           torch.as_tensor(build_reward(name)(images, prompts), dtype=torch.float64))


def test_remote_nan_and_server_side_errors(server):
    images, prompts = shapes_batch()
    _, url = server("tests.helpers:half_nan")
    scores = build_reward("remote", url=url)(images, prompts)
    assert torch.isnan(scores[0]) and scores[1] == 1.0
    _, url = server("shapes")
    with pytest.raises(RewardError, match="cannot judge the prompt 'a horse'"):
        build_reward("remote", url=url)(images[:1], ["a horse"])


def test_dead_server_gives_a_clear_error_quickly(server):
    images, prompts = shapes_batch()
    srv, url = server("shapes")
    srv.shutdown()
    srv.server_close()
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"is not answering .* after 2 tries; start it with `flowrl serve-reward"):
        build_reward("remote", url=url, retries=2, backoff=0.05, timeout=2)(images, prompts)
    assert time.perf_counter() - t0 < 10


def test_serve_reward_command_in_its_own_process():
    images, prompts = shapes_batch()
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "serve-reward", "shapes", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving reward 'shapes' on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" on ")[1].strip()
        remote = build_reward("remote", url=url, retries=2, backoff=0.05, timeout=10)
        assert torch.allclose(remote(images, prompts), torch.as_tensor(build_reward("shapes")(images, prompts), dtype=torch.float64))
        proc.kill()
        proc.wait()
        with pytest.raises(RewardError, match="not answering"):
            remote(images, prompts)
    finally:
        proc.kill()
