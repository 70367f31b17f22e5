"""AdamW with float32 master weights, and the warmup + cosine learning-rate schedule.

bf16/fp16 parameters cannot take Adam's small updates (a bf16 weight near 1.0 moves in steps of
2^-8), so for them the optimizer keeps a float32 master copy and float32 moments, updates the
master, and writes it back rounded to the parameter's dtype. float32 parameters are their own
master. The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from tprt.errors import ValidationError

_FP32_STATE = ("exp_avg", "exp_avg_sq", "master")
_FUSED_DEVICES = ("cpu", "cuda")  # where torch._fused_adamw_ has a kernel
# The fused update converts low-precision gradients to float32 this many bytes at a time (or one
# parameter, when larger): all at once would be 4 bytes per parameter (32.9 GiB a rank for a full
# bf16 fine-tune of 70B at TP 8). The memory planner counts the same (tprt.plan.memory).
GRAD_CHUNK_BYTES = 64 << 20


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, on float32 master weights and moments for low-precision params.

    State per parameter: step (int), exp_avg and exp_avg_sq (float32), and master (float32, only
    when the parameter is not float32). `state_dict`/`load_state_dict` keep all of it float32.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        if not lr >= 0:
            raise ValidationError("lr", f"learning rate must be >= 0, got {lr!r}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValidationError("betas", f"Adam betas must be in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValidationError("eps", f"Adam eps must be positive, got {eps!r}")
        if not weight_decay >= 0:
            raise ValidationError("weight_decay", f"weight decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 weights behind `p` (p itself when it is float32 or has not been stepped)."""
        master = self.state.get(p, {}).get("master")
        return master if isinstance(master, torch.Tensor) else p

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and all(p.device.type in _FUSED_DEVICES for p in params):
                self._update_fused(params, group)
            else:
                for p in params:
                    self._update(p, group)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state (created on its first step), with the step count advanced."""
        assert p.grad is not None
        if p.grad.is_sparse:
            raise ValueError("AdamW does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if p.dtype != torch.float32:
                state["master"] = p.detach().to(torch.float32, copy=True)
        state["step"] += 1
        return state

    def _update_fused(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Every parameter of a group in torch's fused AdamW kernel: one pass over weights and
        moments instead of ten elementwise ops per tensor (the update is memory-bound: it was
        18% of a bf16 full fine-tuning step on CPU). Called on chunks of GRAD_CHUNK_BYTES of
        float32 gradients: the kernel is elementwise per tensor, so the chunks change no value."""
        chunk: list[torch.Tensor] = []
        size = 0
        for p in params:
            if chunk and size + 4 * p.numel() > GRAD_CHUNK_BYTES:
                self._fused_chunk(chunk, group)
                chunk, size = [], 0
            chunk.append(p)
            size += 4 * p.numel()
        self._fused_chunk(chunk, group)

    def _fused_chunk(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        weights, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for p in params:
            state = self._state(p)
            assert p.grad is not None
            weights.append(state.get("master", p))
            grads.append(p.grad.to(torch.float32))
            avgs.append(state["exp_avg"])
            avg_sqs.append(state["exp_avg_sq"])
            steps.append(torch.tensor(float(state["step"]), device=p.device))
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(weights, grads, avgs, avg_sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
        for p, w in zip(params, weights):
            if w is not p:
                p.copy_(w)  # rounds to the parameter's dtype

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """The same update, one parameter at a time (devices without the fused kernel)."""
        state = self._state(p)
        master = state.get("master", p)
        assert p.grad is not None
        grad = p.grad.to(torch.float32)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        master.mul_(1 - lr * wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1 = 1 - beta1 ** state["step"]
        bias2_sqrt = math.sqrt(1 - beta2 ** state["step"])
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-lr / bias1)
        if master is not p:
            p.copy_(master)  # rounds to the parameter's dtype

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but moments and masters stay float32 (torch casts them to the param dtype)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key in _FP32_STATE:
                value = saved.get(i, {}).get(key)
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)


class WarmupCosine:
    """LR factor at step s: linear warmup (s + 1) / (warmup + 1), then a cosine from 1 down to
    `min_lr_ratio` at `total_steps`, flat after. A callable object so LambdaLR saves its settings."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """The schedule as a LambdaLR over each group's initial lr (`state_dict`/`load_state_dict`
    for resume). Call `.step()` after each optimizer step; the first step runs at factor 1 / (warmup + 1)."""
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValidationError("warmup_steps", f"warmup steps must be an integer >= 0, got {warmup_steps!r}")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValidationError("total_steps", f"total steps must be a positive integer, got {total_steps!r}")
    if warmup_steps > total_steps:
        raise ValidationError("warmup_steps", f"warmup steps ({warmup_steps}) exceed total steps ({total_steps})")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValidationError("min_lr_ratio", f"min LR ratio must be in [0, 1], got {min_lr_ratio!r}")
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
