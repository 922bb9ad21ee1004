"""Learning-rate schedule shared by the steps: linear warm-up, then cosine decay to zero."""
import math


def warmup_cosine(epochs, steps_per_epoch, warmup_epochs):
    """A LambdaLR factor: 0 -> 1 over the warm-up epochs, then cosine 1 -> 0 by the last epoch's
    end; a plain function (no state in checkpoints), carrying `steps_per_epoch` for
    checkpoint.resume to place other batch arithmetic by epochs."""
    total_steps, warmup_steps = epochs * steps_per_epoch, warmup_epochs * steps_per_epoch

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    factor.steps_per_epoch = steps_per_epoch
    return factor
