"""Readers of what a real run measured, all torch-free.

``timeline`` (a profiled step's memory samples, phase peaks, first-step anomalies),
``trace_files`` (chrome trace files read whole or as far as a cut one goes),
``intervals`` (union, intersection and difference of time intervals), ``profiler_traces``
(communication, overlap and the time split per rank), ``stragglers`` (the ranks the others
wait for), ``perf`` (where a step's time goes: FLOP/s, MFU, the roofline).
"""
