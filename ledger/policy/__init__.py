"""Declarative policies: typed models, file loading, presets.

Only names live here (no pydantic), so the command line can list the presets without loading the
policy model.
"""

from __future__ import annotations

# The preset policies shipped with the ledger (``policies/<name>.yaml``).
PRESETS: tuple[str, ...] = ("goclaw", "fased", "failure-domain")
DEFAULT_PRESET = "failure-domain"
