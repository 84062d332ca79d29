"""RMSNorm computed in float32 whatever the activation dtype, exactly as HuggingFace does."""

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # same operation order as LlamaRMSNorm, so float32 results match it bit for bit
        input_dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class FusedRMSNorm(RMSNorm):
    """RMSNorm in one Triton kernel; given the residual stream, it first adds x to it and returns
    (normed, new residual), so a decoder layer carries the residual instead of adding it."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # imported here: models built without the fused kernels must not need Triton
        from workers.layers.fused_kernels import add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def project(
        self, x: torch.Tensor, residual: torch.Tensor | None, linear, silu_mul: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For one row: (linear(norm(x [+ residual])), the new residual) in one kernel; with
        silu_mul, linear is a merged gate_up and the first output is SiLU(gate) * up."""
        from workers.layers.gemv import gemv

        out, new_residual = gemv(
            x, linear.weight, linear.bias, residual=residual, norm_weight=self.weight,
            eps=self.eps, silu_mul=silu_mul,
        )  # fmt: skip
        return out, (x if new_residual is None else new_residual)
