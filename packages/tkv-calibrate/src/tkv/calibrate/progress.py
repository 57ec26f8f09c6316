"""Progress bars (tqdm, with ETA) shared by every long step; silent when ``enabled`` is False."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

__all__ = ["LOG_INTERVAL_S", "bar"]

# seconds between updates when stderr is not a terminal (a CI log, ``2> file``): each update
# is a carriage-return rewrite, which a log keeps as one ever-longer line
LOG_INTERVAL_S = 30.0


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it"):
    """A tqdm bar on stderr with ETA; ``disable`` when not ``enabled``. On a terminal it
    redraws as tqdm does (0.1 s); otherwise at most every :data:`LOG_INTERVAL_S` seconds."""
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False, mininterval=0.1 if tty else LOG_INTERVAL_S)
