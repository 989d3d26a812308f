"""Token sampling (torch compute, engine thread).

Rules:
- ``temperature <= 0`` is greedy (argmax, lowest id on ties).
- Otherwise: logits / temperature, softmax, nucleus (``top_p``: the smallest set of most likely
  tokens whose mass reaches top_p), then one draw from the request's own ``torch.Generator``, so
  a request with a seed gives the same tokens whatever else is running.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["make_generator", "sample"]


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor | np.ndarray, *, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from one row of logits (a torch tensor or a float32 numpy row: the engine passes numpy's
    view, so a greedy step runs no torch op)."""
    if temperature <= 0.0:  # numpy's argmax: torch's (the first of equal maxima), without torch's op overhead
        if isinstance(logits, np.ndarray):
            return int(logits.argmax())
        return int(logits.numpy().argmax()) if logits.dtype == torch.float32 and logits.device.type == "cpu" \
            and not logits.requires_grad \
            else int(torch.argmax(logits).item())
    if isinstance(logits, np.ndarray):
        logits = torch.from_numpy(logits)
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < top_p  # keep tokens until the mass before them reaches top_p
        keep[0] = True
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        idx = int(torch.multinomial(sorted_p, 1, generator=generator).item())
        return int(order[idx].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
