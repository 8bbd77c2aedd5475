"""``python -m rcnn.doctor MODEL``: rcnn.doctor.command."""

import sys

from rcnn.doctor.command import main

sys.exit(main())
