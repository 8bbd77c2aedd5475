"""The measurement core, for any model: a clock on the device's timeline, the one training step (``step``),
the one warm-up-then-measure loop and the one way to step variants in turn (``loop``), the statistics of
step times, their paired ratio and when to stop measuring (``stats``), the machine's fingerprint and measured
peaks, FLOP counting and profiler tables.

It knows nothing of the doctor, the fix or the detector study, which build on it. ``settings``, ``stats`` and
``loop`` load without torch (the pipeline's file-reading stages use them)."""
