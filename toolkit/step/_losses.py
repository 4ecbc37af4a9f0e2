"""Loss functions that return a :class:`toolkit.LossSum` for exact count weighting."""

import torch

from toolkit._checks import check, check_type
from toolkit.step._step import LossSum


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> LossSum:
    """The next-token cross-entropy of a causal language model, summed, with its token count.

    Position ``t`` of ``logits`` predicts ``labels[..., t + 1]`` (the shift is done here, as
    Hugging Face models do: pass ``labels = input_ids`` with padding set to ``ignore_index``).
    The loss is summed over the tokens whose label is not ``ignore_index`` and the count is
    the number of those tokens, so :func:`toolkit.accumulate` gives the mean over every token
    of the window, whatever the micro-batches' lengths and padding (a mean of per-batch means
    would weight a short batch's tokens more). Logits in 16 bits are upcast to float32 for
    the loss. No host sync: the count stays a tensor.

    Args:
        logits: ``(..., T, vocab)`` scores, e.g. ``model(input_ids).logits``.
        labels: ``(..., T)`` token ids, ``ignore_index`` where no loss is wanted.
        ignore_index: the label of tokens left out (padding, a prompt).

    Returns:
        ``LossSum(total, count)`` for a loss function to return.

    Raises:
        TypeError: ``logits`` is not a tensor (the model's whole output: pass ``out.logits``).
        ValueError: ``labels`` does not have the shape of ``logits`` without its last axis
            (shifted already: pass them unshifted).

    Example:
        >>> import torch
        >>> from toolkit import causal_lm_loss
        >>> labels = torch.tensor([[5, 6, 7, -100]])  # the last token is padding
        >>> out = causal_lm_loss(torch.zeros(1, 4, 10), labels)
        >>> round(out.total.item() / out.count.item(), 4), out.count.item()  # log(10), 2 tokens
        (2.3026, 2)
    """
    who, fix = "causal_lm_loss", "Pass the logits: causal_lm_loss(out.logits, labels)."
    check_type(isinstance(logits, torch.Tensor), who, "logits", "a tensor", logits, fix)
    shape, want = tuple(labels.shape), tuple(logits.shape[:-1])
    fix = "Pass labels unshifted (input_ids): causal_lm_loss shifts them itself."
    check(shape == want, who, "labels' shape", f"logits' {want}", shape, fix)
    logits = logits.float() if logits.dtype.itemsize < 4 else logits
    targets = labels[..., 1:].flatten().long()  # cross_entropy takes int64 class indices only
    scores = logits[..., :-1, :].flatten(0, -2)
    total = torch.nn.functional.cross_entropy(
        scores, targets, ignore_index=ignore_index, reduction="sum"
    )
    return LossSum(total, (targets != ignore_index).sum())
