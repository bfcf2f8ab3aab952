"""Planning: which layouts and batch sizes fit, and how fast each runs. Torch-free.

``timing`` (the step-time model: FLOPs, communication, overlap, MFU), ``batch_sizes`` (the
micro-batch sizes searched, shared with calibration's re-check), ``search`` (the batch-size
search of one layout against the memory model), ``planner`` (every layout a cluster allows,
searched and ranked by tokens/s/GPU).
"""
