"""msda-benchmarks: the timing and reporting tools, each run as ``python -m msda_benchmarks.<tool>`` (report,
bench, peers, overhead, deploy_bench, model_bench, locality, tune). No package imports them; they import the testkit's
cases and the backends."""

__version__ = "0.2.0"
