"""One run of the loop: its folder and ``latest`` link, its plan (new or resumed), what it is made of (task,
shape, device), how its processes end, its memory estimate and its metrics log."""
