"""The project's own tiny models, written against :mod:`isoaudit.kernels.dispatch`."""

from .gdn_lm import GDNLM, GDNLMConfig

__all__ = ["GDNLM", "GDNLMConfig"]
