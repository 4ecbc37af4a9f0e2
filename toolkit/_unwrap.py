"""unwrap: peel torch.compile, DDP, DataParallel and AveragedModel wrappers off a module."""

import sys

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

from toolkit._checks import check_bool, check_type

# Wrappers that keep the wrapped module in ``.module``.
_MODULE_WRAPPERS = (DistributedDataParallel, DataParallel, AveragedModel)
_FIX = "Pass state.model."


def unwrap(model: nn.Module, *, keep_compile: bool = False) -> nn.Module:
    """Return the plain module inside any nesting of training wrappers.

    Peels, repeatedly and in any order: ``torch.compile``'s ``OptimizedModule``
    (``._orig_mod``), ``DistributedDataParallel`` and ``DataParallel`` (``.module``), and
    ``torch.optim.swa_utils.AveragedModel`` (``.module``, the averaged copy). So
    ``unwrap(torch.compile(DDP(net)))`` is ``net``. A module compiled in place with
    ``net.compile()`` and an FSDP2 ``fully_shard``-ed module are not wrappers and come back
    as they are. Use it to reach the parameters' real names (for a state dict without
    ``module.`` or ``_orig_mod.`` prefixes) or custom methods of the model.

    A peft ``PeftModel`` is the model, not a wrapper: it is kept (wrappers around it are
    peeled), as checkpoints, :func:`toolkit.plugins.ema` and :func:`toolkit.export_pretrained`
    need it: its names are those ``PeftModel.from_pretrained`` reads and its
    ``save_pretrained`` writes the adapter. Its ``get_base_model()`` is the transformers
    model with the adapter layers inside; ``merge_and_unload()`` folds them into the weights.

    Args:
        model: a ``torch.nn.Module``, wrapped or not.
        keep_compile: when ``True``, stop at the first ``OptimizedModule`` and return it, so
            the result still runs compiled (wrappers outside it are still peeled).

    Returns:
        The innermost module (the same object, not a copy), or the first compiled wrapper
        with ``keep_compile=True``.

    Raises:
        TypeError: when ``model`` is not a ``torch.nn.Module``, or ``keep_compile`` not a
            bool.

    Example:
        >>> import torch
        >>> from toolkit import unwrap
        >>> net = torch.nn.Linear(2, 2)
        >>> compiled = torch.compile(net, backend="eager")  # compiles on the first call only
        >>> wrapped = torch.nn.DataParallel(compiled)
        >>> unwrap(wrapped) is net
        True
        >>> unwrap(wrapped, keep_compile=True) is compiled
        True
    """
    check_type(isinstance(model, nn.Module), "unwrap", "model", "a torch.nn.Module", model, _FIX)
    check_bool("unwrap", "keep_compile", keep_compile)
    # torch._dynamo is imported by torch.compile; when it is not loaded no OptimizedModule
    # can exist, so look it up instead of importing it (a slow import) for every call.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    peeled = _MODULE_WRAPPERS if keep_compile else (*_MODULE_WRAPPERS, compiled)
    while isinstance(model, peeled):
        model = model.module if isinstance(model, _MODULE_WRAPPERS) else model._orig_mod
    return model
