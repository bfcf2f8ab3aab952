"""Suite-wide settings that keep every run's outcome independent of the machine and its load.

Hypothesis: the default profile derandomises the search (the same examples on every run, so a
property either holds on them or fails every time), keeps no example database (a failure seen
once does not change what later runs try), and has no deadline and no too-slow health check
(both are wall-clock limits; a loaded 2-core machine trips them). ``HYPOTHESIS_PROFILE=explore``
searches with fresh random examples, for looking for counter-examples on purpose.
"""

from __future__ import annotations

import os

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a test dependency; only the modules that import it need it
    settings = None

if settings is not None:
    _UNTIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("deterministic", derandomize=True, database=None, **_UNTIMED)
    settings.register_profile("explore", derandomize=False, max_examples=500, **_UNTIMED)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
