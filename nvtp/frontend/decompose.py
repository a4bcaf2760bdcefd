"""torch calls Thunder runs only opaquely, written as the torch ops they compute, for the FX
route's table (``nvtp.frontend.fx.DECOMPOSITIONS``): ``torch.histc`` (an MoE load-balancing loss
counts tokens per expert with it), ``torch._weight_norm`` (weight normalisation), ``x.bool()`` and
its kin, ``x.new_zeros(shape)`` and its kin, and ``x.var(unbiased=...)`` and its kin."""

from __future__ import annotations

import torch


def histc(input, bins=100, min=0, max=0):
    """``torch.histc`` as a one-hot count (a MoE load-balancing loss counts the tokens per expert
    so): element x in [min, max] falls into bin ``floor((x - min) / (max - min) * bins)``, x = max
    into the last. Exact for integer-valued input such as expert numbers."""
    if min == max:
        raise NotImplementedError("torch.histc without min and max (the data's own range, known only at run time); "
                                  "pass min and max")
    x = input.reshape(-1)
    inside = (x >= min) & (x <= max)
    pos = ((x - min) / (max - min) * bins).clamp(0, bins - 1).to(torch.int64)
    hit = (pos.unsqueeze(-1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(-1)
    return hit.sum(0).to(input.dtype)


def weight_norm(v, g, dim=0):
    """``torch._weight_norm(v, g, dim)``, which both forms of ``torch.nn.utils`` weight
    normalisation call (the hook of ``weight_norm``, the parametrization of
    ``parametrizations.weight_norm``): ``v * (g / ||v||)``, the norm over every dimension but
    ``dim`` (over all of them for ``dim=-1``), as torch's ``norm_except_dim`` (which Thunder runs
    only opaquely: written here as a sum of squares)."""
    return v * (g / (v * v).sum(_other_dims(v.ndim, dim), keepdim=True).sqrt())


def _other_dims(ndim: int, dim: int) -> list[int]:
    """Every dimension of an ``ndim``-dimensional tensor but ``dim`` (all of them for -1)."""
    return [d for d in range(ndim) if dim == -1 or d != dim % ndim]


def as_dtype(dtype: torch.dtype):
    """``x.bool()`` and its kin (which Thunder runs only opaquely) as ``x.to(dtype)``."""
    def convert(x, memory_format=torch.preserve_format):
        return x.to(dtype)

    return convert


CONVERSIONS = {"bool": as_dtype(torch.bool), "int": as_dtype(torch.int32), "double": as_dtype(torch.float64),
               "bfloat16": as_dtype(torch.bfloat16), "byte": as_dtype(torch.uint8), "char": as_dtype(torch.int8)}


def new_filled(fill: float):
    """``x.new_zeros(shape)``, ``x.new_ones`` and ``x.new_empty`` (zeros: its values are
    unspecified), which Thunder runs only opaquely (DeepSeek-V4's compressor makes an empty
    ``new_zeros((batch, 0, head_dim))``), as ``torch.full`` with ``x``'s dtype and device unless given."""
    def new(x, *size, dtype=None, device=None, **_):  # requires_grad, layout, pin_memory: as torch.full's defaults
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return torch.full(tuple(shape), fill, dtype=dtype or x.dtype, device=device or x.device)

    return new


def new_full(x, size, fill_value, *, dtype=None, device=None, **_):
    """``x.new_full(size, value)`` as ``torch.full`` with ``x``'s dtype and device unless given."""
    return torch.full(tuple(size), fill_value, dtype=dtype or x.dtype, device=device or x.device)


CREATIONS = {"new_zeros": new_filled(0), "new_ones": new_filled(1), "new_empty": new_filled(0), "new_full": new_full}


def with_correction(fn):
    """``fn`` (``torch.var``, ``var_mean``; ``std`` and ``std_mean`` as the square root of the
    variance, which nvtp has no op for) called as Thunder 0.2.6 takes it:
    ``dim``, then ``keepdim`` and ``correction`` by keyword. torch's older form ``unbiased=b``
    (xLSTM's norm: ``x.var(dim=-1, keepdim=True, unbiased=False)``; Thunder: "unexpected keyword
    argument 'unbiased'") is ``correction=1`` if b else 0, by keyword or by position
    (``x.var(True)``, ``x.var(dim, unbiased, keepdim)``)."""
    def call(input, *args, dim=None, unbiased=None, keepdim=False, correction=None):
        rest = list(args)
        if rest and isinstance(rest[0], bool):  # var(x, unbiased)
            unbiased = rest.pop(0)
        elif rest:
            dim = rest.pop(0)
        if rest:
            unbiased = rest.pop(0)
        if rest:
            keepdim = rest.pop(0)
        if unbiased is not None:
            if correction is not None:
                raise TypeError(f"{fn.__name__}: unbiased and correction both given")
            correction = 1 if unbiased else 0
        return fn(input, dim, keepdim=keepdim, correction=1 if correction is None else correction)

    return call


def _std(input, dim=None, *, keepdim=False, correction=1):
    return torch.var(input, dim, keepdim=keepdim, correction=correction).sqrt()  # nvtp has no std op: sqrt of var


def _std_mean(input, dim=None, *, keepdim=False, correction=1):
    var, mean = torch.var_mean(input, dim, keepdim=keepdim, correction=correction)
    return var.sqrt(), mean


_std.__name__, _std_mean.__name__ = "std", "std_mean"
VARIANCES = {"var": with_correction(torch.var), "var_mean": with_correction(torch.var_mean),
             "std": with_correction(_std), "std_mean": with_correction(_std_mean)}
