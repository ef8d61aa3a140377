"""nanoGPT's ``model.py`` for the nanoGPT-style scripts (`nanogpt_ddp.py`, `nanogpt_port.py`): the small GPT of
`own_loop_gpt` plus nanoGPT's ``estimate_mfu``, which ``train.py`` calls on ``raw_model``."""

from __future__ import annotations

import own_loop_gpt

BLOCK, VOCAB = own_loop_gpt.BLOCK, own_loop_gpt.VOCAB


class GPT(own_loop_gpt.GPT):
    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        """nanoGPT's shape: achieved flops (6N per token, forward and backward) over a nominal peak."""
        n_params = sum(p.numel() for p in self.parameters())
        flops_achieved = 6 * n_params * BLOCK * fwdbwd_per_iter / max(dt, 1e-9)
        return flops_achieved / 312e12
