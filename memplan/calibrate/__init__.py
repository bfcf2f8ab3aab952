"""Calibration: measured records -> fitted profiles -> corrections of the analytic estimate.

Torch-free. ``records`` (one JSON file per measured grid point), ``grid`` (which points),
``features`` (the terms a device profile fits), ``fit`` (device profiles), ``model_fit`` (a
user model's profile), ``profile`` (the profile JSON), ``apply`` (corrections on an estimate or
a plan), ``refit`` (re-derive every committed profile from its records). The measuring itself,
which needs torch, lives in ``memplan.profile.calibrate_run``.
"""
