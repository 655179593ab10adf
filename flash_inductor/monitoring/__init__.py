"""Opt-in attention statistics: ``with flash_inductor.monitor() as m: ...; print(m.summary())``.

``session.py`` is the context manager and where records go; ``eager.py`` how eager calls
record (no copies: the output, the LSE and a backward hook on the gradients); ``ops.py`` the
identity ops that monitored compiled graphs insert; ``stats.py`` what one call records
(``device_stats.py`` launches the kernels that record it on a GPU); ``summary.py`` the per-site
table; ``naming.py`` how sites are named.
"""

from .session import Monitor, monitor
from .summary import MonitorSummary, NonFiniteEvent, SiteStats

__all__ = ["monitor", "Monitor", "MonitorSummary", "SiteStats", "NonFiniteEvent"]
