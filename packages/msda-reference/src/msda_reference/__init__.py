"""msda-reference: the ``naive`` (float64 loops, test oracle) and ``grid_sample`` (any device) backends."""

__version__ = "0.2.0"
