"""The measuring room: how bench.py, rsd.py and experiments/ time the paper's decoders (timing), the flags that say
what to decode (flags), the machine's cost profile and the chooser (choose). Above the paper's path and beyond/: it
measures them."""
