"""``python -m rcnn.bench``: one detector trial, or several heads stepped in turn (rcnn.detector.trial)."""

import sys

from rcnn.detector.trial import main

if __name__ == "__main__":
    sys.exit(main())
