"""The measurement core, for any model: a clock on the device's timeline, the statistics of step times and
when to stop measuring, the machine's fingerprint and measured peaks, FLOP counting and profiler tables.

It knows nothing of the doctor, the fix or the detector study, which build on it. ``settings`` and ``stats``
load without torch (the pipeline's file-reading stages use them)."""
