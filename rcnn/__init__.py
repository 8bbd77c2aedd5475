"""The detector, its box heads, the knobs, the timer and one trial. No file I/O, no tracking."""
