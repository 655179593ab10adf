"""The adversarial precision suite: ``python -m flash_inductor.stability``.

``cases.py`` builds the problems, ``truth.py`` their fp64 reference, ``anchors.py`` the
implementations compared (our op under every schedule, SDPA's backends, FlexAttention, eager
attention), ``runner.py`` runs them and states the requirement the default schedule must meet,
``report.py`` prints and saves the results.
"""

from .cases import FULL, QUICK, Sizes, all_cases
from .runner import Requirement, Result, check_requirements, run_suite

__all__ = ["FULL", "QUICK", "Sizes", "all_cases", "run_suite", "check_requirements", "Requirement", "Result"]
