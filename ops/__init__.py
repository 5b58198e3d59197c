"""What every program needs and no reader of the paper does: flags and their checks, atomic files and locks, our
checkpoint format, timers, resumable training runs. Imports only the paper's core modules."""
