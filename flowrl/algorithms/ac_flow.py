"""AC-Flow (arXiv 2510.18072), an actor-critic for flow matching, in this package's reading. The paper's formulas
were not available; what is built are the three components its abstract names, on top of ORW-CFM-W2 (online
reward-weighted flow matching with a W2 bound, arXiv 2502.06061), which the abstract calls a special case:

1. **Reward shaping**: each reward becomes its group z-score (``advantage``), clipped to ``+-adv_clip`` (the
   "well-normalised signal").
2. **Dual stability**: a critic ``V(x_t, sigma)`` (a small network on the pooled noisy latent and the noise level)
   learns, by mean squared error, the shaped reward of the clean sample a noisy state came from; for
   ``critic_warmup`` iterations it trains without touching the actor, whose weight is then ORW's ``exp(tau r)``.
   After the warm-up the actor's advantage at a state is ``A = clip(r - V(x_t, sigma), +-adv_clip)`` (advantage
   clipping), the intermediate feedback of the title.
3. **Critic weighting with a Wasserstein bound**: each clean sample x0 (ODE rollouts of the policy) is re-noised at
   stratified grid sigmas and its flow-matching error ``e = mean((v_theta - (eps - x0))^2)`` is weighted by
   ``w = exp(tau A)`` normalised to mean 1 over the micro-batch's samples; ``train.kl_beta`` x ``mean((v_theta -
   v_ref)^2)`` is ORW-CFM-W2's W2 bound (alpha; 1 in its code).

The critic has its own Adam (``critic_lr``); its weights are part of the run's state, so a resumed run continues
it. With several processes each process's critic gradients are averaged before its step."""

from __future__ import annotations

import base64

import torch

from ..config import opt
from .forward_process import ForwardProcessAlgorithm, StrataOptions


class ACFlowOptions(StrataOptions):
    tau: float = opt(0.5, "temperature of the weight w = exp(tau A) (ORW-CFM-W2: 0.5)", lo=0.0, lo_open=True)
    adv_clip: float = opt(2.0, "the shaped reward and the critic's advantage are clipped to +-adv_clip", lo=0.0,
                          lo_open=True)
    critic_warmup: int = opt(10, "iterations the critic trains before it weights the actor", lo=0)
    critic_lr: float = opt(1e-3, "the critic's Adam learning rate", lo=0.0, lo_open=True)
    critic_width: int = opt(128, "hidden width of the critic's two layers", lo=1)


class Critic(torch.nn.Module):
    """V(x_t, sigma): the latent averaged over frames (video) and pooled to 4 x 4 per channel (a latent of packed
    tokens (B, S, C): pooled to 16 positions along its sequence), with sigma and four Fourier features of it, through
    a two-layer MLP. x (B, C, [F,] H, W) or (B, S, C), sigma (B,) -> (B,)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(channels * 16 + 9, width), torch.nn.SiLU(),
                                       torch.nn.Linear(width, width), torch.nn.SiLU(), torch.nn.Linear(width, 1))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.ndim == 5:
            x = x.mean(2)
        if x.ndim == 3:  # packed tokens (B, S, C)
            pooled = torch.nn.functional.adaptive_avg_pool1d(x.transpose(1, 2), 16).flatten(1)  # (B, C * 16)
        else:
            pooled = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)  # (B, C * 16)
        k = torch.arange(1, 5, device=x.device, dtype=torch.float32) * torch.pi
        s = sigma.float().view(-1, 1)
        feats = torch.cat([pooled, s, torch.sin(k * s), torch.cos(k * s)], dim=1)  # (B, C * 16 + 9)
        return self.net(feats).squeeze(1)


def critic_weights(adv: torch.Tensor, tau: float) -> torch.Tensor:
    """w = exp(tau A) / mean(exp(tau A)) over the samples (B,), shifted by max(A) first for range."""
    w = torch.exp(tau * (adv - adv.max()))
    return w / w.mean()


class ACFlow(ForwardProcessAlgorithm):
    Options = ACFlowOptions

    def __init__(self, cfg):
        super().__init__(cfg)
        self.iteration, self.critic, self.critic_optimizer, self.pending_state = 0, None, None, None

    def attach(self, policy, ctx) -> None:
        super().attach(policy, ctx)
        shape = ctx.sample.latent_shape
        channels = shape[-1] if len(shape) == 2 else shape[0]  # packed tokens (S, C), else (C, [F,] H, W)
        self.critic = Critic(channels, self.opts.critic_width).to(policy.adapter.device)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.opts.critic_lr)
        if self.pending_state is not None:
            self._load_critic(self.pending_state)

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per sample (B,): ``w e`` for the actor, plus the critic's squared error whose value is kept out of the
        loss (only its gradient reaches the critic's weights)."""
        c = self.opts.adv_clip
        shaped = adv.float().clamp(-c, c)  # (B,) the group z-score, clipped
        value = self.critic(x_t.detach(), t)  # (B,)
        critic_loss = (value - shaped) ** 2
        a = shaped if self.iteration < self.opts.critic_warmup else (shaped - value.detach()).clamp(-c, c)
        w = critic_weights(a, self.opts.tau)
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        eps = (x_t - (1 - tt) * x0) / tt
        e = ((v_theta.float() - (eps - x0)) ** 2).flatten(1).mean(1)
        return w * e + (critic_loss - critic_loss.detach())

    def observe_update(self, stats: dict) -> None:
        """The critic's step on the gradients the update left on it (averaged over processes)."""
        super().observe_update(stats)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for p in self.critic.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= torch.distributed.get_world_size()
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        stats["critic_warm"] = float(self.iteration >= self.opts.critic_warmup)
        self.iteration += 1

    # ---------------------------------------------------------------- the critic in the run's state
    def state_dict(self) -> dict:
        from safetensors.torch import save

        tensors = {f"critic.{k}": v.detach().cpu().contiguous() for k, v in self.critic.state_dict().items()}
        for i, st in self.critic_optimizer.state_dict()["state"].items():
            tensors.update({f"adam.{i}.{k}": torch.as_tensor(v).cpu().contiguous() for k, v in st.items()})
        return {**super().state_dict(), "iteration": self.iteration,
                "critic": base64.b64encode(save(tensors)).decode()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.iteration = state.get("iteration", 0)
        if "critic" in state:
            if self.critic is None:
                self.pending_state = state["critic"]
            else:
                self._load_critic(state["critic"])

    def _load_critic(self, blob: str) -> None:
        from safetensors.torch import load

        tensors = load(base64.b64decode(blob))
        dev = next(self.critic.parameters()).device
        self.critic.load_state_dict({k[7:]: v.to(dev) for k, v in tensors.items() if k.startswith("critic.")})
        opt_state = self.critic_optimizer.state_dict()
        per_param: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("adam."):
                _, i, name = k.split(".", 2)
                per_param.setdefault(int(i), {})[name] = v.to(dev) if name != "step" else v
        opt_state["state"] = per_param
        self.critic_optimizer.load_state_dict(opt_state)
