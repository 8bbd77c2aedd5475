"""The detector study: the question's Faster R-CNN, its box heads, the COCO reader, and what its trials hand
the runner (``trial``: its Trainer and Subject, heads stepped in turn, the head timed alone; ``twin``: a head
and the reference head in one detector, what a trial's pair steps). It builds on the trial room, the doctor,
the fix and the measurement core; they know nothing of it. Loads no torch until a module that needs it is
imported (``schema`` is read by the pipeline's file-only stages)."""
