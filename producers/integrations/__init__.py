"""Trainer integrations: a plain PyTorch loop, Hugging Face ``Trainer`` and verl.

Importing this package imports neither torch nor transformers (nor verl); each
integration imports its framework when it is used::

    from trainguard.producers.integrations.torch_loop import Guard
    from trainguard.producers.integrations.hf import TrainguardCallback
    from trainguard.producers.integrations.verl import VerlBackend, attach

See docs/integrations.md.
"""

from trainguard.producers.integrations._core import Decision, GuardBase

_LAZY = {
    "Guard": "trainguard.producers.integrations.torch_loop",
    "TrainguardCallback": "trainguard.producers.integrations.hf",
    "VerlBackend": "trainguard.producers.integrations.verl",
    "attach": "trainguard.producers.integrations.verl",
}

__all__ = ["Decision", "GuardBase", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
