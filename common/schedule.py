"""Learning-rate schedule shared by the steps: linear warm-up, then cosine decay to zero."""
import math


def warmup_cosine(epochs, steps_per_epoch, warmup_epochs):
    """A LambdaLR factor function: 0 -> 1 over the warm-up epochs, then cosine 1 -> 0 at the end of the last epoch. A
    plain function: LambdaLR saves no state of it (weights_only=True loads checkpoints). It carries `steps_per_epoch`,
    by which checkpoint.resume places a run of other batch arithmetic by its progress in epochs."""
    total_steps, warmup_steps = epochs * steps_per_epoch, warmup_epochs * steps_per_epoch

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    factor.steps_per_epoch = steps_per_epoch
    return factor
