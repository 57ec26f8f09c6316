"""Progress bars (tqdm, with ETA) shared by every long step; silent when ``enabled`` is False."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

__all__ = ["bar"]


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it"):
    """A tqdm bar on stderr with ETA; ``disable`` when not ``enabled``."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False)
