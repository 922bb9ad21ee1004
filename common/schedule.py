"""Learning-rate schedule shared by the steps: linear warm-up, then cosine decay to zero."""
import math


def warmup_cosine(total_steps, warmup_steps):
    """A LambdaLR factor function: 0 -> 1 over warmup_steps, then cosine 1 -> 0 at total_steps.

    A plain function on purpose: LambdaLR saves no state for it, so checkpoints stay loadable with
    weights_only=True.
    """
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
