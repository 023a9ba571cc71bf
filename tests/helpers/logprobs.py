"""What the tests compare recorded log-probs with: the model's own, teacher-forced."""

from __future__ import annotations

import numpy as np


def teacher_forced(model, prompt_ids, completion_ids) -> np.ndarray:
    """log p(completion_t | prompt, completion_<t) under ``model`` from one forward pass over
    the whole sequence, at temperature 1."""
    import torch

    ids = torch.as_tensor(np.concatenate([np.asarray(prompt_ids), np.asarray(completion_ids)]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp.gather(-1, torch.as_tensor(np.asarray(completion_ids).astype(np.int64))[:, None]).squeeze(-1).numpy()
