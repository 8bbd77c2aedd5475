"""The detector study: the question's Faster R-CNN, its box heads, the COCO reader, the knobs a sweep varies
and one trial. It builds on the doctor, the fix and the measurement core; they know nothing of it. Loads no
torch until a module that needs it is imported (``schema`` is read by the pipeline's file-only stages)."""
