"""A trial of any model: the knobs a sweep varies and their vocabulary (``schema``, without torch; ``knobs``),
the runner that builds a trainer for a knob setting, warms it up and times its training steps (``runner``),
the trials of a model a spec names, its settings stepped in turn and the batch-size search (``models``), and
the command-line pieces of ``python -m rcnn.bench`` (``command``). The detector hands the runner its own
Subject (rcnn.detector.trial); this room imports nothing of it. Loads no torch until a module that needs it
is imported."""
