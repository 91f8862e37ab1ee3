"""msda-reference: the ``naive`` (float64 loops, test oracle), ``grid_sample`` (any device) and ``gather`` (the CPU
path) backends."""

__version__ = "0.2.0"
