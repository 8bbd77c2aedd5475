"""The DVC stages: each module has a ``main()`` run as ``python -m pipeline.<stage>``."""
