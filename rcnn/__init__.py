"""The detector, its box heads, the knobs, the timer and one trial. No tracking, no params file: it reads only
the dataset folder it is given and writes nothing."""
