"""prime-rl's mismatch figures, by release: filled in from the framework's own code (docs/parity.md)."""

from __future__ import annotations

from isoaudit.audit.frameworks.base import Framework

FRAMEWORK = Framework("prime-rl", "", ())
