"""Torch RMSNorm with flashinfer's signatures (in place where flashinfer is)."""

import torch


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    x = residual.float()
    input.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype))
