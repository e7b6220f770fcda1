"""One-off experiments, each run by hand as `python -m benchmarks.experiments.<name>`; not
maintained (see README.md for the question each answered and where its results are)."""
