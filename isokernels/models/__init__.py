"""The project's own tiny models, written against :mod:`kernels.routing`."""

from .gdn_lm import GDNLM, GDNLMConfig

__all__ = ["GDNLM", "GDNLMConfig"]
