"""Backward time by module for any PyTorch model, and the fix for convolutions that are matrix products in
disguise. Rooms, each importing only those below it:

- ``rcnn.bench``: ``python -m rcnn.bench``, one trial by hand, of the detector or of any model.
- ``rcnn.detector``: the detector study (model, heads, COCO reader, the Subject its trials hand the runner).
- ``rcnn.trial``: a trial of any model (the knobs and their vocabulary, the runner, settings in turn, the
  batch-size search).
- ``rcnn.doctor``: backward time by module for any model, flags and why; ``python -m rcnn.doctor``.
- ``rcnn.fix``: ``linearize(model, example)``, ``Conv2dAsLinear``, ``SparseMultiScaleRoIAlign``
  (``rcnn.disguise`` tells which modules are matrix products in disguise).
- ``rcnn.measure``: the clock, the training step, statistics, the machine's fingerprint and peaks.
- Shared plumbing: ``rules`` (allowed values, user errors), ``cli`` (every command's wrapper), ``outputs``
  (where a command may write), ``factory`` (a user's ``package.module:factory``).

No params file, no tracking: files are written only where a command's ``--out`` asks.
"""
