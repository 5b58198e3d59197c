"""What every program needs and no reader of the paper does: the command-line contract (one-line errors, outputs
checked), atomic files and locks, our checkpoint format, resumable training runs, compiled steps. Imports only the
paper's model and world; the measuring room is measure/."""
